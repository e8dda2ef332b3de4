#!/usr/bin/env bash
# Join this node to a running megarl Ray cluster (started with launch/ray_start_head.sh).
#
#   bash launch/ray_start_worker.sh --address 10.0.0.1:6379
#   bash launch/ray_start_worker.sh --address 10.0.0.1:6379 --num-gpus 8   # extra flags go to `ray start`
#   MEGARL_RAY_ADDRESS=10.0.0.1:6379 bash launch/ray_start_worker.sh
#   bash launch/ray_start_worker.sh --address 10.0.0.1:6379 --dry-run      # print the command only
#
# Token authentication (Ray 2.60): the head's token must be here, as ~/.ray/auth_token (copied from the head),
# a file named by RAY_AUTH_TOKEN_PATH, or the RAY_AUTH_TOKEN variable; the script stops with a message if none is.
# A pool of `devices_per_node` slots needs that many GPUs (cuda) or CPUs (cpu, x cpus_per_slot) on each node.
# Stop with `bash launch/ray_stop.sh` on this node (worker nodes before the head). A second node on a machine that
# already runs one (see launch/ray_start_head.sh): its own --temp-dir and --dashboard-agent-listen-port, plus
# --min-worker-port 0 --max-worker-port 0; stop it with `bash launch/ray_stop.sh --temp-dir DIR`.
set -euo pipefail
RAY="${RAY:-ray}"
ADDRESS="${MEGARL_RAY_ADDRESS:-}"
DRY=0
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --address) ADDRESS="$2"; shift 2 ;;
    --address=*) ADDRESS="${1#--address=}"; shift ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '/^set -euo/q;2,$p' "$0"; exit 0 ;;
    *) EXTRA+=("$1"); shift ;;
  esac
done
if [ -z "$ADDRESS" ]; then
  echo "ray_start_worker.sh: --address HEAD_IP:PORT is required (printed by launch/ray_start_head.sh)" >&2
  exit 2
fi
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
CMD=("$RAY" start --address "$ADDRESS" "${EXTRA[@]}")
if [ "$DRY" = 1 ]; then
  echo "RAY_AUTH_MODE=$RAY_AUTH_MODE ${CMD[*]}"
  exit 0
fi
TOKEN_FILE="${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}"
if [ "$RAY_AUTH_MODE" = token ] && [ -z "${RAY_AUTH_TOKEN:-}" ] && [ ! -s "$TOKEN_FILE" ]; then
  echo "ray_start_worker.sh: no Ray auth token: copy the head's ~/.ray/auth_token to $TOKEN_FILE or export RAY_AUTH_TOKEN" >&2
  exit 2
fi
command -v "$RAY" >/dev/null || { echo "ray_start_worker.sh: '$RAY' not found; activate megarl's venv (launch/install_cpu.sh)" >&2; exit 2; }
"${CMD[@]}"
