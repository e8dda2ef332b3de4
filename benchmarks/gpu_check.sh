#!/usr/bin/env bash
# One prepared GPU session (about 10 minutes on one H200): the gpu-marked tests and the GPU benchmarks, results
# written to benchmarks/results/ (or $OUT when set, e.g. by the device runner). Needs a CUDA torch, megatron-core,
# vllm (GPU build) and optionally transformer-engine: `pip install -e .[gpu,test]`.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu_check_device.txt"
python -m pytest -q -m gpu tests/gpu 2>&1 | tail -20 | tee "$OUT/gpu_check_tests.txt"
# refit of a 7B shape on one GPU: Megatron (TP1) -> vLLM (TP1), bf16
python benchmarks/reshard.py --model-shape 7b --dtype bf16 --into-vllm --repeats 3 \
  --json "$OUT/reshard_7b_tp1_infer1_refit_gpu_bf16.json" 2>&1 | tail -8
# actor update tokens/s and MFU for a ~1B Llama shape, bf16 (H200 dense bf16 peak ~989 TFLOP/s)
python benchmarks/train_step.py --arch llama --layers 16 --hidden 2048 --heads 16 --kv-heads 8 --head-dim 128 \
  --ffn 8192 --vocab 32000 --batch 16 --prompt-len 256 --response-len 768 --micro-batch-samples 4 --steps 3 \
  --dtype bf16 --peak-tflops 989 --no-baseline --tag gpu_1b 2>&1 | tail -8
