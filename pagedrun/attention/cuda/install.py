"""Which CuPy fits this machine, said in one line when the cupy backend cannot start.

CuPy ships one distribution per CUDA major (cupy-cuda12x, cupy-cuda13x); both install into the same
`cupy` package, so two of them break `import cupy`, and one built for another CUDA major than
torch's loads a second, mismatched runtime. pagedrun's extras are `gpu-cu12` and `gpu-cu13`; the
right one is the one matching torch's CUDA (torch.version.cuda), which is what the engine runs on.
"""
from __future__ import annotations

from importlib import metadata

EXTRAS = {12: "gpu-cu12", 13: "gpu-cu13"}
DISTRIBUTIONS = {12: "cupy-cuda12x", 13: "cupy-cuda13x"}


def cuda_major(version: str | None) -> int | None:
    """'13.0' -> 13; None or garbage -> None."""
    try:
        return int(str(version).split(".")[0])
    except (TypeError, ValueError):
        return None


def installed_cupys() -> list[str]:
    """The cupy-cudaXXx distributions pip installed (more than one is a broken environment)."""
    out = []
    for name in (*DISTRIBUTIONS.values(), "cupy"):
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        out.append(name)
    return out


def install_hint(torch_cuda: str | None, installed: list[str]) -> str:
    """What to do, in one clause, for torch built for `torch_cuda` with `installed` CuPy distributions."""
    major = cuda_major(torch_cuda)
    want = DISTRIBUTIONS.get(major or 0)
    if len(installed) > 1:
        keep = want or installed[0]
        return (f"several CuPy distributions are installed ({', '.join(installed)}), which breaks `import cupy`: "
                f"pip uninstall {' '.join(installed)}, then pip install {keep}")
    if major is None:
        return ("torch here has no CUDA build (torch.version.cuda is None): install a CUDA build of torch, "
                "then pip install 'pagedrun[gpu-cu12]' or 'pagedrun[gpu-cu13]' to match it")
    if want is None:
        return f"torch is built for CUDA {torch_cuda}, for which pagedrun has no CuPy extra; install a CuPy for it"
    if installed and installed[0] != want:
        return (f"{installed[0]} is installed but torch is built for CUDA {torch_cuda}: "
                f"pip uninstall {installed[0]} && pip install 'pagedrun[{EXTRAS[major]}]'")
    return f"pip install 'pagedrun[{EXTRAS[major]}]' (torch is built for CUDA {torch_cuda})"


def cupy_unavailable_message(reason: str) -> str:
    import torch

    return f"attention_backend: cupy unavailable ({reason}): {install_hint(torch.version.cuda, installed_cupys())}"
