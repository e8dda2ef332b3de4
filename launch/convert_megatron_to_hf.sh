#!/usr/bin/env bash
# Megatron distributed checkpoint (saved at any TP/PP) -> HF directory (safetensors, config, tokenizer).
#   bash launch/convert_megatron_to_hf.sh /ckpt/actor/step_1000 /export/actor-hf
#   NNODES=2 NODE_RANK=$SLURM_NODEID MASTER_ADDR=node0 NPROC_PER_NODE=8 bash launch/convert_megatron_to_hf.sh ...
set -euo pipefail
M_DIR=${1:?usage: $0 MEGATRON_DIR OUT_DIR}
OUT_DIR=${2:?usage: $0 MEGATRON_DIR OUT_DIR}
REPO=$(cd "$(dirname "$0")/.." && pwd)
if [[ -z "${NNODES:-}" && -z "${NPROC_PER_NODE:-}" ]]; then
  exec python "$REPO/checkpoint_tools/megatron_to_hf.py" --megatron-dir "$M_DIR" --out "$OUT_DIR" ${OVERWRITE:+--overwrite}
fi
exec torchrun --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" --nproc-per-node "${NPROC_PER_NODE:-1}" \
  --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" \
  "$REPO/checkpoint_tools/megatron_to_hf.py" --megatron-dir "$M_DIR" --out "$OUT_DIR" ${OVERWRITE:+--overwrite}
