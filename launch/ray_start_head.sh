#!/usr/bin/env bash
# Start the Ray head node of a megarl cluster (run once, on the node that will run the controller).
#
#   bash launch/ray_start_head.sh                          # port 6379, all local CPUs/GPUs
#   bash launch/ray_start_head.sh --port 6380 --num-gpus 8 # extra flags go to `ray start` unchanged
#   bash launch/ray_start_head.sh --dry-run                # print the command, start nothing
#
# Then on every other node:  bash launch/ray_start_worker.sh --address HEAD_IP:PORT
# and run a config:          bash launch/ray_submit.sh --driver --address HEAD_IP:PORT yaml_configs/<config>.yaml
#                            (the controller in that shell; without --driver, a Ray job: needs ray[default])
#
# Ray 2.60 uses token authentication: this script makes sure a token exists and runs with RAY_AUTH_MODE=token. The
# token is ~/.ray/auth_token (created with `ray get-auth-token --generate` if missing), or the file RAY_AUTH_TOKEN_PATH
# names (created there if missing; ~/.ray is then left alone), or the RAY_AUTH_TOKEN variable. Copy that file to every
# worker node (or export RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH there) before it joins. The dashboard (job submission,
# port 8265) binds to 127.0.0.1 unless you pass --dashboard-host; submit from the head node or through an SSH tunnel.
# Stop with `bash launch/ray_stop.sh` on each node (plain `ray stop`: every Ray process on that node, any cluster).
#
# Several clusters (or several "nodes" of one, e.g. to try a multi-node layout) on one machine: give each `ray start`
# its own --temp-dir and ports (--port, --dashboard-port, --ray-client-server-port, --dashboard-agent-listen-port,
# --min-worker-port 0 --max-worker-port 0), e.g.
#   RAY_AUTH_TOKEN_PATH=/tmp/c1/token bash launch/ray_start_head.sh --port 6390 --dashboard-port 8275 \
#       --ray-client-server-port 10011 --dashboard-agent-listen-port 52375 --temp-dir /tmp/c1/head --num-cpus 1
# and stop each with `bash launch/ray_stop.sh --temp-dir DIR`, which leaves the other clusters running.
set -euo pipefail
RAY="${RAY:-ray}"
PORT=6379
NODE_IP=""
TEMP_DIR=""
DRY=0
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --port) PORT="$2"; shift 2 ;;
    --port=*) PORT="${1#--port=}"; shift ;;
    --node-ip-address) NODE_IP="$2"; EXTRA+=("$1" "$2"); shift 2 ;;
    --temp-dir) TEMP_DIR="$2"; EXTRA+=("$1" "$2"); shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '/^set -euo/q;2,$p' "$0"; exit 0 ;;
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
  if [ -n "${RAY_AUTH_TOKEN_PATH:-}" ]; then
    # `ray get-auth-token --generate` (Ray 2.60) always writes ~/.ray/auth_token, whatever RAY_AUTH_TOKEN_PATH says:
    # make the named file ourselves, the way Ray does (secrets.token_hex(32): 64 hex digits), readable by us only.
    if [ ! -s "$RAY_AUTH_TOKEN_PATH" ]; then
      mkdir -p "$(dirname "$RAY_AUTH_TOKEN_PATH")"
      (umask 077 && od -An -tx1 -N32 /dev/urandom | tr -d ' \n' > "$RAY_AUTH_TOKEN_PATH")
    fi
  else
    "$RAY" get-auth-token --generate >/dev/null
  fi
  echo "[ray_start_head] token: ${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token} (copy it to every worker node)"
fi
"${CMD[@]}"
IP="$NODE_IP"
[ -n "$IP" ] || IP="$(hostname -I 2>/dev/null | awk '{print $1}')"
echo "[ray_start_head] workers join with: bash launch/ray_start_worker.sh --address ${IP:-HEAD_IP}:$PORT"
echo "[ray_start_head] run a config with: bash launch/ray_submit.sh --driver --address ${IP:-HEAD_IP}:$PORT CONFIG" \
     "[key=value ...] (on any node of the cluster)"
echo "[ray_start_head] stop with: bash launch/ray_stop.sh${TEMP_DIR:+ --temp-dir $TEMP_DIR} (on each node)"
