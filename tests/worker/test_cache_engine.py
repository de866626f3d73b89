"""CacheEngine: layout, swap in/out and copy-on-write actually move the bytes, for every layer."""
import pytest
import torch

from pagedrun.kv.manager import KVCacheManager
from pagedrun.worker.cache_engine import CacheEngine

L, H, D, BS = 3, 2, 4, 4


def engine(num_gpu=6, num_cpu=4, dtype=torch.float32, device="cpu"):
    return CacheEngine(L, H, D, BS, num_gpu, num_cpu, dtype, device)


def fill(cache: list, seed: float) -> None:
    """Give every (layer, K/V, block) a distinct constant value."""
    for layer, (k, v) in enumerate(cache):
        for b in range(k.shape[0]):
            k[b].fill_(seed + 1000 * layer + b)
            v[b].fill_(-(seed + 1000 * layer + b))


def test_layout_and_views():
    e = engine()
    assert len(e.gpu_cache) == L and len(e.cpu_cache) == L
    k, v = e.gpu_cache[1]
    assert k.shape == (6, BS, H, D) and v.shape == (6, BS, H, D)
    assert k.is_contiguous() and v.is_contiguous()
    assert e.cpu_cache[0][0].shape == (4, BS, H, D)
    # The per-layer tensors are views of one allocation: writing a view writes the cache.
    k[2].fill_(7.0)
    assert torch.all(e.gpu_kv_cache[1, 0, 2] == 7.0)
    assert k.data_ptr() != v.data_ptr() != e.gpu_cache[0][0].data_ptr()


def test_block_bytes():
    assert CacheEngine.block_bytes(L, H, D, BS, torch.float16) == 2 * L * H * D * BS * 2
    assert CacheEngine.block_bytes(30, 3, 64, 16, "bfloat16") == 2 * 30 * 3 * 64 * 16 * 2
    e = engine(dtype="float16")
    per_block = e.gpu_kv_cache[:, :, 0].numel() * e.gpu_kv_cache.element_size()
    assert per_block == CacheEngine.block_bytes(L, H, D, BS, "float16")
    with pytest.raises(ValueError):
        engine(dtype="float99")


def test_swap_round_trip_moves_data_in_every_layer():
    e = engine()
    fill(e.gpu_cache, 1.0)
    fill(e.cpu_cache, 500.0)
    gpu_before = e.gpu_kv_cache.clone()
    e.swap_out([(4, 0), (1, 3)])
    for layer in range(L):
        ck, cv = e.cpu_cache[layer]
        gk, gv = e.gpu_cache[layer]
        assert torch.equal(ck[0], gk[4]) and torch.equal(cv[0], gv[4])
        assert torch.equal(ck[3], gk[1]) and torch.equal(cv[3], gv[1])
        assert torch.all(ck[1] == 500.0 + 1000 * layer + 1)  # untouched CPU block
    assert torch.equal(e.gpu_kv_cache, gpu_before)  # swap out only reads the GPU side
    # Overwrite the GPU blocks (they were freed and reused), then bring the data back elsewhere.
    e.gpu_kv_cache.zero_()
    e.swap_in([(0, 2), (3, 5)])
    for layer in range(L):
        gk, gv = e.gpu_cache[layer]
        assert torch.equal(gk[2], gpu_before[layer, 0, 4]) and torch.equal(gv[2], gpu_before[layer, 1, 4])
        assert torch.equal(gk[5], gpu_before[layer, 0, 1]) and torch.equal(gv[5], gpu_before[layer, 1, 1])
        assert torch.all(gk[0] == 0)


def test_copy_on_write_copies_all_layers_only_the_pairs():
    e = engine()
    fill(e.gpu_cache, 1.0)
    before = e.gpu_kv_cache.clone()
    e.copy([(0, 3), (5, 1)])
    after = e.gpu_kv_cache
    assert torch.equal(after[:, :, 3], before[:, :, 0])
    assert torch.equal(after[:, :, 1], before[:, :, 5])
    for b in (0, 2, 4, 5):
        assert torch.equal(after[:, :, b], before[:, :, b])


def test_copy_reads_sources_before_writing():
    e = engine()
    fill(e.gpu_cache, 1.0)
    before = e.gpu_kv_cache.clone()
    e.copy([(0, 1), (1, 2)])  # 1 is both a destination and a source
    assert torch.equal(e.gpu_kv_cache[:, :, 2], before[:, :, 1])


def test_copy_moves_int8_row_scales_with_their_blocks():
    """The one copy-on-write path on every backend: an int8 cache's per-row scales live beside
    its blocks (block_tensors) and are copied with them."""
    from pagedrun.attention.kv_cache_spec import kv_cache_spec

    e = CacheEngine(L, H, D, BS, 6, 0, torch.float32, "cpu", kv_cache_spec("int8", torch.float32))
    assert e.gpu_kv_scales is not None and len(e.block_tensors) == 2
    g = torch.Generator().manual_seed(2)
    e.gpu_kv_cache.copy_(torch.randint(-127, 128, e.gpu_kv_cache.shape, generator=g, dtype=torch.int8))
    e.gpu_kv_scales.copy_(torch.rand(e.gpu_kv_scales.shape, generator=g))
    cache, scales = e.gpu_kv_cache.clone(), e.gpu_kv_scales.clone()
    e.copy([(1, 3), (1, 5)])
    for before, after in ((cache, e.gpu_kv_cache), (scales, e.gpu_kv_scales)):
        assert torch.equal(after[:, :, 3], before[:, :, 1]) and torch.equal(after[:, :, 5], before[:, :, 1])
        for b in (0, 1, 2, 4):
            assert torch.equal(after[:, :, b], before[:, :, b])


def test_empty_and_invalid_mappings():
    e = engine()
    e.swap_in([])
    e.swap_out([])
    e.copy([])
    with pytest.raises(ValueError):
        e.copy([(0, 1), (2, 1)])
    with pytest.raises(IndexError):
        e.swap_out([(6, 0)])
    with pytest.raises(IndexError):
        e.swap_in([(0, 6)])


def test_manager_plans_drive_the_engine():
    """End to end: values written for a forked sequence survive CoW and a swap round trip."""
    m = KVCacheManager(6, BS, num_cpu_blocks=6, watermark=0.0)
    e = engine(num_gpu=6, num_cpu=6)
    m.allocate(1, [1, 2, 3, 4, 5, 6])

    def write(seq, start, end, base):
        for p, slot in zip(range(start, end), m.get_slots(seq, start, end)):
            for k, v in e.gpu_cache:
                k.view(-1, H, D)[slot] = base + p
                v.view(-1, H, D)[slot] = -(base + p)

    def read(seq):
        table = m.get_block_table(seq)
        cache = e.cpu_cache if m.is_swapped(seq) else e.gpu_cache
        out = []
        for p in range(m.get_num_tokens(seq)):
            slot = table[p // BS] * BS + p % BS
            vals = {float(k.view(-1, H, D)[slot][0, 0]) for k, _ in cache}
            assert len(vals) == 1
            out.append(vals.pop())
        return out

    write(1, 0, 6, 0.0)
    m.fork(1, 2)
    e.copy(m.append_slots(2, 1))
    write(2, 6, 7, 100.0)
    e.copy(m.append_slots(1, 1))
    write(1, 6, 7, 200.0)
    assert read(1) == [0, 1, 2, 3, 4, 5, 206] and read(2) == [0, 1, 2, 3, 4, 5, 106]
    e.swap_out(m.swap_out([1, 2]))
    e.gpu_kv_cache.fill_(-1.0)
    assert read(2) == [0, 1, 2, 3, 4, 5, 106]
    e.swap_in(m.swap_in([1, 2]))
    assert read(1) == [0, 1, 2, 3, 4, 5, 206] and read(2) == [0, 1, 2, 3, 4, 5, 106]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_swap_uses_pinned_memory_and_round_trips():
    e = engine(device="cuda", dtype=torch.float16)
    assert e.gpu_kv_cache.is_cuda and e.cpu_kv_cache.is_pinned()
    fill(e.gpu_cache, 1.0)
    before = e.gpu_kv_cache.clone()
    e.swap_out([(0, 1), (3, 2)])
    e.gpu_kv_cache.zero_()
    e.swap_in([(1, 4), (2, 5)])
    e.copy([(4, 0)])
    torch.cuda.synchronize()
    assert torch.equal(e.gpu_kv_cache[:, :, 4], before[:, :, 0])
    assert torch.equal(e.gpu_kv_cache[:, :, 5], before[:, :, 3])
    assert torch.equal(e.gpu_kv_cache[:, :, 0], before[:, :, 0])
