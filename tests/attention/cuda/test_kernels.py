"""kernels/cuda/*.cu run on the CPU through the CUDA emulator, checked against a float64 numpy reference.

Matrix (small problems, the emulator costs ~ms per launch; the compiles are what costs, so each
dtype's variants share one module, built for all three dtypes in parallel):
- v1: every head size (block size rotating, GQA ratio 1/2/8 rotating), every block size x GQA ratio;
- v2: > 512 tokens, several partitions, two variants per dtype, checked against v1 as well;
- ragged seq_lens with 1, exact multiples of the block size and partial last blocks, shuffled block
  tables, every unused cache slot poisoned with NaN (a read past the end shows up as NaN);
- round_robin and greedy schedules give bit-identical outputs (no races on shared memory);
- sliding window and soft-capping: windows at W - 1, W, W + 1 keys and on block and partition
  boundaries, v1 and v2 (whose grid skips the partitions below a window), NaN placeholder blocks
  below every window, the window-aware v1/v2 choice and sizes, the emulated backend's forward;
- reshape_and_cache (negative slots skipped);
- the emulated backend on mixed prefill (+cached prefix) / decode metadata, and the registry.

The helpers here (make_case, reference, ...) are reused by test_kernel_mutations.py and gpu/.
"""
from __future__ import annotations

import functools
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from pagedrun.attention.cuda import kernels as K
from pagedrun.attention.metadata import AttentionMetadata

DTYPES = tuple(K.DTYPES)
# max |out - ref| / max |ref|. Output rounding alone is 2^-11 (fp16) / 2^-8 (bf16) relative.
TOL = {"float16": 6e-4, "bfloat16": 4e-3, "float32": 3e-6}
GQA_RATIOS = (1, 2, 8)
V2_VARIANTS = {
    "float16": [(64, 16), (80, 8)],
    "bfloat16": [(128, 32), (96, 16)],
    "float32": [(256, 8), (64, 32)],
}
V2_SEQ_LENS = [1, 300, 512, 513, 1200, 1537]


def emulator_or_skip():
    try:
        import pagedrun.build.cudaemu as emu  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the machine
        pytest.skip(f"CUDA emulator unavailable: {e}")
    return emu


# ------------------------------------------------------------------ dtype helpers


def to_device_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """float64 -> the array the kernel reads (bf16 as uint16 bits, round to nearest even)."""
    if dtype == "float16":
        return x.astype(np.float16)
    if dtype == "float32":
        return x.astype(np.float32)
    f = np.ascontiguousarray(x, dtype=np.float32)
    u = f.view(np.uint32).astype(np.uint64)
    nan = np.isnan(f)
    bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    bits[nan] = 0x7FC0
    return bits


def to_f64(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-6))


def assert_close(out: np.ndarray, ref: np.ndarray, dtype: str, what: str = "") -> None:
    assert np.isfinite(out).all(), f"{what}: non-finite output (read past the end / unwritten memory?)"
    err = rel_err(out, ref)
    assert err <= TOL[dtype], f"{what}: relative error {err:.3g} > {TOL[dtype]:.1g} ({dtype})"


# ------------------------------------------------------------------ cases


@dataclass
class Case:
    variant: K.KernelVariant
    num_heads: int
    num_kv_heads: int
    seq_lens: list[int]
    scale: float
    query: np.ndarray  # [S, H, D] device dtype
    key_cache: np.ndarray  # [NB, bs, KVH, D]
    value_cache: np.ndarray
    block_tables: np.ndarray  # int32 [S, max_blocks]
    seq_lens_arr: np.ndarray  # int32 [S]

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens)

    def empty_out(self, xp=np):
        return xp.empty(self.query.shape, dtype=self.query.dtype)

    def reference(self, window: int = 0, softcap: float = 0.0, sinks: np.ndarray | None = None) -> np.ndarray:
        """float64 attention of each query over its first seq_len cached tokens: the last `window`
        of them when window > 0, logits capped at softcap * tanh(logit / softcap) when softcap > 0,
        head h's sinks[h] one more logit (a zero value vector) in its softmax when sinks is given."""
        d = self.variant.dtype
        q, kc, vc = to_f64(self.query, d), to_f64(self.key_cache, d), to_f64(self.value_cache, d)
        bs, D = self.variant.block_size, self.variant.head_size
        group = self.num_heads // self.num_kv_heads
        out = np.zeros(q.shape)
        for s, L in enumerate(self.seq_lens):
            if L == 0:
                continue
            blocks = self.block_tables[s, : -(-L // bs)]
            first = first_key(L, window)
            k = kc[blocks].reshape(-1, self.num_kv_heads, D)[first:L]
            v = vc[blocks].reshape(-1, self.num_kv_heads, D)[first:L]
            for h in range(self.num_heads):
                logits = k[:, h // group] @ q[s, h] * self.scale
                if softcap > 0:
                    logits = softcap * np.tanh(logits / softcap)
                sink = -np.inf if sinks is None else float(sinks[h])
                top = max(logits.max(), sink)
                p = np.exp(logits - top)
                out[s, h] = (p / (p.sum() + np.exp(sink - top))) @ v[:, h // group]
        return out


def first_key(seq_len: int, window: int) -> int:
    """The first key position the query of a sequence of seq_len tokens sees (the backend contract)."""
    return max(0, seq_len - window) if window > 0 else 0


def poison_below_window(case: Case, window: int) -> Case:
    """What the hybrid KV manager leaves a sliding layer: every block wholly below a sequence's window
    is a placeholder (here: the NaN block that pads the tables), and the first block's keys below the
    window are NaN as well, so any read of a key outside the window poisons the output."""
    bs = case.variant.block_size
    poison = int(case.block_tables[0, -1])  # the padding column: always the all-NaN block
    flat_k = case.key_cache.reshape(-1, *case.key_cache.shape[2:])
    flat_v = case.value_cache.reshape(-1, *case.value_cache.shape[2:])
    assert np.shares_memory(flat_k, case.key_cache) and np.shares_memory(flat_v, case.value_cache)
    nan = to_device_dtype(np.full(flat_k.shape[1:], np.nan), case.variant.dtype)
    for s, L in enumerate(case.seq_lens):
        first = first_key(L, window)
        case.block_tables[s, : first // bs] = poison
        for t in range(first // bs * bs, first):
            slot = int(case.block_tables[s, t // bs]) * bs + t % bs
            flat_k[slot], flat_v[slot] = nan, nan
    return case


def make_case(
    variant: K.KernelVariant, seq_lens: list[int], num_heads: int, num_kv_heads: int, seed: int = 0
) -> Case:
    """Random q/K/V (never zeros), shuffled physical blocks, every slot no live token uses = NaN."""
    rng = np.random.default_rng(seed)
    bs, D = variant.block_size, variant.head_size
    nblocks = [-(-L // bs) for L in seq_lens]
    num_blocks = sum(nblocks) + 2  # +2 spare blocks, one of them pads the block tables
    perm = rng.permutation(num_blocks)
    poison_block = int(perm[-1])
    max_blocks = max(nblocks) + 1
    block_tables = np.full((len(seq_lens), max_blocks), poison_block, dtype=np.int32)
    k = np.full((num_blocks, bs, num_kv_heads, D), np.nan)
    v = np.full((num_blocks, bs, num_kv_heads, D), np.nan)
    pos = 0
    for s, (L, n) in enumerate(zip(seq_lens, nblocks)):
        block_tables[s, :n] = perm[pos : pos + n]
        pos += n
        for t in range(L):
            b, o = block_tables[s, t // bs], t % bs
            k[b, o] = rng.standard_normal((num_kv_heads, D))
            v[b, o] = rng.standard_normal((num_kv_heads, D))
    # q a bit larger than K/V so the softmax is peaked and partitions have different maxima
    q = 1.5 * rng.standard_normal((len(seq_lens), num_heads, D))
    d = variant.dtype
    return Case(
        variant, num_heads, num_kv_heads, list(seq_lens), 1.0 / math.sqrt(D),
        to_device_dtype(q, d), to_device_dtype(k, d), to_device_dtype(v, d),
        block_tables, np.asarray(seq_lens, dtype=np.int32),
    )


def run_case(ker: K.PagedKernels, case: Case, version: str | None, window: int = 0,
             softcap: float = 0.0, sinks: np.ndarray | None = None) -> tuple[np.ndarray, str]:
    out = case.empty_out()
    used = ker.paged_attention(
        out, case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens_arr,
        case.max_seq_len, case.scale, version=version, window=window, softcap=softcap, sinks=sinks,
    )
    return to_f64(out, case.variant.dtype), used


def heads_for(ratio: int) -> tuple[int, int]:
    """(num_heads, num_kv_heads) with num_heads / num_kv_heads == ratio, few heads in all."""
    kv = 1 if ratio >= 8 else 2
    return ratio * kv, kv


# ------------------------------------------------------------------ the test matrix's variants


def head_sweep(dtype: str) -> list[K.KernelVariant]:
    """Every head size once per dtype; block sizes rotate so each (dtype, block) pair appears too."""
    di = DTYPES.index(dtype)
    return [K.KernelVariant(dtype, h, K.BLOCK_SIZES[(i + di) % 3]) for i, h in enumerate(K.HEAD_SIZES)]


def block_sweep(dtype: str) -> list[K.KernelVariant]:
    return [K.KernelVariant(dtype, 64, b) for b in K.BLOCK_SIZES]


def v2_variants(dtype: str) -> list[K.KernelVariant]:
    return [K.KernelVariant(dtype, h, b) for h, b in V2_VARIANTS[dtype]]


def grouped_variants(dtype: str) -> list[K.KernelVariant]:
    """The GQA-grouped variants the backend tests reach (a backend groups by the query's heads)."""
    cases = [(d, D, bs, H, KVH) for d, D, bs, H, KVH, _ in BACKEND_CASES] + [("float16", 64, 16, 4, 2)]
    return list(dict.fromkeys(K.KernelVariant(d, D, bs, "auto", K.group_for(H, KVH))
                              for d, D, bs, H, KVH in cases if d == dtype and K.group_for(H, KVH) > 1))


def module_names(dtype: str) -> list[str]:
    v1 = dict.fromkeys(head_sweep(dtype) + block_sweep(dtype) + v2_variants(dtype))
    names = [n for v in v1 for n in v.name_expressions(("v1",))]
    names += [n for v in v2_variants(dtype) + grouped_variants(dtype) for n in v.name_expressions(("v1", "v2"))]
    names += [n for v in grouped_variants(dtype) for n in v.name_expressions(("prefill",))]  # the backends' varlen
    names += v2_variants(dtype)[0].name_expressions(("cache",))
    return list(dict.fromkeys(names))


@functools.lru_cache(maxsize=None)
def emu_kernels(dtype: str, schedule: str = "round_robin") -> dict[K.KernelVariant, K.PagedKernels]:
    """All of one dtype's test variants in one emulator module (one g++ run, cached on disk)."""
    from pagedrun.build.cudaemu import EmuModule

    module = EmuModule(
        K.full_source(), name_expressions=module_names(dtype), schedule=schedule,
        filename="kernels/cuda/paged_attention.cu",
    )
    variants = dict.fromkeys(head_sweep(dtype) + block_sweep(dtype) + v2_variants(dtype) + grouped_variants(dtype))
    return {v: K.PagedKernels(v, module, np) for v in variants}


@pytest.fixture(scope="module")
def emu():
    emulator_or_skip()
    # The three g++ builds dominate a cold run: overlap them on the two cores.
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(emu_kernels, DTYPES))
    return emu_kernels


# ------------------------------------------------------------------ paged attention v1


HEAD_CASES = [(d, i) for d in DTYPES for i in range(len(K.HEAD_SIZES))]


@pytest.mark.parametrize(
    "dtype,i", HEAD_CASES, ids=[f"{d}-h{K.HEAD_SIZES[i]}" for d, i in HEAD_CASES]
)
def test_v1_every_head_size(emu, dtype, i):
    variant = head_sweep(dtype)[i]
    bs = variant.block_size
    num_heads, num_kv = heads_for(GQA_RATIOS[i % 3])
    case = make_case(variant, [1, bs, 2 * bs + 3, 3 * bs - 1], num_heads, num_kv, seed=i)
    out, used = run_case(emu(dtype)[variant], case, "v1")
    assert used == "v1"
    assert_close(out, case.reference(), dtype, str(variant))


BLOCK_CASES = [(d, b, r) for d in DTYPES for b in K.BLOCK_SIZES for r in GQA_RATIOS]


@pytest.mark.parametrize(
    "dtype,block_size,ratio", BLOCK_CASES, ids=[f"{d}-bs{b}-gqa{r}" for d, b, r in BLOCK_CASES]
)
def test_v1_block_sizes_and_gqa(emu, dtype, block_size, ratio):
    variant = K.KernelVariant(dtype, 64, block_size)
    num_heads, num_kv = heads_for(ratio)
    seq_lens = [37, 1, 2 * block_size, 5 * block_size - 2, 70]
    case = make_case(variant, seq_lens, num_heads, num_kv, seed=block_size + ratio)
    out, _ = run_case(emu(dtype)[variant], case, "v1")
    assert_close(out, case.reference(), dtype, str(variant))


def test_v1_zero_length_sequence_gives_zeros(emu):
    variant = K.KernelVariant("float32", 64, 16)
    case = make_case(variant, [5, 20], 2, 2)
    case.seq_lens_arr[0] = 0
    out, _ = run_case(emu("float32")[variant], case, "v1")
    assert (out[0] == 0).all()
    case.seq_lens[0] = 0
    assert_close(out, case.reference(), "float32")


# ------------------------------------------------------------------ paged attention v2


V2_CASES = [(d, i) for d in DTYPES for i in range(2)]


@pytest.mark.parametrize(
    "dtype,i", V2_CASES,
    ids=[f"{d}-h{V2_VARIANTS[d][i][0]}-bs{V2_VARIANTS[d][i][1]}" for d, i in V2_CASES],
)
def test_v2_several_partitions(emu, dtype, i):
    variant = v2_variants(dtype)[i]
    case = make_case(variant, V2_SEQ_LENS, 4, 2, seed=100 + i)
    assert K.num_partitions(case.max_seq_len) == 4
    ker = emu(dtype)[variant]
    ref = case.reference()
    out2, used = run_case(ker, case, "v2")
    assert used == "v2"
    assert_close(out2, ref, dtype, f"v2 {variant}")
    out1, _ = run_case(ker, case, "v1")
    assert_close(out1, ref, dtype, f"v1 {variant}")


def test_default_dispatch_follows_vllm_rule(emu):
    variant = v2_variants("float16")[0]
    ker = emu("float16")[variant]
    long_case = make_case(variant, [600, 3], 2, 1)  # 2 partitions, 4 (seq, head) blocks -> v2
    out, used = run_case(ker, long_case, None)
    assert used == "v2"
    assert_close(out, long_case.reference(), "float16")
    short_case = make_case(variant, [300, 3], 2, 1)  # one partition -> v1
    assert run_case(ker, short_case, None)[1] == "v1"


def test_v1_v2_rule():
    assert K.use_v1(512) and K.use_v1(1)  # one partition, whatever the batch
    assert not K.use_v1(513)  # two partitions
    assert not K.use_v1(4096)  # vLLM's rule took v1 here with 64 x 32 blocks: 1.65x slower on the H200
    assert not K.use_v1(8193)
    assert K.num_partitions(1) == 1 and K.num_partitions(512) == 1 and K.num_partitions(1537) == 4


# ------------------------------------------------------------------ sliding window and soft-capping


def launches(ker: K.PagedKernels) -> list[tuple[str, tuple, int]]:
    """Record every launch of ker (name, grid, dynamic shared memory) and still run it."""
    seen = []
    real = ker.function

    def spy(name, smem=0):
        fn = real(name, smem)
        return lambda grid, block, args, shared_mem=0: seen.append((name, grid, shared_mem)) or fn(
            grid, block, args, shared_mem=shared_mem)

    ker.function = spy
    return seen


def window_lens(window: int, bs: int) -> list[int]:
    """Lengths around a window of W keys: W - 1, W, W + 1 (all of the sequence, then one key dropped),
    the window's first key on a block boundary and one key either side of it, and a single token."""
    aligned = -(-window // bs) * bs + window  # first key = ceil(W / bs) * bs: the first block starts the window
    return [window - 1, window, window + 1, aligned - 1, aligned, aligned + 1, 1, window + 3 * bs + 5]


# (window, softcap) per dtype's first v2 variant: a window that is not a block multiple, one that is,
# a window of one key (the query itself), and each with the cap on.
WINDOW_CASES = [(20, 0.0), (32, 0.0), (1, 0.0), (20, 4.0), (48, 2.5)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,softcap", WINDOW_CASES, ids=[f"w{w}-cap{c:g}" for w, c in WINDOW_CASES])
def test_window_and_softcap_v1_v2(emu, dtype, window, softcap):
    """v1 and v2 (one partition here) over windows at W - 1, W, W + 1 keys and at block boundaries,
    with NaN placeholder blocks below each window: equal to the windowed float64 reference."""
    variant = v2_variants(dtype)[0]
    bs = variant.block_size
    case = poison_below_window(make_case(variant, window_lens(window, bs), 4, 2, seed=window + bs), window)
    ref = case.reference(window, softcap)
    for version in ("v1", "v2"):
        out, used = run_case(emu(dtype)[variant], case, version, window, softcap)
        assert used == version
        assert_close(out, ref, dtype, f"{variant} {version} window {window} softcap {softcap}")


def test_softcap_changes_the_output(emu):
    """The cap is applied (a kernel ignoring it would pass a loose check on small logits): with q scaled
    up the logits reach past the cap, and the capped output differs from the uncapped reference."""
    variant = v2_variants("float32")[1]
    case = make_case(variant, [40, 9, 70], 2, 1, seed=5)
    case.query *= 4
    out, _ = run_case(emu("float32")[variant], case, "v1", 0, 3.0)
    assert_close(out, case.reference(0, 3.0), "float32", "softcap 3")
    assert rel_err(out, case.reference()) > 0.05


@pytest.mark.parametrize("dtype", DTYPES)
def test_window_v2_launches_only_the_partitions_of_the_window(emu, dtype):
    """Long sequences under a window of 600 or 1,024 keys: v2's grid covers the window (3 partitions, the
    most either can touch, instead of 4), the window's first key falls inside a partition, on a partition
    boundary (1024) and below it, placeholders are NaN; v2 and v1 (whose shared memory shrinks to the
    window) both match."""
    variant = v2_variants(dtype)[1]
    ker = emu(dtype)[variant]
    for window, lens in ((600, [1537, 1624, 1200, 599, 601, 3]), (1024, [1537, 2048, 1025, 700])):
        case = poison_below_window(make_case(variant, lens, 2, 1, seed=window), window)
        ref = case.reference(window)
        seen = launches(ker)
        try:
            out2, used = run_case(ker, case, None, window)
            out1, _ = run_case(ker, case, "v1", window)
        finally:
            del ker.function  # the class's again (ker is shared by the module's tests)
        assert used == "v2"
        parts = K.num_partitions(case.max_seq_len, window)
        assert parts == 3 < K.num_partitions(case.max_seq_len) == 4
        assert seen[0][1][2] == parts and seen[1][0] == variant.reduce_name
        assert seen[2][2] == K.v1_shared_mem(case.max_seq_len, variant.head_size, variant.block_size, 1, window)
        assert_close(out2, ref, dtype, f"v2 {variant} window {window}")
        assert_close(out1, ref, dtype, f"v1 {variant} window {window}")


def test_window_picks_v1_when_the_window_fits_one_partition(emu):
    variant = v2_variants("float16")[0]
    case = poison_below_window(make_case(variant, [1500, 700, 3], 2, 1, seed=2), 300)
    out, used = run_case(emu("float16")[variant], case, None, 300, 2.0)
    assert used == "v1"  # 1,500 tokens, but no query sees more than 300 of them
    assert_close(out, case.reference(300, 2.0), "float16", "v1 under a window")


def test_window_sizes_and_rule():
    assert K.key_span(4096, 0) == 4096 and K.key_span(4096, 1024) == 1024 and K.key_span(100, 1024) == 100
    assert K.use_v1(4096, 512) and not K.use_v1(4096, 513) and K.use_v1(300, 4096)
    # the window's keys [L - W, L) touch at most 1 + ceil((W - 1) / 512) partitions
    assert K.num_partitions(4096, 1) == 1 and K.num_partitions(4096, 512) == 2 and K.num_partitions(4096, 513) == 2
    assert K.num_partitions(4096, 1025) == 3 and K.num_partitions(4096, 600) == 3 and K.num_partitions(4096) == 8
    assert K.num_partitions(600, 4096) == 2
    # and at most 1 + ceil((W - 1) / block_size) cache blocks: v1's logits
    assert K.v1_shared_mem(8192, 64, 16, 1, 100) == 4 * max(8 * 16, 4 * 64)
    assert K.v1_shared_mem(8192, 64, 16, 2, 4096) == 2 * 4 * 257 * 16
    assert K.v1_shared_mem(40, 64, 16, 1, 4096) == K.v1_shared_mem(40, 64, 16)
    for L in range(1, 200):  # the bounds hold for every length (brute force over the window's blocks)
        for w in (1, 7, 16, 17, 33):
            first = first_key(L, w)
            assert -(-L // 16) - first // 16 <= K.spanned_units(200, w, 16)


def test_window_past_every_sequence_is_full_attention(emu):
    """A window no sequence reaches (even one past int32) launches as no window: the same bits."""
    variant = v2_variants("bfloat16")[1]
    case = make_case(variant, [40, 9, 700], 2, 1, seed=8)
    ker = emu("bfloat16")[variant]
    full, _ = run_case(ker, case, "v2")
    for window in (700, 2**40):
        np.testing.assert_array_equal(run_case(ker, case, "v2", window)[0], full)


def test_window_and_softcap_argument_checks(emu):
    variant = v2_variants("float32")[1]
    case = make_case(variant, [40, 9], 2, 2)
    ker = emu("float32")[variant]
    for kw, match in (({"window": -1}, "window -1"), ({"softcap": -1.0}, "softcap"),
                      ({"softcap": float("nan")}, "softcap")):
        with pytest.raises(ValueError, match=match):
            ker.paged_attention(case.empty_out(), case.query, case.key_cache, case.value_cache,
                                case.block_tables, case.seq_lens_arr, 40, case.scale, **kw)


# ------------------------------------------------------------------ schedules


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_schedule_is_bit_identical(emu, dtype):
    """Reductions have a fixed order, so any schedule must give the same bits; a race would not."""
    emulator_or_skip()
    greedy = emu_kernels(dtype, "greedy")  # same source: a disk-cache hit, no second build
    for variant in v2_variants(dtype):
        case = make_case(variant, V2_SEQ_LENS[:4] + [700], 4, 2, seed=7)
        for version in ("v1", "v2"):
            a, _ = run_case(emu(dtype)[variant], case, version)
            b, _ = run_case(greedy[variant], case, version)
            assert np.array_equal(a, b), f"{variant} {version}: schedules disagree"
            assert_close(b, case.reference(), dtype, f"greedy {variant} {version}")


# ------------------------------------------------------------------ cache ops


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache(emu, dtype):
    rng = np.random.default_rng(3)
    variant = v2_variants(dtype)[0]
    bs, D, kvh, nb, T = variant.block_size, variant.head_size, 3, 6, 9
    key = to_device_dtype(rng.standard_normal((T, kvh, D)), dtype)
    value = to_device_dtype(rng.standard_normal((T, kvh, D)), dtype)
    kc = to_device_dtype(rng.standard_normal((nb, bs, kvh, D)), dtype)
    vc = to_device_dtype(rng.standard_normal((nb, bs, kvh, D)), dtype)
    slots = rng.choice(nb * bs, size=T, replace=False).astype(np.int64)
    slots[[2, 5]] = -1  # padding tokens: not written
    exp_k, exp_v = kc.copy(), vc.copy()
    for t, s in enumerate(slots):
        if s >= 0:
            exp_k[s // bs, s % bs] = key[t]
            exp_v[s // bs, s % bs] = value[t]
    emu(dtype)[variant].reshape_and_cache(key, value, kc, vc, slots)
    assert np.array_equal(kc.view(np.uint8), exp_k.view(np.uint8))
    assert np.array_equal(vc.view(np.uint8), exp_v.view(np.uint8))


def test_reshape_and_cache_strided_key(emu):
    """key/value as column slices of a fused qkv row: token stride != row size."""
    rng = np.random.default_rng(4)
    variant = v2_variants("float32")[0]
    bs, D, kvh = variant.block_size, variant.head_size, 2
    qkv = rng.standard_normal((4, 3, kvh, D)).astype(np.float32)
    key, value = qkv[:, 1], qkv[:, 2]
    kc = np.zeros((2, bs, kvh, D), np.float32) + 7
    vc = np.zeros_like(kc) + 7
    slots = np.array([0, 3, bs, bs + 1], np.int64)
    emu("float32")[variant].reshape_and_cache(key, value, kc, vc, slots)
    assert np.array_equal(kc.reshape(-1, kvh, D)[slots], key)
    assert np.array_equal(vc.reshape(-1, kvh, D)[slots], value)
    assert (kc.reshape(-1, kvh, D)[2] == 7).all()


# ------------------------------------------------------------------ launch helpers


def test_pseudo_sequences():
    from pagedrun.attention.cuda.paged_step import pseudo_sequences

    token_to_seq, lens = pseudo_sequences([3, 1, 2], [5, 9, 2])
    assert token_to_seq.tolist() == [0, 0, 0, 1, 2, 2]
    # seq0: context 2, queries at positions 2,3,4; seq1: decode; seq2: no prefix
    assert lens.tolist() == [3, 4, 5, 9, 1, 2]
    assert lens.dtype == np.int32


def test_variant_and_argument_checks(emu):
    with pytest.raises(ValueError, match="head_size 72"):
        K.KernelVariant("float16", 72, 16)
    with pytest.raises(ValueError, match="block_size 64"):
        K.KernelVariant("float16", 64, 64)
    with pytest.raises(ValueError, match="float64"):
        K.dtype_name(np.float64)
    variant = v2_variants("float32")[1]
    case = make_case(variant, [40, 9], 2, 2)
    ker = emu("float32")[variant]
    with pytest.raises(ValueError, match="max_seq_len"):
        ker.paged_attention(case.empty_out(), case.query, case.key_cache, case.value_cache,
                            case.block_tables, case.seq_lens_arr, 20, case.scale)
    with pytest.raises(ValueError, match="int32"):
        ker.paged_attention(case.empty_out(), case.query, case.key_cache, case.value_cache,
                            case.block_tables.astype(np.int64), case.seq_lens_arr, 40, case.scale)


def test_shared_memory_sizes():
    assert K.v1_shared_mem(300, 64, 16) == 4 * 304  # logits of 19 whole blocks
    assert K.v1_shared_mem(3, 256, 16) == 4 * 4 * 256  # the output reduction needs more than logits
    assert K.v1_shared_mem(8192, 128, 16) <= K.DEFAULT_SMEM_LIMIT
    assert K.v2_shared_mem(64) == 4 * 512
    assert K.reduce_shared_mem(4) == 32


# ------------------------------------------------------------------ the emulated backend


@dataclass
class StepSpec:
    context_lens: list[int]
    query_lens: list[int]


def build_step(spec: StepSpec, dtype: torch.dtype, head_size: int, block_size: int, num_heads: int,
               num_kv_heads: int, seed: int, pad_tokens: int = 1, poison: bool = True):
    """Caches holding each sequence's context, this step's q/k/v and its AttentionMetadata, plus the
    float64 K/V of every sequence (context + new) for the reference."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(spec.context_lens, spec.query_lens)]
    nblocks = [-(-L // block_size) for L in seq_lens]
    num_blocks = sum(nblocks) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(nblocks)
    block_tables = torch.zeros((len(seq_lens), max_blocks), dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    if poison:  # every slot no token of this step may read is NaN
        key_cache = torch.full(shape, float("nan"), dtype=dtype)
        value_cache = key_cache.clone()
    else:
        key_cache = torch.randn(shape, generator=g).to(dtype)
        value_cache = torch.randn(shape, generator=g).to(dtype)
    full_k, full_v, slots = [], [], []
    new_k, new_v = [], []
    pos = 0
    for i, (c, q, n) in enumerate(zip(spec.context_lens, spec.query_lens, nblocks)):
        block_tables[i, :n] = torch.tensor(perm[pos : pos + n], dtype=torch.int32)
        pos += n
        k = torch.randn((c + q, num_kv_heads, head_size), generator=g).to(dtype)
        v = torch.randn((c + q, num_kv_heads, head_size), generator=g).to(dtype)
        full_k.append(k.double())
        full_v.append(v.double())
        for t in range(c + q):
            slot = int(block_tables[i, t // block_size]) * block_size + t % block_size
            if t < c:  # the cached prefix, written by earlier steps
                key_cache.view(-1, num_kv_heads, head_size)[slot] = k[t]
                value_cache.view(-1, num_kv_heads, head_size)[slot] = v[t]
            else:
                slots.append(slot)
        new_k.append(k[c:])
        new_v.append(v[c:])
    num_real = sum(spec.query_lens)
    T = num_real + pad_tokens
    query = (1.5 * torch.randn((T, num_heads, head_size), generator=g)).to(dtype)
    key = torch.cat(new_k + [torch.randn((pad_tokens, num_kv_heads, head_size), generator=g).to(dtype)])
    value = torch.cat(new_v + [torch.randn((pad_tokens, num_kv_heads, head_size), generator=g).to(dtype)])
    meta = AttentionMetadata.build(list(spec.query_lens), list(spec.context_lens), block_tables.tolist(), block_size,
                                   num_pad_tokens=pad_tokens, table_width=block_tables.shape[1])
    assert meta.slot_mapping.tolist() == slots + [-1] * pad_tokens
    return query, key, value, key_cache, value_cache, meta, full_k, full_v


def causal_reference(query, meta, full_k, full_v, scale, num_heads, num_kv_heads, window: int = 0,
                     softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.zeros(query.shape, dtype=torch.float64)
    q64 = query.double()
    group = num_heads // num_kv_heads
    starts = meta.query_start_loc.tolist()
    for i, qlen in enumerate(meta.query_lens_list):
        c = int(meta.context_lens[i])
        for j in range(qlen):
            L = c + j + 1
            first = first_key(L, window)
            for h in range(num_heads):
                logits = full_k[i][first:L, h // group] @ q64[starts[i] + j, h] * scale
                if softcap > 0:
                    logits = softcap * torch.tanh(logits / softcap)
                if sinks is not None:  # one more logit, with a zero value vector (dropped after the softmax)
                    probs = torch.softmax(torch.cat([logits, sinks[h : h + 1].double()]), 0)[:-1]
                else:
                    probs = torch.softmax(logits, 0)
                out[starts[i] + j, h] = probs @ full_v[i][first:L, h // group]
    return out


def placeholders_below_window(meta, key_cache, value_cache, window: int) -> int:
    """The hybrid KV manager's sliding-layer tables: every block wholly below the window of a
    sequence's first query in the step points at a spare (all-NaN) block, and the slots below that
    window hold NaN. Returns how many table entries became placeholders."""
    bs = meta.block_size
    tables = meta.block_tables
    used = set(tables.flatten().tolist())
    spare = next(b for b in range(key_cache.shape[0]) if b not in used)
    assert torch.isnan(key_cache[spare].float()).all()
    flat_k, flat_v = key_cache.view(-1, *key_cache.shape[2:]), value_cache.view(-1, *value_cache.shape[2:])
    count = 0
    for i, c in enumerate(meta.context_lens.tolist()):
        first = first_key(int(c) + 1, window)  # the first query sits at position context_len
        for t in range(first):
            flat_k[int(tables[i, t // bs]) * bs + t % bs] = float("nan")
            flat_v[int(tables[i, t // bs]) * bs + t % bs] = float("nan")
        tables[i, : first // bs] = spare
        count += first // bs
    return count


BACKEND_CASES = [
    # (dtype, head_size, block_size, heads, kv_heads, spec)
    ("float32", 64, 32, 4, 2, StepSpec([0, 40, 7, 0], [5, 3, 1, 1])),  # prefill, prefix+prefill, decodes
    ("float16", 64, 16, 9, 3, StepSpec([16, 0, 33], [4, 6, 1])),  # SmolLM2's 9/3 heads, prefix = 1 block
    ("bfloat16", 96, 16, 2, 1, StepSpec([20, 5], [1, 1])),  # decode only: the direct path
]


@pytest.mark.parametrize("case", BACKEND_CASES, ids=[f"{c[0]}-h{c[1]}-bs{c[2]}" for c in BACKEND_CASES])
def test_emulated_backend_mixed_step(emu, case):
    from pagedrun.attention.cuda.emulated_backend import EmulatedAttentionBackend

    dtype_name, D, bs, H, KVH, spec = case
    dtype = getattr(torch, dtype_name)
    backend = EmulatedAttentionBackend(kernels=lambda v: emu(v.dtype)[v])
    query, key, value, kc, vc, meta, fk, fv = build_step(spec, dtype, D, bs, H, KVH, seed=D + bs)
    scale = D**-0.5
    out = backend.forward(query, key, value, kc, vc, meta, scale)
    assert out.shape == query.shape and out.dtype == dtype
    ref = causal_reference(query, meta, fk, fv, scale, H, KVH)
    assert_close(out.double().numpy(), ref.numpy(), dtype_name, "backend")
    assert (out[sum(spec.query_lens):] == 0).all(), "padding rows must stay zero"
    assert backend.last_version == "v1"
    # every new token's K/V landed in its slot (the cache was written in place)
    flat_k = kc.view(-1, KVH, D)
    assert torch.equal(flat_k[meta.slot_mapping[: sum(spec.query_lens)]], key[: sum(spec.query_lens)])


WINDOW_BACKEND_CASES = [
    # (dtype, head_size, block_size, heads, kv_heads, spec, window, softcap)
    ("float32", 64, 32, 4, 2, StepSpec([0, 40, 70, 0], [50, 3, 1, 1]), 37, 0.0),  # prefill past the window
    ("float16", 64, 16, 9, 3, StepSpec([16, 0, 33, 90], [4, 6, 1, 1]), 20, 5.0),  # SmolLM2's heads, capped
    ("bfloat16", 96, 16, 2, 1, StepSpec([100, 5, 64], [1, 1, 1]), 33, 0.0),  # decode only: the direct path
]


@pytest.mark.parametrize("prefill", ["kernel", "sdpa"])
@pytest.mark.parametrize("case", WINDOW_BACKEND_CASES,
                         ids=[f"{c[0]}-w{c[6]}-cap{c[7]:g}" for c in WINDOW_BACKEND_CASES])
def test_emulated_backend_window_and_softcap(emu, case, prefill):
    """forward(window=, softcap=) on mixed steps: prefill tokens as pseudo-sequences (each its own window)
    or through attend_prefills (the GPU path's SDPA), decodes through the kernels; the blocks below
    each sequence's window are NaN placeholders, as the hybrid KV manager leaves them."""
    from pagedrun.attention.cuda.emulated_backend import EmulatedAttentionBackend

    dtype_name, D, bs, H, KVH, spec, window, softcap = case
    dtype = getattr(torch, dtype_name)
    backend = EmulatedAttentionBackend(kernels=lambda v: emu(v.dtype)[v], prefill=prefill)
    query, key, value, kc, vc, meta, fk, fv = build_step(spec, dtype, D, bs, H, KVH, seed=window)
    assert placeholders_below_window(meta, kc, vc, window) > 0
    scale = D**-0.5
    out = backend.forward(query, key, value, kc, vc, meta, scale, window=window, softcap=softcap)
    ref = causal_reference(query, meta, fk, fv, scale, H, KVH, window, softcap)
    assert_close(out.double().numpy(), ref.numpy(), dtype_name, f"backend {prefill}")
    assert (out[sum(spec.query_lens):] == 0).all(), "padding rows must stay zero"
    if softcap:  # the cap reached the output: it differs from the uncapped reference
        uncapped = causal_reference(query, meta, fk, fv, scale, H, KVH, window)
        assert rel_err(out.double().numpy(), uncapped.numpy()) > 1e-3


def test_emulated_backend_window_long_prefix_uses_v2(emu):
    """A window of 600 over a 1,200-token prefix: v2 (its keys need two partitions), NaN placeholders."""
    from pagedrun.attention.cuda.emulated_backend import EmulatedAttentionBackend

    backend = EmulatedAttentionBackend(kernels=lambda v: emu(v.dtype)[v])
    spec = StepSpec([1200, 3], [2, 1])
    query, key, value, kc, vc, meta, fk, fv = build_step(spec, torch.float16, 64, 16, 4, 2, seed=10)
    assert placeholders_below_window(meta, kc, vc, 600) == 37  # 601 // 16: seq 0's first key is 601
    out = backend.forward(query, key, value, kc, vc, meta, 0.125, window=600)
    assert backend.last_version == "v2"
    ref = causal_reference(query, meta, fk, fv, 0.125, 4, 2, 600)
    assert_close(out.double().numpy(), ref.numpy(), "float16", "backend v2 window")


def test_emulated_backend_long_prefix_uses_v2(emu):
    from pagedrun.attention.cuda.emulated_backend import EmulatedAttentionBackend

    backend = EmulatedAttentionBackend(kernels=lambda v: emu(v.dtype)[v])
    spec = StepSpec([700, 3], [2, 1])  # pseudo-sequences of up to 702 tokens, 3 tokens x 4 heads
    query, key, value, kc, vc, meta, fk, fv = build_step(spec, torch.float16, 64, 16, 4, 2, seed=9)
    out = backend.forward(query, key, value, kc, vc, meta, 0.125)
    assert backend.last_version == "v2"
    ref = causal_reference(query, meta, fk, fv, 0.125, 4, 2)
    assert_close(out.double().numpy(), ref.numpy(), "float16", "backend v2")


def test_emulated_backend_matches_torch_backend(emu):
    from pagedrun.attention.cuda.emulated_backend import EmulatedAttentionBackend
    from pagedrun.attention.torch_backend import TorchAttentionBackend

    spec = StepSpec([0, 40, 7], [5, 3, 1])
    args = build_step(spec, torch.float32, 64, 32, 4, 2, seed=11, poison=False)
    args_t = build_step(spec, torch.float32, 64, 32, 4, 2, seed=11, poison=False)
    a = EmulatedAttentionBackend(kernels=lambda v: emu(v.dtype)[v]).forward(*args[:6], 0.125)
    b = TorchAttentionBackend().forward(*args_t[:6], 0.125)
    n = sum(spec.query_lens)
    assert torch.allclose(a[:n], b[:n], atol=1e-5, rtol=1e-4)
    assert torch.equal(args[3], args_t[3]) and torch.equal(args[4], args_t[4])  # same cache writes


# ------------------------------------------------------------------ registry


def test_registry_auto_and_errors():
    from pagedrun.attention import registry
    from pagedrun.errors import PagedrunError

    assert "torch" in registry.available_backends()
    backend = registry.make_backend("auto", torch.device("cpu"))
    assert backend.name == "torch"
    if "cupy" not in registry.available_backends():
        # no CuPy: the error names the extra to install; CuPy without a GPU: it says so
        with pytest.raises(PagedrunError, match="^attention_backend: cupy (unavailable .*gpu-cu1|needs a CUDA GPU)"):
            registry.make_backend("cupy", torch.device("cpu"))
    with pytest.raises(PagedrunError, match="unknown backend"):
        registry.make_backend("flash", "cpu")
    if "emulated" in registry.available_backends():
        assert registry.make_backend("emulated", "cpu").name == "emulated"
