#!/usr/bin/env bash
# Stop the Ray node running on this machine (started with launch/ray_start_head.sh or launch/ray_start_worker.sh).
#
#   bash launch/ray_stop.sh                          # `ray stop`: EVERY Ray process on this machine, any cluster
#   bash launch/ray_stop.sh --temp-dir /tmp/c1/head  # only the node started with `--temp-dir /tmp/c1/head`
#   bash launch/ray_stop.sh --temp-dir DIR --grace-period 30   # seconds before SIGKILL (default 10; --force: at once)
#   bash launch/ray_stop.sh --temp-dir DIR --dry-run           # list that node's processes, stop nothing
#
# Run it on each node of the cluster, worker nodes first. Plain `ray stop` knows no cluster: on a machine shared by
# several clusters (other users' under the same account, several "nodes" of one test cluster) it stops all of them.
# With --temp-dir it stops only the node whose `ray start` was given that --temp-dir: the processes whose command line
# names a directory in it (GCS, raylet, dashboard, its agents, log monitor, autoscaler monitor), plus every process
# below them (the node's workers and a job's driver); SIGTERM, then SIGKILL after the grace period. Prints what it
# stopped; exit status 0 when nothing of that node is left, 1 otherwise. The temp dir itself is left for its logs.
set -euo pipefail
RAY="${RAY:-ray}"
TEMP_DIR=""
GRACE=10
FORCE=0
DRY=0
PASS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --temp-dir) TEMP_DIR="$2"; shift 2 ;;
    --temp-dir=*) TEMP_DIR="${1#--temp-dir=}"; shift ;;
    -g|--grace-period) GRACE="$2"; PASS+=(--grace-period "$2"); shift 2 ;;
    -f|--force) FORCE=1; PASS+=(--force); shift ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '/^set -euo/q;2,$p' "$0"; exit 0 ;;
    *) echo "ray_stop.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if [ -z "$TEMP_DIR" ]; then
  if [ "$DRY" = 1 ]; then echo "${RAY} stop ${PASS[*]}"; exit 0; fi
  command -v "$RAY" >/dev/null || { echo "ray_stop.sh: '$RAY' not found; activate megarl's venv (launch/install_cpu.sh)" >&2; exit 2; }
  exec "$RAY" stop "${PASS[@]}"
fi
[[ "$GRACE" =~ ^[0-9]+$ ]] || { echo "ray_stop.sh: --grace-period takes whole seconds, got '$GRACE'" >&2; exit 2; }
if [ ! -d "$TEMP_DIR" ]; then
  echo "ray_stop.sh: --temp-dir '$TEMP_DIR' is not a directory (the --temp-dir given to ray_start_*.sh)" >&2
  exit 2
fi
DIR="$(cd "$TEMP_DIR" && pwd -P)"

# pid -> parent pid and command line, once (a process that exits meanwhile is simply skipped)
declare -A PPID_OF=() CMD_OF=()
for proc in /proc/[0-9]*; do
  pid="${proc#/proc/}"
  { read -r stat <"$proc/stat"; } 2>/dev/null || continue
  stat="${stat##*) }"  # the fields after "pid (comm) ": state, ppid, ...
  read -r _ ppid _ <<<"$stat"
  PPID_OF[$pid]="$ppid"
  args=()
  { mapfile -d '' -t args <"$proc/cmdline"; } 2>/dev/null || true
  CMD_OF[$pid]="${args[*]:-}"
done
# this script and its callers are never stopped (their command lines name the directory too)
declare -A SELF=()
pid=$$
while [ -n "$pid" ] && [ "$pid" != 0 ]; do SELF[$pid]=1; pid="${PPID_OF[$pid]:-}"; done

# Ray passes the node's directories as `--flag=DIR/...` (or `--flag DIR/...`): match those, not any mention of DIR
ROOTS=()
for pid in "${!CMD_OF[@]}"; do
  [ -n "${SELF[$pid]:-}" ] && continue
  case " ${CMD_OF[$pid]}" in
    *"=$DIR/"* | *"=$DIR "* | *" $DIR/"* | *" $DIR "*) ROOTS+=("$pid") ;;
  esac
done
# A head node's Ray client server names only the GCS address (`--address=IP:PORT`): it is the head's when this node
# runs the GCS (`gcs_server --gcs_server_port=PORT --node-ip-address=IP`).
for pid in "${ROOTS[@]}"; do
  cmd=" ${CMD_OF[$pid]} "
  case "$cmd" in
    *"/gcs_server "*)
      port="${cmd##* --gcs_server_port=}"; port="${port%% *}"
      ip="${cmd##* --node-ip-address=}"; ip="${ip%% *}"
      for other in "${!CMD_OF[@]}"; do
        case " ${CMD_OF[$other]} " in
          *" ray.util.client.server "*"--address=$ip:$port "*) [ -z "${SELF[$other]:-}" ] && ROOTS+=("$other") ;;
        esac
      done ;;
  esac
done
# ...and every process below them (workers, a job's driver and its children)
declare -A STOP=()
for pid in "${ROOTS[@]}"; do STOP[$pid]=1; done
changed=1
while [ "$changed" = 1 ]; do
  changed=0
  for pid in "${!PPID_OF[@]}"; do
    if [ -z "${STOP[$pid]:-}" ] && [ -n "${STOP[${PPID_OF[$pid]}]:-}" ] && [ -z "${SELF[$pid]:-}" ]; then
      STOP[$pid]=1; changed=1
    fi
  done
done
PIDS=("${!STOP[@]}")
if [ ${#PIDS[@]} -eq 0 ]; then
  echo "[ray_stop] no Ray process of the node in $DIR is running"
  exit 0
fi
if [ "$DRY" = 1 ]; then
  for pid in "${PIDS[@]}"; do echo "$pid ${CMD_OF[$pid]:0:160}"; done
  exit 0
fi
# the pids still running (a zombie has exited: only its parent's wait is missing)
alive() {
  local n=() pid stat
  for pid in "$@"; do
    { read -r stat <"/proc/$pid/stat"; } 2>/dev/null || continue
    stat="${stat##*) }"
    [ "${stat:0:1}" = Z ] || n+=("$pid")
  done
  echo "${n[@]:-}"
}
if [ "$FORCE" = 0 ]; then
  # The GCS last: a raylet told to stop while the GCS is already gone waits for it and needs SIGKILL after the grace
  # period (seen with Ray 2.60); `ray stop` has the same race.
  FIRST=() GCS=()
  for pid in "${PIDS[@]}"; do
    case " ${CMD_OF[$pid]}" in *"/gcs_server "*) GCS+=("$pid") ;; *) FIRST+=("$pid") ;; esac
  done
  for phase in FIRST GCS; do
    declare -n group="$phase"
    [ ${#group[@]} -eq 0 ] && continue
    kill -TERM "${group[@]}" 2>/dev/null || true
    for _ in $(seq $((GRACE * 5))); do
      [ -z "$(alive "${group[@]}")" ] && break
      sleep 0.2
    done
  done
fi
read -r -a LEFT <<<"$(alive "${PIDS[@]}")"
if [ ${#LEFT[@]} -gt 0 ]; then
  if [ "$FORCE" = 0 ]; then
    echo "[ray_stop] still running after ${GRACE}s, so SIGKILL: $(for pid in "${LEFT[@]}"; do
      printf '%s ' "$pid:${CMD_OF[$pid]:0:60}"; done)"
  fi
  kill -KILL "${LEFT[@]}" 2>/dev/null || true
  for _ in $(seq 25); do
    [ -z "$(alive "${LEFT[@]}")" ] && break
    sleep 0.2
  done
fi
read -r -a LEFT <<<"$(alive "${PIDS[@]}")"
echo "[ray_stop] stopped $((${#PIDS[@]} - ${#LEFT[@]})) of ${#PIDS[@]} Ray process(es) of the node in $DIR"
if [ ${#LEFT[@]} -gt 0 ]; then
  echo "ray_stop.sh: still running: ${LEFT[*]}" >&2
  exit 1
fi
