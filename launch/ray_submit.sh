#!/usr/bin/env bash
# Submit `megarl train CONFIG [key=value ...]` as a Ray job to a running cluster (launch/ray_start_head.sh).
#
#   bash launch/ray_submit.sh yaml_configs/cpu_quickstart.yaml
#   bash launch/ray_submit.sh CONFIG trainer.total_steps=10 --address http://10.0.0.1:8265 --no-wait
#   bash launch/ray_submit.sh CONFIG --working-dir .      # upload this checkout instead of using the installed megarl
#   bash launch/ray_submit.sh CONFIG --dry-run            # print the command only
#
# --address: the head's dashboard (default $RAY_ADDRESS, else http://127.0.0.1:8265, i.e. run on the head node).
# By default megarl must be installed on every node (launch/install_cpu.sh); --working-dir DIR ships DIR instead.
# Without --working-dir the job runs in the directory ray_start_head.sh was started from (Ray's processes keep it):
# CONFIG and the relative paths in it are read there, so start the head from the checkout that holds them.
# The job's entrypoint runs on the head and is the single controller: it creates the pools and worker groups.
# --no-wait returns after submission; follow with `ray job logs --follow JOB_ID`, stop with `ray job stop JOB_ID`.
# Without --no-wait it streams the job's log (the controller's stdout and stderr) and exits 1 if the job failed.
# Ray jobs need ray[default] on the head (the dashboard's job server; launch/install_cpu.sh installs plain ray): the
# script stops with a message when this install lacks it. Without it, run the controller on the head node:
#   RAY_ADDRESS=HEAD_IP:PORT megarl train CONFIG [key=value ...]      (what launch/slurm_ray.sbatch does)
set -euo pipefail
RAY="${RAY:-ray}"
ADDRESS="${RAY_ADDRESS:-http://127.0.0.1:8265}"
DRY=0
SUBMIT=()
TRAIN=()
while [ $# -gt 0 ]; do
  case "$1" in
    --address) ADDRESS="$2"; shift 2 ;;
    --address=*) ADDRESS="${1#--address=}"; shift ;;
    --working-dir) SUBMIT+=(--working-dir "$2"); shift 2 ;;
    --no-wait) SUBMIT+=(--no-wait); shift ;;
    --submission-id) SUBMIT+=(--submission-id "$2"); shift 2 ;;
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
  echo "ray_submit.sh: config '${TRAIN[0]}' not found" >&2
  exit 2
fi
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
CMD=("$RAY" job submit --address "$ADDRESS" "${SUBMIT[@]}" -- megarl train "${TRAIN[@]}")
if [ "$DRY" = 1 ]; then
  echo "RAY_AUTH_MODE=$RAY_AUTH_MODE ${CMD[*]}"
  exit 0
fi
command -v "$RAY" >/dev/null || { echo "ray_submit.sh: '$RAY' not found; activate megarl's venv (launch/install_cpu.sh)" >&2; exit 2; }
# Ray jobs need the dashboard's HTTP server, which a plain `ray` install (what launch/install_cpu.sh installs) does not
# run: without ray[default] the head's dashboard starts in "minimal" mode and `ray job submit` can only fail with
# "Failed to connect to Ray". Say so before trying (this install stands for the head's when they were made alike).
PY="${PYTHON:-python}"
if MISSING="$("$PY" -c 'import ray._private.utils as u; print(u.get_dashboard_dependency_error() or "")' 2>/dev/null)" \
   && [ -n "$MISSING" ]; then
  echo "ray_submit.sh: this Ray install has no job server ($MISSING): install ray[default] on the head" \
       "(pip install 'ray[default]==2.60.0') and restart it, or run the controller on the head instead:" \
       "RAY_ADDRESS=HEAD_IP:PORT megarl train ${TRAIN[*]}" >&2
  exit 2
fi
"${CMD[@]}"
