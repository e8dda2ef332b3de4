#!/usr/bin/env bash
# HF -> Megatron distributed checkpoint. Rank 0 streams the conversion; the other ranks join megatron-core's
# collective save (useful when the output lives on a shared filesystem and the job is already multi-node).
#   single process:  bash launch/convert_hf_to_megatron.sh /models/Qwen2.5-7B /ckpt/qwen2.5-7b-mcore bf16
#   multi-node:      NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 NPROC_PER_NODE=8 bash launch/convert_hf_to_megatron.sh ...
set -euo pipefail
HF_DIR=${1:?usage: $0 HF_DIR OUT_DIR [bf16|fp32]}
OUT_DIR=${2:?usage: $0 HF_DIR OUT_DIR [bf16|fp32]}
DTYPE=${3:-bf16}
REPO=$(cd "$(dirname "$0")/.." && pwd)
if [[ -z "${NNODES:-}" && -z "${NPROC_PER_NODE:-}" ]]; then
  exec python "$REPO/checkpoint_tools/hf_to_megatron.py" --hf-dir "$HF_DIR" --out "$OUT_DIR" --dtype "$DTYPE" ${OVERWRITE:+--overwrite}
fi
exec torchrun --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" --nproc-per-node "${NPROC_PER_NODE:-1}" \
  --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" \
  "$REPO/checkpoint_tools/hf_to_megatron.py" --hf-dir "$HF_DIR" --out "$OUT_DIR" --dtype "$DTYPE" ${OVERWRITE:+--overwrite}
