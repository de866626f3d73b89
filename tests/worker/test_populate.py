"""worker/populate.py: blocks are resident before use, the rest of the cache is not committed, and the
block pool's high-water mark covers every block it ever handed out."""
from __future__ import annotations

import ctypes
import mmap
import random

import pytest
import torch

from pagedrun.kv.block_pool import BlockPool
from pagedrun.worker.populate import CachePopulator


def resident_pages(addr: int, length: int) -> list[bool]:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    start = addr & ~(mmap.PAGESIZE - 1)
    n = (addr + length - start + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * n)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(n * mmap.PAGESIZE), vec) == 0
    return [bool(v & 1) for v in vec]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_populates_a_prefix_of_blocks_in_every_plane(threads):
    # 3 layers x (K, V) x 512 blocks x 16 KiB: 96 MiB in a fresh anonymous mapping of its own, so
    # no page is resident until written (torch.empty may reuse heap memory other tests touched).
    # 6 planes over 1, 2 or 3 threads (each thread takes every threads-th plane).
    shape = (3, 2, 512, 16, 4, 64)
    mapping = mmap.mmap(-1, 4 * 3 * 2 * 512 * 16 * 4 * 64)
    cache = torch.frombuffer(mapping, dtype=torch.float32).view(shape)
    pop = CachePopulator([cache], chunk_blocks=8, threads=threads)
    if not pop.active:  # a kernel before 5.14: the populator must say so and do nothing
        assert pop.disabled_reason and pop.populated == 0
        return
    block_bytes = 16 * 4 * 64 * 4
    pop.ensure(3)
    assert pop.populated == 8  # a whole chunk ahead
    pop.ensure(5)
    assert pop.populated == 8  # nothing to do
    pop.ensure(20)
    assert pop.populated == 20
    for plane in cache.flatten(0, 1):
        assert all(resident_pages(plane.data_ptr(), 20 * block_bytes))
        # Far beyond the populated prefix nothing was committed (2 MiB away: past any huge page).
        far = plane.data_ptr() + 200 * block_bytes
        assert not any(resident_pages(far, 64 * block_bytes))
    pop.ensure(10_000)
    assert pop.populated == 512
    assert pop.blocks_committed == 512 and pop.seconds > 0  # what `pagedrun bench` reports


def test_high_water_mark_covers_every_block_ever_used():
    pool = BlockPool(64, enable_caching=False)
    rng = random.Random(0)
    held, used = [], set()
    for _ in range(500):
        if held and (rng.random() < 0.5 or pool.num_free_blocks == 0):
            pool.free_blocks([held.pop(rng.randrange(len(held)))])
        else:
            blocks = pool.get_new_blocks(rng.randint(1, min(4, pool.num_free_blocks)))
            held += blocks
            used |= {b.block_id for b in blocks}
        assert used == set(range(pool.num_blocks_touched))


@pytest.mark.slow


def test_engine_populates_ahead_of_the_blocks_it_writes(tmp_path):
    from tiny_models import make_tiny_model

    from pagedrun.config.recipe import load_recipe
    from pagedrun.llm import LLM

    d = make_tiny_model("llama", tmp_path / "m")
    llm = LLM(load_recipe(None, [f"model.path={d}", "cache.num_blocks=256", "cache.block_size=8"]))
    llm.generate([[5, 6, 7] * 20] * 4)
    eng = llm.engine
    assert eng.kv.num_gpu_blocks_touched > 0
    if eng.worker.populator.active:
        assert eng.worker.populator.populated >= eng.kv.num_gpu_blocks_touched
