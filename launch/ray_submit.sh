#!/usr/bin/env bash
# Run `megarl train CONFIG [key=value ...]` on a running Ray cluster (launch/ray_start_head.sh), in one of two modes.
#
# Job mode (default; needs ray[default] on the head): a Ray job, submitted to the head's dashboard.
#   bash launch/ray_submit.sh yaml_configs/cpu_quickstart.yaml
#   bash launch/ray_submit.sh CONFIG trainer.total_steps=10 --address http://10.0.0.1:8265 --no-wait
#   bash launch/ray_submit.sh CONFIG --working-dir .      # upload this checkout instead of using the installed megarl
#   bash launch/ray_submit.sh CONFIG --dry-run            # print the command only (`megarl train CONFIG --dry-run`
#                                                         # checks the config and placement)
# --verbose goes to `megarl train` (the vendors' own logs too); any other option is refused, as is an argument after
# CONFIG that is not a key=value override.
# --address: the head's dashboard (default $RAY_ADDRESS, else http://127.0.0.1:8265, i.e. run on the head node).
# By default megarl must be installed on every node (launch/install_cpu.sh); --working-dir DIR ships DIR instead.
# Without --working-dir the job runs in the directory ray_start_head.sh was started from (Ray's processes keep it):
# CONFIG and the relative paths in it are read there, so start the head from the checkout that holds them.
# The job's entrypoint runs on the head and is the single controller: it creates the pools and worker groups.
# --no-wait returns after submission; follow with `ray job logs --follow JOB_ID`, stop with `ray job stop JOB_ID`.
# Without --no-wait it streams the job's log (the controller's stdout and stderr) and exits 1 if the job failed.
# A plain `ray` install (what launch/install_cpu.sh installs) has no job server: the head's dashboard runs in
# "minimal" mode and `ray job submit` could only fail with "Failed to connect to Ray". The script checks this install
# (standing for the head's when they were made alike) and stops with a message naming both ways out.
#
# Driver mode (--driver; plain `ray` is enough): the controller runs here, in this shell, attached to the cluster.
#   bash launch/ray_submit.sh --driver --address 10.0.0.1:6379 yaml_configs/cpu_quickstart.yaml [key=value ...]
#   RAY_ADDRESS=10.0.0.1:6379 bash launch/ray_submit.sh --driver CONFIG --dry-run
# It runs `RAY_ADDRESS=ADDRESS megarl train CONFIG [key=value ...]` in place of this script (exec: the same process,
# so Ctrl-C / SIGTERM reach the controller, which stops after the step in flight): its output streams here and the
# script's exit status is the run's. --address is the head's GCS address HEAD_IP:PORT, as ray_start_head.sh prints it
# (not the dashboard's http:// one; default $RAY_ADDRESS). This machine must be a node of
# the cluster (any node: the head, or one started with ray_start_worker.sh; Ray attaches a driver to a local raylet)
# and hold the cluster's token (as for ray_start_worker.sh); CONFIG and its relative paths are read from the current
# directory. The controller itself asks Ray for no CPU or GPU: its pools go wherever the config places them. Job mode's
# --no-wait, --working-dir and --submission-id do not apply and are refused; for a run that outlives this shell use
# nohup, tmux or screen. launch/slurm_ray.sbatch starts its controller the same way.
set -euo pipefail
RAY="${RAY:-ray}"
MEGARL="${MEGARL:-megarl}"
ADDRESS=""
DRIVER=0
DRY=0
SUBMIT=()
TRAIN=()
FLAGS=()
JOB_ONLY=()
value() {  # the value of option $1 (the next argument, $2): present and not another option
  if [ $# -lt 2 ] || [ -z "$2" ] || [[ "$2" == --* ]]; then
    echo "ray_submit.sh: $1 needs a value (see --help)" >&2
    exit 2
  fi
}
while [ $# -gt 0 ]; do
  case "$1" in
    --address) value "$@"; ADDRESS="$2"; shift 2 ;;
    --address=*) ADDRESS="${1#--address=}"; shift ;;
    --driver) DRIVER=1; shift ;;
    --working-dir) value "$@"; SUBMIT+=(--working-dir "$2"); JOB_ONLY+=("$1"); shift 2 ;;
    --no-wait) SUBMIT+=(--no-wait); JOB_ONLY+=("$1"); shift ;;
    --submission-id) value "$@"; SUBMIT+=(--submission-id "$2"); JOB_ONLY+=("$1"); shift 2 ;;
    --verbose) FLAGS+=(--verbose); shift ;;  # megarl train's own: the vendors' logs too
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '/^set -euo/q;2,$p' "$0"; exit 0 ;;
    -*) echo "ray_submit.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
    *) TRAIN+=("$1"); shift ;;
  esac
done
if [ ${#TRAIN[@]} -eq 0 ]; then
  echo "ray_submit.sh: CONFIG is required, e.g. bash launch/ray_submit.sh yaml_configs/cpu_quickstart.yaml" >&2
  exit 2
fi
if [ "$DRY" = 0 ] && [ ! -f "${TRAIN[0]}" ]; then
  echo "ray_submit.sh: config '${TRAIN[0]}' not found (from $(pwd))" >&2
  exit 2
fi
for arg in "${TRAIN[@]:1}"; do
  if [[ "$arg" != *=* ]]; then
    echo "ray_submit.sh: '$arg' after CONFIG is not a key=value override (e.g. trainer.total_steps=10)" >&2
    exit 2
  fi
done
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
ARGS="${TRAIN[*]}${FLAGS[*]:+ ${FLAGS[*]}}"  # what `megarl train` gets, as shown in messages

if [ "$DRIVER" = 1 ]; then
  if [ ${#JOB_ONLY[@]} -gt 0 ]; then
    echo "ray_submit.sh: ${JOB_ONLY[*]}: only for Ray jobs (job mode); --driver runs the controller in this shell" \
         "(for a run that outlives it: nohup, tmux or screen)" >&2
    exit 2
  fi
  [ -n "$ADDRESS" ] || ADDRESS="${RAY_ADDRESS:-}"
  if [ -z "$ADDRESS" ]; then
    echo "ray_submit.sh: --driver needs the head's GCS address: --address HEAD_IP:PORT (ray_start_head.sh prints it" \
         "as 'workers join with: ... --address HEAD_IP:PORT') or RAY_ADDRESS=HEAD_IP:PORT" >&2
    exit 2
  fi
  if [[ "$ADDRESS" == *://* ]]; then
    echo "ray_submit.sh: --driver attaches to the head's GCS, HEAD_IP:PORT (e.g. 10.0.0.1:6379, as ray_start_head.sh" \
         "prints it), not to a URL like '$ADDRESS' (the dashboard's, for job mode)" >&2
    exit 2
  fi
  if ! [[ "$ADDRESS" =~ ^[^:/[:space:]]+:[0-9]+$ ]]; then
    echo "ray_submit.sh: --driver: '$ADDRESS' is not HEAD_IP:PORT (e.g. 10.0.0.1:6379)" >&2
    exit 2
  fi
  if [ "$DRY" = 1 ]; then
    echo "RAY_AUTH_MODE=$RAY_AUTH_MODE RAY_ADDRESS=$ADDRESS $MEGARL train $ARGS"
    exit 0
  fi
  TOKEN_FILE="${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}"
  if [ "$RAY_AUTH_MODE" = token ] && [ -z "${RAY_AUTH_TOKEN:-}" ] && [ ! -s "$TOKEN_FILE" ]; then
    echo "ray_submit.sh: no Ray auth token for the cluster: copy the head's token to $TOKEN_FILE or export" \
         "RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH)" >&2
    exit 2
  fi
  command -v "$MEGARL" >/dev/null \
    || { echo "ray_submit.sh: '$MEGARL' not found; activate megarl's venv (launch/install_cpu.sh)" >&2; exit 2; }
  echo "[ray_submit] driver mode: the controller runs here ($(hostname)), attached to the cluster at $ADDRESS:" \
       "$MEGARL train $ARGS" >&2
  export RAY_ADDRESS="$ADDRESS"
  exec "$MEGARL" train "${TRAIN[@]}" "${FLAGS[@]}"
fi

ADDRESS="${ADDRESS:-${RAY_ADDRESS:-http://127.0.0.1:8265}}"
CMD=("$RAY" job submit --address "$ADDRESS" "${SUBMIT[@]}" -- megarl train "${TRAIN[@]}" "${FLAGS[@]}")
if [ "$DRY" = 1 ]; then
  echo "RAY_AUTH_MODE=$RAY_AUTH_MODE ${CMD[*]}"
  exit 0
fi
command -v "$RAY" >/dev/null \
  || { echo "ray_submit.sh: '$RAY' not found; activate megarl's venv (launch/install_cpu.sh)" >&2; exit 2; }
PY="${PYTHON:-python}"
if MISSING="$("$PY" -c 'import ray._private.utils as u; print(u.get_dashboard_dependency_error() or "")' 2>/dev/null)" \
   && [ -n "$MISSING" ]; then
  echo "ray_submit.sh: this Ray install has no job server ($MISSING): install ray[default] on the head" \
       "(pip install 'ray[default]==2.60.0') and restart it, or run the controller on a node of the cluster with" \
       "--driver: bash launch/ray_submit.sh --driver --address HEAD_IP:PORT $ARGS" >&2
  exit 2
fi
"${CMD[@]}"
