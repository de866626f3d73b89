"""Pick an attention backend by name: auto | torch | cupy | emulated.

auto  -> cupy when CuPy sees a GPU and the model runs on a CUDA device, else torch.
torch -> pagedrun.attention.torch_backend (plain torch, any device).
cupy  -> kernels/cuda/*.cu through cupy.RawModule; needs a CUDA GPU.
emulated -> the same kernels through the CUDA-on-CPU emulator (tests; very slow).
"""
from __future__ import annotations

import torch

from pagedrun.errors import PagedrunError

BACKEND_NAMES = ("auto", "torch", "cupy", "emulated")


def _cupy_status() -> str | None:
    """None when CuPy imports and sees a GPU; else why not (for the one-line error)."""
    try:
        import cupy
    except Exception as e:  # not installed, two CuPys, or a broken CUDA install
        return f"import cupy failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
    try:
        return None if cupy.is_available() else "CuPy sees no CUDA GPU"
    except Exception as e:
        return f"CuPy cannot reach a GPU: {e}"


def _cupy_gpu() -> bool:
    return _cupy_status() is None


def _emulator_present() -> bool:
    try:
        import pagedrun.build.cudaemu  # noqa: F401
    except Exception:
        return False
    return True


def available_backends() -> list[str]:
    """Concrete backends usable on this machine (auto is always accepted by make_backend)."""
    names = ["torch"]
    if _cupy_gpu():
        names.append("cupy")
    if _emulator_present():
        names.append("emulated")
    return names


def make_backend(name: str, device: torch.device | str = "cpu", kv_spec=None, model_dtype: torch.dtype | None = None):
    """kv_spec (pagedrun.attention.kv_cache_spec.KVCacheSpec): how the cache stores K/V; None = the model's dtype."""
    device = torch.device(device)
    if name == "auto":
        name = "cupy" if device.type == "cuda" and _cupy_gpu() else "torch"
    kv_name = "auto" if kv_spec is None or kv_spec.storage == model_dtype else kv_spec.name
    if kv_name in ("float32", "bfloat16", "float16") and name != "torch":
        # The CUDA kernels read a cache in the query's dtype or a quantized one, not another float.
        raise PagedrunError(f"cache.kv_cache_dtype: {kv_name} with a {str(model_dtype).removeprefix('torch.')} model "
                            f"is not supported by the {name} backend; supported: auto, fp8, fp8_e4m3, fp8_e5m2, int8")
    if name == "torch":
        from pagedrun.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(kv_cache_dtype=kv_name)
    if name == "cupy":
        why = _cupy_status()
        if why is not None:
            if why.startswith("import cupy failed"):
                from pagedrun.attention.cuda.install import cupy_unavailable_message

                raise PagedrunError(cupy_unavailable_message(why))
            raise PagedrunError(f"attention_backend: cupy needs a CUDA GPU ({why}); use auto or torch")
        if device.type != "cuda":
            raise PagedrunError(f"attention_backend: cupy needs the model on a CUDA device, not {device}")
        from pagedrun.attention.cuda.cupy_backend import CupyAttentionBackend

        return CupyAttentionBackend(kv_cache_dtype=kv_name)
    if name == "emulated":
        if device.type != "cpu":
            raise PagedrunError(f"attention_backend: emulated runs on the CPU, not {device}")
        from pagedrun.attention.cuda.emulated_backend import EmulatedAttentionBackend

        return EmulatedAttentionBackend(kv_cache_dtype=kv_name)
    raise PagedrunError(
        f"attention_backend: unknown backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}"
    )
