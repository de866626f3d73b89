"""The decoder layers of a step in one C call on the CPU (kernels/cpu/layer_runner_cpu.cpp).

The Python loop in llama.py calls a C++ kernel for every op of every layer, and pays for it
between the calls: argument checks, ctypes conversions, tensor views and outputs. On 2 cores that
adds up, in every layer of every step, to a noticeable part of the default model's bench run
(docs/log/2026-11-26-layer-runner-huge-pages.md, docs/log/2026-11-27-figures-from-code-comments.md).
The runner makes the same kernel calls with the same arguments from C, so its results are the
loop's bit for bit; it has no arithmetic of its own.

It applies when every op of the loop would have run its C++ kernel anyway: a CPU model in
float32 or bfloat16 with packed weights (packed_gemm.pack_weight), an attention backend whose C++ kernel
reads the cache unquantized, and no forward hook on a decoder layer (the layers are not called one
by one here); Qwen3's and Gemma 3's per-head q/k norms are the kernel the loop calls too
(ops.rms_norm on a [T, heads, hd] view). Partial rotary and Granite's residual multiplier are
declined (for_model). Gemma's layers (models/gemma.py) run the same loop with
their two extra norms, their own RoPE tables per layer and GeGLU's kernel. Everything else, and
PAGEDRUN_LAYER_RUNNER=0, runs the Python loop, which stays the reference
(tests/models/test_layer_runner.py compares the two).

Each layer's attention variant (sliding window, logit soft-cap, attention sinks) is read once from its
attention module's `window` / `softcap` / `sinks` attributes (absent or None: off); sinks must then be
a tensor of one entry per query head (read as contiguous float32 on the CPU: a copy, kept by the
runner beside its pointer table, where the attribute is not already that). With one AttentionMetadata per layer (the
hybrid KV manager's KV cache groups) the step passes each distinct metadata's block tables and slot
mapping once (PrTables) and every layer the index of its own: the rest of the metadata is the same
for all of them.
"""
from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.nn.modules import module as nn_module

from pagedrun.attention.cpu_kernels import DTYPE_CODES, int_arg, sink_arg
from pagedrun.attention.metadata import AttentionMetadata
from pagedrun.build import cpu as cpu_build
from pagedrun.build.cache import load_library
from pagedrun.models import ops

SOURCE = cpu_build.KERNEL_DIR / "layer_runner_cpu.cpp"
_i64, _i32, _f32, _ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_float, ctypes.c_void_p
_DTYPES = (torch.float32, torch.bfloat16)  # the model ops' (ops.CpuModelOps)


class _Kernels(ctypes.Structure):
    _fields_ = [(name, _ptr) for name in ("rms_norm", "linear", "linear_silu", "rope", "reshape_and_cache",
                                          "decode", "varlen", "head_norm")]


class _Model(ctypes.Structure):
    _fields_ = [(name, _i64) for name in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim",
                                          "intermediate", "block_size", "num_blocks", "max_pos", "elem_size")]
    _fields_ += [("eps", _f32), ("scale", _f32), ("dtype_code", _i32), ("cos", _ptr), ("sin", _ptr)]


class _Layer(ctypes.Structure):
    _fields_ = [(name, _ptr) for name in ("input_norm", "post_norm", "qkv_w", "qkv_b", "o_w", "o_b", "gate_up_w",
                                          "gate_up_b", "down_w", "down_b", "key_cache", "value_cache", "q_norm",
                                          "k_norm")]
    _fields_ += [("window", _i32), ("softcap", _f32), ("sinks", _ptr)]
    _fields_ += [(name, _ptr) for name in ("attn_out_norm", "mlp_out_norm", "cos", "sin")]


class _Tables(ctypes.Structure):
    _fields_ = [("block_tables", _ptr), ("slot_mapping", _ptr), ("table_stride", _i64)]


class _Step(ctypes.Structure):
    _fields_ = [("num_tokens", _i64), ("num_seqs", _i64), ("table_stride", _i64), ("decode_only", _i32),
                ("threads", _i32)]
    _fields_ += [(name, _ptr) for name in ("positions", "slot_mapping", "block_tables", "query_start_loc",
                                           "seq_lens", "context_lens", "groups", "layer_group")]


class _Buffers(ctypes.Structure):
    _fields_ = [(name, _ptr) for name in ("residual", "h", "x", "qkv", "attn", "mid")]


class _Library:
    def __init__(self, so_path: Path) -> None:
        lib = load_library(so_path)  # the very file the cache checked (build/cache.py)
        lib.run_decoder_layers.restype = ctypes.c_int
        lib.run_decoder_layers.argtypes = [_ptr] * 6
        self.run = lib.run_decoder_layers


@functools.lru_cache(maxsize=1)
def load() -> _Library | None:
    """Build (once per machine and source) and load the runner; None where that fails or
    PAGEDRUN_LAYER_RUNNER=0 (the Python loop then runs, as it always can)."""
    return cpu_build.load("PAGEDRUN_LAYER_RUNNER", SOURCE, _Library)[0]


def _address(fn) -> int:
    return ctypes.cast(fn, _ptr).value


def _ptr_of(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class LayerRunner:
    """Runs model.model.layers for one step; `run` returns None where the Python loop must."""

    def __init__(self, model, lib: _Library, ops_lib: ops.CpuModelOps) -> None:
        cfg = model.config
        self.model = model
        self.dtype = model.dtype
        self.lib = lib
        self.ops_lib = ops_lib
        attn = model.model.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.q_size, self.kv_size = attn.q_size, attn.kv_size
        self.hidden, self.intermediate = cfg.hidden_size, cfg.intermediate_size
        self.scale = attn.scale
        self.eps = cfg.rms_norm_eps
        self._kv_key: tuple | None = None  # the caches the layer table was built for
        self._layers = None
        self._uniform = False  # every layer's caches have layer 0's shape (checked by _build)
        self._model_args = None
        self._sinks: list[torch.Tensor] = []  # the layers' sinks the pointer table points at
        self._kernels = None
        self._status = ctypes.c_int(0)

    @classmethod
    def for_model(cls, model) -> LayerRunner | None:
        """A runner for a loaded model (weights packed), or None where it cannot apply."""
        if model.dtype not in _DTYPES or getattr(model.config, "moe", None) is not None:
            return None  # MoE layers have no op in the runner yet: the Python layer loop runs them
        ops_lib = ops.load()
        if ops_lib is None or load() is None:
            return None
        # What the C loop has no op for: partial rotary (its rope call rotates whole heads) and
        # Granite's residual multiplier (a scale before each residual add). The Python loop runs those.
        if getattr(model.config, "residual_multiplier", 1.0) != 1.0:
            return None
        if any(2 * rotary.cos.shape[1] != model.config.head_dim for rotary in model.rotaries()):
            return None
        for layer in model.model.layers:
            linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            if any(lin.weight.device.type != "cpu" or lin.weight.dim() < 3 for lin in linears):
                return None  # not packed: the kernels were off or refused the shapes
        return cls(model, load(), ops_lib)

    def _build(self, kv_caches, kern) -> None:
        """The per-layer pointer table, the model's sizes and the kernels' addresses (once per cache)."""
        lib = self.ops_lib.lib
        linear = lib.linear_packed_bf16 if self.dtype == torch.bfloat16 else lib.linear_packed_f32
        attention = kern.functions()
        # The ops the Python loop's calls reach: Gemma's norms hold float32 weights (1 + w), which
        # ops.rms_norm takes to its *_w32 kernels on bf16 rows; Gemma's MLP is GeGLU.
        layer0 = self.model.model.layers[0]
        norm = "rms_norm_w32" if layer0.input_layernorm.weight.dtype != self.dtype else "rms_norm"
        gated = "linear_packed_gelu" if self.model.config.hidden_act == "gelu_pytorch_tanh" else "linear_packed_silu"
        self._kernels = _Kernels(
            _address(self.ops_lib.op(norm, self.dtype)), _address(linear),
            _address(self.ops_lib.op(gated, self.dtype)), _address(self.ops_lib.op("rope", self.dtype)),
            _address(attention["reshape_and_cache"]), _address(attention["decode"]), _address(attention["varlen"]),
            _address(self.ops_lib.op("head_" + norm, self.dtype)))
        rotary_of = getattr(self.model, "rotary_of", None)  # Gemma: each layer's RoPE tables
        self._sinks = []
        layers = (_Layer * len(kv_caches))()
        for i, (row, layer, (key_cache, value_cache)) in enumerate(
                zip(layers, self.model.model.layers, kv_caches, strict=True)):
            attn, mlp = layer.self_attn, layer.mlp
            # Gemma's sandwich: the norm that adds the residual before the MLP is its
            # pre_feedforward_layernorm; post_attention_layernorm and post_feedforward_layernorm
            # norm the attention's and the MLP's outputs in place.
            sandwich = hasattr(layer, "pre_feedforward_layernorm")
            pre_mlp = layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm
            row.input_norm, row.post_norm = _ptr_of(layer.input_layernorm.weight), _ptr_of(pre_mlp.weight)
            if sandwich:
                row.attn_out_norm = _ptr_of(layer.post_attention_layernorm.weight)
                row.mlp_out_norm = _ptr_of(layer.post_feedforward_layernorm.weight)
            if rotary_of is not None:
                rotary = rotary_of(i)
                row.cos, row.sin = rotary.cos.data_ptr(), rotary.sin.data_ptr()
            row.qkv_w, row.qkv_b = _ptr_of(attn.qkv_proj.weight), _ptr_of(attn.qkv_proj.bias)
            row.o_w, row.o_b = _ptr_of(attn.o_proj.weight), _ptr_of(attn.o_proj.bias)
            row.gate_up_w, row.gate_up_b = _ptr_of(mlp.gate_up_proj.weight), _ptr_of(mlp.gate_up_proj.bias)
            row.down_w, row.down_b = _ptr_of(mlp.down_proj.weight), _ptr_of(mlp.down_proj.bias)
            row.key_cache, row.value_cache = key_cache.data_ptr(), value_cache.data_ptr()
            if attn.qk_norm:  # null otherwise: the C loop skips the per-head norms
                row.q_norm, row.k_norm = attn.q_norm.weight.data_ptr(), attn.k_norm.weight.data_ptr()
            row.window, row.softcap = int(getattr(attn, "window", 0) or 0), float(getattr(attn, "softcap", 0.0) or 0.0)
            sinks = sink_arg(getattr(attn, "sinks", None), self.num_heads)
            if sinks is not None:
                self._sinks.append(sinks)
                row.sinks = sinks.data_ptr()
        key_cache = kv_caches[0][0]
        self._uniform = all(len(kv) == 2 and kv[0].shape == kv[1].shape == key_cache.shape for kv in kv_caches)
        rotary = self.model.rotary_emb
        self._model_args = _Model(
            len(kv_caches), self.hidden, self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate,
            key_cache.shape[1], key_cache.shape[0], rotary.cos.shape[0], key_cache.element_size(),
            self.eps, self.scale, DTYPE_CODES[self.dtype], rotary.cos.data_ptr(), rotary.sin.data_ptr())
        self._layers = layers

    def _usable(self, h: torch.Tensor, positions: torch.Tensor, kv_caches, meta: AttentionMetadata, backend):
        """The attention kernels when every op of this step would run its C++ kernel, else None."""
        if not ops.kernels_enabled() or h.dtype != self.dtype or not h.is_cpu or h.dim() != 2:
            return None
        if _hooked(self.model.model.layers):
            return None  # a forward hook on a decoder layer expects that layer's call
        if not h.is_contiguous() or h.shape[0] == 0 or h.shape[0] != meta.num_tokens:
            return None
        plain = getattr(backend, "plain_cpu_kernels", None)
        key_cache, value_cache = kv_caches[0][:2]
        kern = plain(self.dtype, key_cache, value_cache) if plain is not None else None
        if kern is None or len(kv_caches[0]) != 2:
            return None
        rotary = self.model.rotary_emb
        # The RoPE kernel refuses positions past its table; the loop's torch fallback raises on them.
        if meta.max_seq_len > rotary.cos.shape[0] or positions.dtype != torch.long or not positions.is_contiguous():
            return None
        return kern

    def run(self, h: torch.Tensor, positions: torch.Tensor, kv_caches, metas: Sequence[AttentionMetadata], backend):
        """(h, residual) after the last layer, as the Python loop leaves them; None: run the loop.
        metas: one AttentionMetadata per layer (attention/metadata.py: per_layer)."""
        meta = metas[0]
        groups = _Groups.of(metas)
        if groups is False:
            return None  # metadata that differ in more than their tables: not a step of one batch
        kern = self._usable(h, positions, kv_caches, meta, backend)
        if kern is None:
            return None
        key = (id(kv_caches), kv_caches[0][0].data_ptr(), kv_caches[-1][1].data_ptr(), id(kern))
        if key != self._kv_key:
            self._build(kv_caches, kern)
            self._kv_key = key
        if not self._uniform:
            return None  # layers' caches of different shapes: the model table has one
        t, dtype = h.shape[0], self.dtype
        residual = h  # the embeddings; the first layer's norm reads them, the later ones add to them
        out = torch.empty(t, self.hidden, dtype=dtype)
        x = torch.empty(t, self.hidden, dtype=dtype)
        qkv = torch.empty(t, self.q_size + 2 * self.kv_size, dtype=dtype)
        attn = torch.empty(t, self.q_size, dtype=dtype)
        mid = torch.empty(t, self.intermediate, dtype=dtype)
        tables, starts = int_arg(meta.block_tables, torch.int32), int_arg(meta.query_start_loc, torch.int32)
        seq_lens, context_lens = int_arg(meta.seq_lens, torch.int32), int_arg(meta.context_lens, torch.int32)
        slots = int_arg(meta.slot_mapping, torch.int64)
        step = _Step(t, meta.num_seqs, tables.shape[1], int(meta.is_decode_only and meta.num_seqs == t),
                     torch.get_num_threads(), positions.data_ptr(), slots.data_ptr(), tables.data_ptr(),
                     starts.data_ptr(), seq_lens.data_ptr(), context_lens.data_ptr(),
                     *(groups.pointers() if groups else (None, None)))
        buffers = _Buffers(residual.data_ptr(), out.data_ptr(), x.data_ptr(), qkv.data_ptr(), attn.data_ptr(),
                           mid.data_ptr())
        where = self.lib.run(ctypes.byref(self._kernels), ctypes.byref(self._model_args), self._layers,
                             ctypes.byref(step), ctypes.byref(buffers), ctypes.byref(self._status))
        if where:
            layer, stage = divmod(where - 1, 16)
            raise RuntimeError(f"layer runner: layer {layer}, call {stage + 1} refused its arguments "
                               f"(status {self._status.value}): a bug, please report it")
        backend.last_path, backend.cpu_kernel_error = "cpu_kernel", None
        return out, residual


class _Groups:
    """The distinct metadata of a step's layers (KV cache groups): their tables as C reads them
    (PrTables), and each layer's index into them. Holds the tensors the pointers point into."""

    def __init__(self, metas: Sequence[AttentionMetadata]) -> None:
        index: dict[int, int] = {}
        self.metas: list[AttentionMetadata] = []
        for m in metas:
            if id(m) not in index:
                index[id(m)] = len(self.metas)
                self.metas.append(m)
        self.layer_group = torch.tensor([index[id(m)] for m in metas], dtype=torch.int32)
        self.tensors = [(int_arg(m.block_tables, torch.int32), int_arg(m.slot_mapping, torch.int64))
                        for m in self.metas]
        self.tables = (_Tables * len(self.metas))(*(
            _Tables(tables.data_ptr(), slots.data_ptr(), tables.shape[1]) for tables, slots in self.tensors))

    @classmethod
    def of(cls, metas: Sequence[AttentionMetadata]) -> _Groups | None | bool:
        """None: every layer has the same metadata; False: they differ in more than their tables."""
        first = metas[0]
        if all(m is first for m in metas):
            return None
        groups = cls(metas)
        same = all(m.query_lens_list == first.query_lens_list and m.seq_lens_list == first.seq_lens_list
                   and m.num_tokens == first.num_tokens and m.block_size == first.block_size for m in groups.metas)
        return groups if same else False

    def pointers(self) -> tuple[int, int]:
        return ctypes.addressof(self.tables), self.layer_group.data_ptr()


def _hooked(layers) -> bool:
    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    return any(layer._forward_hooks or layer._forward_pre_hooks for layer in layers)

