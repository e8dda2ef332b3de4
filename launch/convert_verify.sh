#!/usr/bin/env bash
# Logit parity of a Megatron checkpoint (or the HF dir loaded directly) at TP x PP against transformers.
# tp*pp ranks in total; across nodes, e.g. TP=8 PP=2 on two 8-GPU nodes:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 NPROC_PER_NODE=8 TP=8 PP=2 bash launch/convert_verify.sh HF_DIR [M_DIR]
# Without NNODES/NPROC_PER_NODE the tool starts its own tp*pp local ranks.
set -euo pipefail
HF_DIR=${1:?usage: $0 HF_DIR [MEGATRON_DIR]}
M_DIR=${2:-}
TP=${TP:-1}; PP=${PP:-1}
REPO=$(cd "$(dirname "$0")/.." && pwd)
ARGS=(--hf-dir "$HF_DIR" --tp "$TP" --pp "$PP" --json "${JSON_OUT:-verify.json}")
[[ -n "$M_DIR" ]] && ARGS+=(--megatron-dir "$M_DIR")
if [[ -z "${NNODES:-}" && -z "${NPROC_PER_NODE:-}" ]]; then
  exec python "$REPO/checkpoint_tools/verify.py" "${ARGS[@]}"
fi
exec torchrun --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" --nproc-per-node "${NPROC_PER_NODE:-1}" \
  --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" \
  "$REPO/checkpoint_tools/verify.py" "${ARGS[@]}"
