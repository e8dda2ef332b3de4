#!/usr/bin/env bash
# Start the Ray head node of a megarl cluster (run once, on the node that will run the controller).
#
#   bash launch/ray_start_head.sh                          # port 6379, all local CPUs/GPUs
#   bash launch/ray_start_head.sh --port 6380 --num-gpus 8 # extra flags go to `ray start` unchanged
#   bash launch/ray_start_head.sh --dry-run                # print the command, start nothing
#
# Then on every other node:  bash launch/ray_start_worker.sh --address HEAD_IP:PORT
# and submit a job:          bash launch/ray_submit.sh yaml_configs/<config>.yaml [key=value ...]
#
# Ray 2.60 uses token authentication: this script makes sure a token exists (~/.ray/auth_token, created with
# `ray get-auth-token --generate` if missing) and runs with RAY_AUTH_MODE=token. Copy that file to every worker
# node (or export RAY_AUTH_TOKEN there) before it joins. The dashboard (job submission, port 8265) binds to
# 127.0.0.1 unless you pass --dashboard-host; submit from the head node or through an SSH tunnel.
# Stop with `ray stop` on each node (it stops every Ray process of this user on that node).
set -euo pipefail
RAY="${RAY:-ray}"
PORT=6379
DRY=0
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --port) PORT="$2"; shift 2 ;;
    --port=*) PORT="${1#--port=}"; shift ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) EXTRA+=("$1"); shift ;;
  esac
done
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
CMD=("$RAY" start --head --port "$PORT" "${EXTRA[@]}")
if [ "$DRY" = 1 ]; then
  echo "RAY_AUTH_MODE=$RAY_AUTH_MODE ${CMD[*]}"
  exit 0
fi
command -v "$RAY" >/dev/null || { echo "ray_start_head.sh: '$RAY' not found; activate megarl's venv (launch/install_cpu.sh)" >&2; exit 2; }
if [ "$RAY_AUTH_MODE" = token ] && [ -z "${RAY_AUTH_TOKEN:-}" ]; then
  "$RAY" get-auth-token --generate >/dev/null
  echo "[ray_start_head] token: ${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token} (copy it to every worker node)"
fi
"${CMD[@]}"
IP="$(hostname -I 2>/dev/null | awk '{print $1}')"
echo "[ray_start_head] workers join with: bash launch/ray_start_worker.sh --address ${IP:-HEAD_IP}:$PORT"
