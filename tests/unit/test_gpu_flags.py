"""Flags that decide CUDA-only code paths, checked on CPU (issue 15 items 11, 12)."""

import os
import sys

import pytest

from megarl.models.gpt import fused_softmax_kernels_available


def test_fused_softmax_off_without_the_kernel_modules():
    # megatron-core's fused softmax imports this module when the flag is on; it is not installed here.
    with pytest.raises(ImportError):
        import scaled_masked_softmax_cuda  # noqa: F401
    assert fused_softmax_kernels_available(cuda=True) is False


def test_fused_softmax_on_with_cuda_and_the_kernel_modules(tmp_path, monkeypatch):
    for name in ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda", "scaled_softmax_cuda"):
        (tmp_path / f"{name}.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert fused_softmax_kernels_available(cuda=True) is True
    assert fused_softmax_kernels_available(cuda=False) is False
    (tmp_path / "scaled_softmax_cuda.py").unlink()
    sys.modules.pop("scaled_softmax_cuda", None)
    assert fused_softmax_kernels_available(cuda=True) is False


def test_enforce_eager_option():
    from megarl.config import load_config  # noqa: F401  (the option exists in the schema)
    from megarl.config.schema import RolloutConfig
    from megarl.rollout.vllm_adapter import resolve_enforce_eager

    assert RolloutConfig().enforce_eager == "auto"
    assert resolve_enforce_eager("auto", on_cpu=True) is True  # CPU behaviour unchanged (was always eager)
    assert resolve_enforce_eager("auto", on_cpu=False) is False  # CUDA graphs on GPU
    assert resolve_enforce_eager("true", on_cpu=False) is True
    assert resolve_enforce_eager("false", on_cpu=True) is False
    with pytest.raises(ValueError, match="rollout.enforce_eager must be auto, true or false, got 'yes'"):
        resolve_enforce_eager("yes", on_cpu=True)


def test_enforce_eager_from_the_command_line_and_yaml():
    """`rollout.enforce_eager=false` on the command line (YAML reads `false` as a bool) selects the text choice
    "false"; a bool never matches another Literal's choices."""
    from megarl.config import load_config
    from megarl.config.loader import coerce

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = load_config(os.path.join(root, "yaml_configs", "cpu_quickstart.yaml"), ["rollout.enforce_eager=false"])
    assert cfg.rollout.enforce_eager == "false"
    cfg = load_config(os.path.join(root, "yaml_configs", "cpu_quickstart.yaml"), ["rollout.enforce_eager=true"])
    assert cfg.rollout.enforce_eager == "true"
    from typing import Literal

    from megarl.config.errors import ConfigError

    with pytest.raises(ConfigError, match="expected one of 'a', 'b', got False"):
        coerce(Literal["a", "b"], False, "x.y")
