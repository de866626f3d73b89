"""The GPU path's host logic, checked on the CPU (issue 15): everything here runs without a GPU.

What needs a GPU to check is listed in docs/guide/gpu.md and run by benchmarks/gpu_check.sh.
"""
from __future__ import annotations

import pytest

from pagedrun.attention.cuda import install as CI

# ---------------------------------------------------------------- install: which CuPy fits


@pytest.mark.parametrize("torch_cuda, installed, expect", [
    ("13.0", [], "pip install 'pagedrun[gpu-cu13]' (torch is built for CUDA 13.0)"),
    ("12.8", [], "pip install 'pagedrun[gpu-cu12]' (torch is built for CUDA 12.8)"),
    ("13.0", ["cupy-cuda12x"], "cupy-cuda12x is installed but torch is built for CUDA 13.0: "
                               "pip uninstall cupy-cuda12x && pip install 'pagedrun[gpu-cu13]'"),
    ("13.0", ["cupy-cuda12x", "cupy-cuda13x"], "several CuPy distributions are installed"),
    (None, [], "torch here has no CUDA build"),
    ("11.8", [], "no CuPy extra"),
])
def test_install_hint_names_the_matching_extra(torch_cuda, installed, expect):
    hint = CI.install_hint(torch_cuda, installed)
    assert expect in hint
    assert "\n" not in hint


def test_cupy_backend_without_cupy_is_one_line_naming_an_extra(monkeypatch):
    from pagedrun.attention import registry
    from pagedrun.errors import PagedrunError

    monkeypatch.setattr(registry, "_cupy_status", lambda: "import cupy failed: ModuleNotFoundError")
    with pytest.raises(PagedrunError) as e:
        registry.make_backend("cupy", "cuda")
    assert "\n" not in str(e.value) and "gpu-cu1" in str(e.value)
    monkeypatch.setattr(registry, "_cupy_status", lambda: "CuPy sees no CUDA GPU")
    with pytest.raises(PagedrunError, match="needs a CUDA GPU"):
        registry.make_backend("cupy", "cuda")


# ---------------------------------------------------------------- 1. DLPack's size-1 strides

import numpy as np  # noqa: E402
import test_kernels as T  # noqa: E402
import torch  # noqa: E402
from test_kernels import emu  # noqa: E402,F401  (the module-scoped emulator fixture)

from pagedrun.attention.cuda import kernels as K  # noqa: E402
from pagedrun.attention.cuda import paged_step  # noqa: E402


def dlpack_normalised(a: np.ndarray) -> np.ndarray:
    """The same memory with the strides torch 1.13 to ~2.9 export through DLPack: one element for
    every size-1 dimension (pytorch#83158)."""
    strides = tuple(a.itemsize if n == 1 else s for n, s in zip(a.shape, a.strides))
    return np.lib.stride_tricks.as_strided(a, a.shape, strides)


@pytest.mark.slow


def test_mqa_with_normalised_strides_runs_and_matches(emu):
    v = K.KernelVariant("float16", 64, 16)
    ker = emu("float16")[v]
    case = T.make_case(v, [1, 37, 200], num_heads=4, num_kv_heads=1, seed=3)  # MQA: one KV head
    kc, vc = dlpack_normalised(case.key_cache), dlpack_normalised(case.value_cache)
    assert kc.strides[2] == kc.itemsize != 64 * kc.itemsize  # what the old row check rejected
    out = case.empty_out()
    for version in ("v1", "v2"):
        ker.paged_attention(out, case.query, kc, vc, case.block_tables, case.seq_lens_arr,
                            case.max_seq_len, case.scale, version=version)
        T.assert_close(T.to_f64(out, "float16"), case.reference(), "float16", f"MQA {version}")
    # one query head, and a single sequence (its row stride normalised too)
    case1 = T.make_case(v, [70], num_heads=1, num_kv_heads=1, seed=4)
    q1 = dlpack_normalised(case1.query)
    assert q1.strides == (2, 2, 2)
    out1 = dlpack_normalised(case1.empty_out())
    ker.paged_attention(out1, q1, dlpack_normalised(case1.key_cache), dlpack_normalised(case1.value_cache),
                        dlpack_normalised(case1.block_tables), case1.seq_lens_arr, 70, case1.scale)
    T.assert_close(T.to_f64(np.ascontiguousarray(out1), "float16"), case1.reference(), "float16", "one head")
    # reshape_and_cache from an MQA key [T, 1, D] and a single-token key
    rng = np.random.default_rng(0)
    key = T.to_device_dtype(rng.standard_normal((3, 1, 64)), "float16")
    cache = np.zeros((4, 16, 1, 64), np.float16)
    vcache = np.zeros_like(cache)
    ker.reshape_and_cache(dlpack_normalised(key), dlpack_normalised(key), dlpack_normalised(cache),
                          dlpack_normalised(vcache), np.array([5, -1, 40], np.int64))
    assert (cache.reshape(-1, 1, 64)[[5, 40]] == key[[0, 2]]).all() and (vcache == cache).all()
    ker.reshape_and_cache(dlpack_normalised(key[:1]), dlpack_normalised(key[:1]), cache, vcache,
                          np.array([63], np.int64))
    assert (cache.reshape(-1, 1, 64)[63] == key[0]).all()


def test_non_contiguous_rows_still_refused(emu):
    v = K.KernelVariant("float16", 64, 16)
    ker = emu("float16")[v]
    key = np.zeros((3, 4, 64), np.float16)[:, ::2]  # two heads 128 elements apart
    cache = np.zeros((2, 16, 2, 64), np.float16)
    with pytest.raises(ValueError, match="key rows must be contiguous"):
        ker.reshape_and_cache(key, key, cache, cache.copy(), np.array([0, 1, 2], np.int64))


def test_torch_strided_takes_the_torch_tensors_strides():
    from pagedrun.attention.cuda.cupy_backend import torch_strided

    for t in (torch.zeros(5, 1, 64, dtype=torch.float16), torch.zeros(1, 4, 64), torch.zeros(1, 1, 32)):
        arr = dlpack_normalised(t.numpy())
        fixed = torch_strided(arr, t, np)
        assert fixed.strides == t.numpy().strides
        assert fixed.__array_interface__["data"][0] == t.data_ptr()
        assert torch_strided(t.numpy(), t, np) is not None


class _FakeCupy:
    """CuPy's names that the pointer-built views use, recording what they are given."""

    class cuda:
        class UnownedMemory:
            def __init__(self, ptr, size, owner, device_id):
                self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id

        class MemoryPointer:
            def __init__(self, mem, offset):
                self.mem, self.ptr = mem, mem.ptr + offset

    class ndarray:
        def __init__(self, shape, dtype, memptr, strides):
            self.shape, self.dtype, self.data, self.strides = shape, np.dtype(dtype), memptr, strides


def test_pointer_built_views_match_what_dlpack_gives():
    """as_cupy's fast path: the address, shape, byte strides and dtype of the tensor (a strided
    bf16 view as int16), the bytes it spans, the tensor kept alive as the memory's owner."""
    from pagedrun.attention.cuda import cupy_backend as CB

    base = torch.zeros(4, 5, 8, dtype=torch.bfloat16)
    for t in (base.view(torch.int16)[:, 1:3], base.view(torch.int16), torch.zeros(3, 1, 64),
              torch.zeros(0, 4, dtype=torch.int32), torch.arange(6, dtype=torch.int64)[::2]):
        arr = CB.from_pointer(t, _FakeCupy)
        ref = t.numpy()
        assert arr.data.ptr == t.data_ptr() and (not ref.size or t.data_ptr() == ref.__array_interface__["data"][0])
        assert arr.shape == ref.shape and arr.dtype == ref.dtype and (not ref.size or arr.strides == ref.strides)
        last = max((ref.__array_interface__["data"][0] + sum((n - 1) * s for n, s in zip(ref.shape, ref.strides))
                    + ref.itemsize) if ref.size else 0, 0)
        assert arr.data.mem.size == (last - t.data_ptr() if ref.size else 0)
        assert arr.data.mem.owner is t and arr.data.mem.device_id == 0
    assert CB.same_view(CB.from_pointer(base.view(torch.int16), _FakeCupy),
                        CB.from_pointer(base.view(torch.int16), _FakeCupy))


def test_cache_views_are_made_once_per_cache_and_do_not_keep_it_alive(monkeypatch):
    """The backend wraps each layer's KV cache once (a wrap is host time on every layer of every
    step); the kept view does not own the cache, so a freed cache (the memory profile's) is freed,
    and a new tensor, even at a reused id, gets its own view."""
    import gc
    import weakref

    from pagedrun.attention.cuda import cupy_backend as CB

    monkeypatch.setitem(sys.modules, "cupy", _FakeCupy)
    monkeypatch.setattr(CB, "_pointer_wraps_ok", True)
    monkeypatch.setattr(CB, "_checked", CB.CHECKED_WRAPS)
    backend = object.__new__(CB.CupyAttentionBackend)
    backend._cache_views = {}
    cache = torch.zeros(4, 16, 2, 8, dtype=torch.bfloat16)
    view = backend._cache_view(cache)
    assert view.dtype == np.int16 and view.data.ptr == cache.data_ptr() and view.shape == tuple(cache.shape)
    assert view.data.mem.owner is None
    assert backend._cache_view(cache) is view
    other = torch.zeros(4, 16, 2, 8, dtype=torch.bfloat16)
    assert backend._cache_view(other) is not view
    alive = weakref.ref(cache)
    del cache
    gc.collect()
    assert alive() is None  # the kept view did not hold it
    monkeypatch.setattr(CB, "_checked", 0)  # still comparing with DLPack: nothing kept
    monkeypatch.setattr(CB, "from_dlpack", lambda t, xp: CB.from_pointer(t, xp))
    fresh = torch.zeros(2, 16, 1, 8)
    assert backend._cache_view(fresh).data.mem.owner is not None and id(fresh) not in backend._cache_views


def test_as_cupy_keeps_dlpack_for_good_when_a_pointer_view_differs(monkeypatch):
    from pagedrun.attention.cuda import cupy_backend as CB

    monkeypatch.setitem(sys.modules, "cupy", _FakeCupy)
    monkeypatch.setattr(CB, "_pointer_wraps_ok", True)
    monkeypatch.setattr(CB, "_checked", 0)
    dlpack_calls = []
    honest = CB.from_pointer

    def fake_dlpack(t, xp):
        dlpack_calls.append(t)
        return honest(t, xp)

    monkeypatch.setattr(CB, "from_dlpack", fake_dlpack)
    t = torch.zeros(2, 3, dtype=torch.bfloat16)
    for _ in range(CB.CHECKED_WRAPS):
        assert CB.as_cupy(t).dtype == np.int16
    assert len(dlpack_calls) == CB.CHECKED_WRAPS and CB._pointer_wraps_ok
    CB.as_cupy(t)  # checked enough: the pointer-built view alone
    assert len(dlpack_calls) == CB.CHECKED_WRAPS

    monkeypatch.setattr(CB, "_checked", 0)
    monkeypatch.setattr(CB, "from_pointer", lambda t, xp: _FakeCupy.ndarray(
        (9,), np.int16, _FakeCupy.cuda.MemoryPointer(_FakeCupy.cuda.UnownedMemory(1, 1, t, 0), 0), (2,)))
    with pytest.warns(RuntimeWarning, match="DLPack from here on"):
        CB.as_cupy(t)
    assert not CB._pointer_wraps_ok
    n = len(dlpack_calls)
    CB.as_cupy(t)
    assert len(dlpack_calls) == n + 1  # DLPack only, from then on


# ---------------------------------------------------------------- 3. launch limits


class FakeFn:
    """Records launches; shared-memory attributes as CuPy reports them."""

    def __init__(self, name, log, static=0, limit=48 * 1024):
        self.name, self.log, self.shared_size_bytes = name, log, static
        self._limit, self.opted_in = limit, []

    @property
    def max_dynamic_shared_size_bytes(self):
        return self._limit

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, v):
        self.opted_in.append(v)
        self._limit = v

    def __call__(self, grid, block, args, shared_mem=0):
        self.log.append((self.name, tuple(grid), args, shared_mem))


class FakeModule:
    def __init__(self, static=0, limit=48 * 1024):
        self.log, self.fns, self.static, self.limit = [], {}, static, limit

    def get_function(self, name):
        return self.fns.setdefault(name, FakeFn(name, self.log, self.static, self.limit))


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_launch_grid_folds_past_65535_rows(version):
    v = K.KernelVariant("float32", 32, 8)
    mod = FakeModule()
    ker = K.PagedKernels(v, mod, np)
    n = 70_000  # one pseudo-sequence per token of a 70k-token step
    q = np.zeros((n, 2, 32), np.float32)
    out = np.zeros_like(q)
    kc = np.zeros((3, 8, 1, 32), np.float32)
    bt = np.zeros((n, 1), np.int32)
    lens = np.ones(n, np.int32)
    ker.paged_attention(out, q, kc, kc.copy(), bt, lens, 8, 0.1, version=version)
    attn = [entry for entry in mod.log if "reduce" not in entry[0]]
    assert [g[1] for _, g, _, _ in attn] == [65535, n - 65535]
    assert all(g[0] == 2 for _, g, _, _ in attn)  # heads on x
    # each chunk gets its own rows: out/query/block_tables/seq_lens start at the chunk's first row
    # argument positions: (out,) q, k_cache, v_cache, k_scales, v_scales, num_kv_heads, scale, block_tables, seq_lens
    arg = {"v1": ((0, out), (1, q), (8, bt), (9, lens)), "v2": ((3, q), (10, bt), (11, lens))}[version]
    second = attn[1][2]
    for i, base in arg:
        assert second[i].__array_interface__["data"][0] == base[65535:].__array_interface__["data"][0]


def test_grid_chunks_give_identical_results(emu):
    v = K.KernelVariant("float16", 64, 16)
    base = emu("float16")[v]
    small = K.PagedKernels(v, base.module, np)
    small.max_grid_y = 2  # 5 sequences -> launches of 2, 2, 1 rows
    case = T.make_case(v, [1, 37, 513, 100, 1100], 4, 2, seed=5)
    for version in ("v1", "v2"):
        a, b = case.empty_out(), case.empty_out()
        for ker, o in ((base, a), (small, b)):
            ker.paged_attention(o, case.query, case.key_cache, case.value_cache, case.block_tables,
                                case.seq_lens_arr, case.max_seq_len, case.scale, version=version)
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16)), version


def test_shared_memory_opt_in_counts_static_and_reads_the_limit():
    v = K.KernelVariant("float16", 128, 16)
    # a default limit of 48 KiB minus the kernel's 544 B of static shared memory (GPU-REVIEW Q1)
    mod = FakeModule(static=544, limit=48 * 1024 - 544)
    ker = K.PagedKernels(v, mod, np, smem_optin=227 * 1024)
    fn = ker.function(v.v1_name, 48 * 1024)  # exactly 48 KiB dynamic: must opt in
    assert fn.opted_in == [48 * 1024]
    fn2 = ker.function(v.v2_name, 40 * 1024)  # under the function's limit: untouched
    assert fn2.opted_in == []
    with pytest.raises(ValueError, match="544 B static .* over the device's 232448 B"):
        ker.function(v.reduce_name, 227 * 1024)  # 227 KiB dynamic + 544 static > opt-in maximum
    # v1 at 12,288 tokens needs exactly 48 KiB of logits: the launch opts in
    q = np.zeros((1, 2, 128), np.float16)
    kc = np.zeros((769, 16, 1, 128), np.float16)
    ker2 = K.PagedKernels(v, FakeModule(static=544, limit=48 * 1024 - 544), np)
    ker2.paged_attention(q.copy(), q, kc, kc, np.zeros((1, 769), np.int32), np.array([12288], np.int32),
                         12288, 0.1, version="v1")
    launched = ker2.module.log[0]
    assert launched[3] == 48 * 1024 and ker2.module.fns[v.v1_name].opted_in == [48 * 1024]


# ---------------------------------------------------------------- 4. the step's metadata, once


@pytest.mark.parametrize("prefill", paged_step.PREFILL_MODES)
def test_step_inputs_built_once_and_reused_by_every_layer(emu, monkeypatch, prefill):
    from pagedrun.attention.cuda.emulated_backend import EmulatedAttentionBackend

    calls = []
    real = paged_step.build
    monkeypatch.setattr(paged_step, "build", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    backend = EmulatedAttentionBackend(kernels=lambda v: emu(v.dtype)[v], prefill=prefill)
    spec = T.StepSpec([0, 40, 7, 0], [5, 3, 1, 1])  # prefill, prefix + prefill, two decodes
    layers = [T.build_step(spec, torch.float32, 64, 32, 4, 2, seed=11) for _ in range(3)]
    meta = layers[0][5]
    for q, k, v, kc, vc, _, fk, fv in layers:
        out = backend.forward(q, k, v, kc, vc, meta, 0.125)
        ref = T.causal_reference(q, meta, fk, fv, 0.125, 4, 2)
        n = sum(spec.query_lens)
        T.assert_close(out[:n].double().numpy(), ref[:n].numpy(), "float32", f"{prefill} layer")
    assert calls == [meta]  # built by the first layer, reused by the other two
    step = next(iter(meta.backend_state.values()))
    assert step.num_rows == (2 if prefill in ("sdpa", "varlen") else sum(spec.query_lens))
    backend.forward(*layers[0][:5], T.build_step(spec, torch.float32, 64, 32, 4, 2, seed=11)[5], 0.125)
    assert len(calls) == 2  # a new step builds anew


# ---------------------------------------------------------------- 5. prefill through SDPA


@pytest.mark.parametrize("case", T.BACKEND_CASES, ids=[f"{c[0]}-h{c[1]}-bs{c[2]}" for c in T.BACKEND_CASES])
def test_sdpa_prefill_path_matches_reference(emu, case):
    """The CuPy backend's GPU path (SDPA prefill + paged decode kernels), run on the CPU."""
    from pagedrun.attention.cuda.emulated_backend import EmulatedAttentionBackend

    dtype_name, D, bs, H, KVH, spec = case
    backend = EmulatedAttentionBackend(kernels=lambda v: emu(v.dtype)[v], prefill="sdpa")
    q, k, v, kc, vc, meta, fk, fv = T.build_step(spec, getattr(torch, dtype_name), D, bs, H, KVH, seed=D + bs)
    out = backend.forward(q, k, v, kc, vc, meta, D**-0.5)
    ref = T.causal_reference(q, meta, fk, fv, D**-0.5, H, KVH)
    n = sum(spec.query_lens)
    # SDPA rounds like torch, not like the kernels: compare at the dtype's tolerance, x2 for bf16 SDPA
    T.assert_close(out[:n].double().numpy(), ref[:n].numpy(), dtype_name, "sdpa path")
    assert (out[n:] == 0).all()
    flat_k = kc.view(-1, KVH, D)
    assert torch.equal(flat_k[meta.slot_mapping[:n]], k[:n])  # the kernels wrote every new token


def test_sdpa_prefill_only_step_launches_no_attention_kernel(emu):
    from pagedrun.attention.cuda.emulated_backend import EmulatedAttentionBackend

    backend = EmulatedAttentionBackend(kernels=lambda v: emu(v.dtype)[v], prefill="sdpa")
    spec = T.StepSpec([0, 16], [9, 4])
    q, k, v, kc, vc, meta, fk, fv = T.build_step(spec, torch.float16, 64, 16, 4, 2, seed=2)
    out = backend.forward(q, k, v, kc, vc, meta, 0.125)
    assert backend.last_version is None  # no paged-attention launch: both sequences went to SDPA
    T.assert_close(out[:13].double().numpy(), T.causal_reference(q, meta, fk, fv, 0.125, 4, 2)[:13].numpy(),
                   "float16", "prefill only")


def test_launch_each_version_launches_v1_then_v2_on_block_zero(emu):
    """What the CUDA memory profile calls so that both decode kernels are loaded (and counted)
    before it reads the memory in use: v1 and v2 each launch once and return normally."""
    from pagedrun.attention.cuda.emulated_backend import as_numpy

    v = K.KernelVariant("float16", 64, 16)
    ker = emu("float16")[v]
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(2, 16, 2, 64, generator=g).half()
    vc = torch.randn(2, 16, 2, 64, generator=g).half()
    launched = []

    def spy_on(k):
        real = k.paged_attention

        def spy(*args, **kw):
            launched.append((kw["version"], args[6], kw.get("group")))  # version, max_seq_len, group
            return real(*args, **kw)
        return spy

    ker.paged_attention = spy_on(ker)
    try:
        assert paged_step.launch_each_version(ker, as_numpy, kc, vc, torch.float16) == ["v1", "v2"]
    finally:
        del ker.paged_attention
    assert launched == [("v1", 1, None), ("v2", 1, None)] or launched == [("v1", 1, 1), ("v2", 1, 1)]
    # a grouped variant loads its grouped kernels too (a one-query grid alone would pick one head per block)
    grouped = emu("float16")[K.KernelVariant("float16", 64, 16, "auto", 2)]
    launched.clear()
    grouped.paged_attention = spy_on(grouped)
    try:
        assert paged_step.launch_each_version(grouped, as_numpy, kc, vc, torch.float16) == ["v1", "v1", "v2", "v2"]
    finally:
        del grouped.paged_attention
    assert launched == [("v1", 1, 1), ("v1", 1, 2), ("v2", 1, 1), ("v2", 1, 2)]
    quantized = K.PagedKernels(K.KernelVariant("float16", 64, 16, "int8"), None, np)
    assert paged_step.launch_each_version(quantized, as_numpy, kc, vc, torch.float16) == []


# ---------------------------------------------------------------- 2. memory: budget and allocation

from pagedrun.attention.scratch import attention_scratch_bytes  # noqa: E402
from pagedrun.config.recipe import CacheConfig  # noqa: E402
from pagedrun.worker import memory as M  # noqa: E402
from pagedrun.worker import torch_cap as TC  # noqa: E402
from pagedrun.worker.cache_engine import KVAllocationError, allocate_cache  # noqa: E402
from pagedrun.worker.profiler import CudaReadings, cuda_profile  # noqa: E402

GiB = 1 << 30


def llama8b_scratch(max_model_len, paged_decode=True, seqs=256):
    return attention_scratch_bytes(num_heads=32, num_kv_heads=8, head_size=128, elem_bytes=2, block_size=16,
                                   max_model_len=max_model_len, max_num_seqs=seqs, max_num_batched_tokens=2048,
                                   paged_decode=paged_decode)


def test_attention_scratch_is_the_v2_worst_case_at_long_context():
    # 32k context: 64 partitions; 256 decode rows x 32 heads x 64 parts x (128 + 2) fp32 = 272.6 MB
    v2 = 256 * 32 * 64 * 130 * 4
    gather = 2 * 32768 * 8 * 128 * 2 + 2048 * 32768
    tables = 256 * (2048 + 3) * 4 + 8 * 256
    assert llama8b_scratch(32768) == max(v2, gather) + tables
    assert llama8b_scratch(32768, paged_decode=False) == gather  # the torch backend: SDPA's gather only
    # 4k context: v2 for every decode row (v1 only within one partition)
    assert llama8b_scratch(4096) >= 256 * 32 * 8 * 130 * 4
    assert llama8b_scratch(512) == 2 * 512 * 8 * 128 * 2 + 512 * 512 + 256 * (32 + 3) * 4 + 8 * 256  # one partition
    assert llama8b_scratch(65536) > llama8b_scratch(32768) > llama8b_scratch(8192)


def readings(**kw):
    base = dict(total=80 * GiB, free_before=62 * GiB, free_after=62 * GiB, torch_allocated_before=17 * GiB,
                torch_peak_allocated=19 * GiB, torch_reserved_after=int(16.5 * GiB), dummy_kv_bytes=1 * GiB)
    return CudaReadings(**{**base, **kw})


def plan(r, u=0.9, scratch=0, mml=32768, gather=0, **cache):
    return M.plan_memory(profile=cuda_profile(r, 16 * GiB), block_bytes=2 * 32 * 8 * 128 * 16 * 2,
                         cache_cfg=CacheConfig(gpu_memory_utilization=u, **cache), max_model_len=mml, max_num_seqs=256,
                         uses_swap=False, host_available_bytes=100 * GiB, attention_scratch=scratch,
                         decode_gather=gather)


def test_budget_counts_scratch_and_reserved_not_allocated():
    base = plan(readings())
    slack = plan(readings(torch_peak_reserved=20 * GiB))  # 1 GiB reserved above the allocated peak
    assert slack.profile.reserved_slack_bytes == 1 * GiB
    assert base.kv_budget_bytes - slack.kv_budget_bytes == 1 * GiB
    s = llama8b_scratch(32768)
    with_scratch = plan(readings(), scratch=s)
    assert base.kv_budget_bytes - with_scratch.kv_budget_bytes == s
    assert with_scratch.attention_scratch_bytes == s
    assert "attention scratch at max_model_len" in with_scratch.summary()[1]


def test_torch_is_held_to_the_limit_minus_what_lives_outside_it(monkeypatch):
    """H200, 2026-11-26: with no more live memory than the plan held, torch's cached blocks of many
    step shapes took the process 0.04-0.10 GiB past gpu_memory_utilization x total. The plan caps
    torch's allocator at the limit less what the profile measured outside torch."""
    r = readings()
    p = plan(r, u=0.9)
    outside = p.profile.non_torch_bytes
    assert outside == (r.total - r.free_after) - r.torch_reserved_after > 0
    assert p.torch_cap_bytes == int(80 * GiB * 0.9) - outside
    assert "torch held to" in p.summary()[-1]
    # The torch backend's decode gather is chunked, so its bound is budgeted like the kernels'
    # scratch (the larger of the two: never live at once) and torch is capped too.
    g = 3 * GiB
    gathers = plan(r, u=0.9, gather=g, scratch=1 * GiB)
    assert gathers.torch_cap_bytes == p.torch_cap_bytes
    assert p.kv_budget_bytes - gathers.kv_budget_bytes == g and gathers.attention_scratch_bytes == g
    assert gathers.decode_gather_bytes == g and "decode gather est." in gathers.summary()[1]
    override = plan(r, u=0.9, num_blocks=100)
    assert override.torch_cap_bytes == 0  # cache.num_blocks: the budget is not the plan's
    calls = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 80 * GiB))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def set_fraction(f, device=None):  # torch's own refuses a torch.device without an index
        assert isinstance(device, int), device
        calls.append(f)

    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    TC.cap_torch_memory(p, torch.device("cuda"))
    TC.cap_torch_memory(override, torch.device("cuda", 0))
    TC.cap_torch_memory(p, torch.device("cpu"))
    assert calls == [pytest.approx(p.torch_cap_bytes / (80 * GiB)), 1.0]


def test_a_step_out_of_device_memory_is_one_line_with_the_numbers(tmp_path, monkeypatch):
    """Under the cap a step that needs more than the plan holds gets torch's out-of-memory; the
    engine turns it into the budget error naming the fields to change (the CLI prints it in one
    line; finished outputs are already written)."""
    from tiny_models import make_tiny_model

    from pagedrun.errors import PagedrunError
    from pagedrun.llm import LLM

    p = plan(readings(), u=0.9)
    e = TC.step_out_of_memory(p, 2048, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    msg = str(e)
    assert "\n" not in msg and "a step of 2048 tokens" in msg and "torch held to" in msg
    assert "scheduler.max_num_batched_tokens" in msg and "Tried to allocate 20.00 MiB" in msg
    # on the CPU even where a GPU is visible: the tiny model's head size 16 has no CUDA kernel
    llm = LLM(None, [f"model.path={make_tiny_model('llama', tmp_path / 'm')}", "cache.num_blocks=64", "model.device=cpu"])

    def oom(inputs, feed=None):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    monkeypatch.setattr(llm.engine.worker.runner, "execute", oom)
    with pytest.raises(PagedrunError, match=r"a step of 3 tokens ran out of device memory .*1.00 GiB"):
        llm.generate([[5, 6, 7]])


def test_utilization_above_095_warns():
    assert not plan(readings(), u=0.95).warnings
    p = plan(readings(), u=0.97)
    assert any(w.startswith("cache.gpu_memory_utilization=0.97 leaves under 5%") for w in p.warnings)


def test_cache_allocation_rechecks_free_memory_and_maps_oom():
    dev = torch.device("cuda:0")
    shape, need = (16, 2, 1024, 16, 8, 128), 16 * 2 * 1024 * 16 * 8 * 128 * 2  # 1 GiB of bf16
    got = allocate_cache(shape, torch.bfloat16, dev, mem_get_info=lambda d: (2 * GiB, 80 * GiB),
                         empty=lambda s, dtype, device: ("allocated", s, dtype))
    assert got == ("allocated", shape, torch.bfloat16)
    with pytest.raises(KVAllocationError) as e:  # another process took the room since the profile
        allocate_cache(shape, torch.bfloat16, dev, mem_get_info=lambda d: (need - 1, 80 * GiB),
                       empty=lambda *a, **k: pytest.fail("must not allocate"))
    msg = str(e.value)
    assert msg.startswith("cache.gpu_memory_utilization: the KV cache needs 1.00 GiB but cuda:0 has 1.00 GiB free")
    assert "\n" not in msg

    def oom(*a, **k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB.\nmore detail")

    with pytest.raises(KVAllocationError) as e:
        allocate_cache(shape, torch.bfloat16, dev, mem_get_info=lambda d: (2 * GiB, 80 * GiB), empty=oom)
    msg = str(e.value)
    assert "allocating the KV cache (1.00 GiB) on cuda:0 failed" in msg and "Tried to allocate" in msg
    assert "\n" not in msg and "lower cache.gpu_memory_utilization" in msg
    # the CPU path allocates directly
    assert allocate_cache((2, 3), torch.float32, torch.device("cpu")).shape == (2, 3)


# ---------------------------------------------------------------- 6, 9: the GPU scripts without a GPU

import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]


def test_gpu_check_without_a_gpu_says_so_in_one_line(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: benchmarks/gpu_check.sh would run for real")
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stdout.strip().count("\n") == 0 and "no CUDA GPU" in r.stdout, (r.stdout, r.stderr)
    assert not any(tmp_path.iterdir())  # nothing written


def test_gpu_check_archive_holds_the_summary_and_every_log(tmp_path):
    """--archive packs the whole output folder into one file: a lent GPU machine sends back 8 files
    at most, and a full run writes about 20. Run in the script's dry mode (no GPU needed; its env
    step then fails, which the summary records)."""
    import tarfile

    archive = tmp_path / "back" / "gpu_check.tgz"
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--only", "env", "--budget", "60",
                        "--out", str(tmp_path / "out"), "--archive", str(archive)],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PAGEDRUN_GPU_CHECK_DRY": "1"})
    assert "everything in" in r.stdout, (r.stdout, r.stderr)
    with tarfile.open(archive) as t:
        names = {Path(n).name for n in t.getnames()}
    assert {"gpu_check.md", "env.log"} <= names


def test_bandwidth_benchmark_helpers():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import kernel_bandwidth as B

    assert B.parse_configs("64x4096, 8x16384") == [(64, 4096), (8, 16384)]
    with pytest.raises(SystemExit, match="SEQSxCONTEXT"):
        B.parse_configs("64y")
    l2 = 50 * 2**20
    assert B.copies_for_l2(2**30, l2) == 1  # (64, 4096) bf16 head 128, 8 KV heads: 1 GiB > 4 x L2
    small = 2 * 8 * 1024 * 8 * 128 * 2  # 32 MiB: rotate through 7 copies (224 MiB > 200 MiB)
    n = B.copies_for_l2(small, l2)
    assert n * small > 4 * l2 >= (n - 1) * small
