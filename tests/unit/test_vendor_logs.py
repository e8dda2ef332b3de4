"""Vendor noise control (`megarl.platform.vendor_logs`): which warnings and loggers are silenced at each level.
The end-to-end check (a real `megarl train` with vLLM, Ray and megatron-core in the workers) is the first-screen
test in tests/e2e/test_quickstart.py."""

from __future__ import annotations

import logging
import os
import warnings

import pytest

from megarl.platform import vendor_logs


@pytest.fixture
def restore(monkeypatch):
    for key in vendor_logs.vendor_env("error"):
        monkeypatch.setenv(key, os.environ.get(key, ""))  # restored after the test
    levels = {name: logging.getLogger(name).level for name in vendor_logs.VENDOR_PACKAGES}
    with warnings.catch_warnings():
        yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def _shown(module: str, message: str = "Apex is not installed. Falling back to Torch Norm") -> bool:
    with warnings.catch_warnings(record=True) as seen:
        warnings.warn_explicit(message, UserWarning, filename=f"{module}.py", lineno=1, module=module)
    return bool(seen)


def test_error_level_silences_vendor_warnings_only(restore):
    warnings.simplefilter("always")
    vendor_logs.quiet_vendors("error")
    assert not _shown("megatron.core.models.backends")
    assert not _shown("vllm.triton_utils.dispatcher", "reduce_op is deprecated")
    assert not _shown("torch.distributed.c10d_logger")
    assert not _shown("megarl.platform.megatron_cpu_compat", "The .grad attribute of a Tensor that is not a leaf "
                      "Tensor is being accessed.")
    assert _shown("megarl.trainer.rl_trainer", "our own warning")
    assert _shown("megatronic")  # a package whose name only starts like a vendor's
    assert logging.getLogger("vllm").getEffectiveLevel() == logging.ERROR
    assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR" and os.environ["TORCH_CPP_LOG_LEVEL"] == "ERROR"


def test_info_level_leaves_the_vendors_defaults(restore):
    warnings.simplefilter("always")
    before = {name: logging.getLogger(name).level for name in vendor_logs.VENDOR_PACKAGES}
    vendor_logs.quiet_vendors("info")
    assert _shown("megatron.core.models.backends")
    assert {name: logging.getLogger(name).level for name in vendor_logs.VENDOR_PACKAGES} == before
    assert vendor_logs.vendor_env("info") == {vendor_logs.LEVEL_ENV: "info"}  # no VLLM_/TRANSFORMERS_/TORCH_ setting
    assert vendor_logs.vendor_env("warning")["VLLM_LOGGING_LEVEL"] == "WARNING"
    with pytest.raises(ValueError, match="'loud' is not one of"):
        vendor_logs.vendor_env("loud")


def test_worker_applies_the_controllers_level(restore, monkeypatch):
    warnings.simplefilter("always")
    monkeypatch.setenv(vendor_logs.LEVEL_ENV, "error")
    vendor_logs.quiet_from_env()
    assert not _shown("megatron.core.optimizer")
