"""Vendor log noise: the ONE place that quiets (or lets through) what vLLM, Ray, megatron-core, torch, Triton and
transformers print, in the controller (driver) and in every worker process.

`logging.vendor_level` (config; `megarl train --verbose` sets it to `info`) picks how much gets through:

  error    (default) vendor loggers at ERROR, their Python warnings ignored (megatron-core's "Apex/TE not installed"
           on CPU, torch's deprecations, vLLM's Triton notices), torch's C++ warnings off. Errors and tracebacks
           always come through.
  warning  vendor loggers at WARNING; Python warnings shown (Python's default filters).
  info     the vendors' own defaults, untouched: what they print without megarl (`megarl train --verbose`).
  debug    vendor loggers (and vLLM, transformers, torch C++) at DEBUG / INFO: much more than their defaults.

Two halves, because a worker process must be quiet before it imports anything:
  - `vendor_env(level)`: environment variables read by the vendors at import time (VLLM_LOGGING_LEVEL,
    TRANSFORMERS_VERBOSITY, TORCH_CPP_LOG_LEVEL) plus MEGARL_VENDOR_LEVEL. The controller passes them in every
    worker group's environment (`megarl.trainer.session`), so processes the workers spawn inherit them.
  - `quiet_vendors(level)`: in-process logger levels and warning filters; called by the controller and, with
    MEGARL_VENDOR_LEVEL, by each worker host on start (`megarl.controller.worker_group`). Idempotent.

Ray's own driver logs are set by `ray_init_kwargs` (ray.init's `logging_level`); worker stdout/stderr still reach the
driver through Ray (`log_to_driver`), so whatever is not silenced at its source stays visible.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

VENDOR_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_VENDOR_LEVEL = "error"
LEVEL_ENV = "MEGARL_VENDOR_LEVEL"

# Top-level packages whose loggers and Python warnings are "vendor" output.
VENDOR_PACKAGES = ("vllm", "ray", "megatron", "torch", "transformers", "triton", "tensorboard", "urllib3",
                   "filelock", "huggingface_hub", "safetensors", "numba", "wandb", "matplotlib", "PIL",
                   # the HTTP clients of an `agent:` environment's agents (the openai client logs every request at
                   # INFO through httpx / httpx2: 128 lines a step in yaml_configs/cpu_agent_quickstart.yaml)
                   "openai", "httpx", "httpx2", "httpcore")

# Vendor warnings attributed (by their stacklevel) to our own modules, matched by message: torch's non-leaf .grad
# warning raised inside megatron-core's code that `megarl.platform.megatron_cpu_compat` wraps.
VENDOR_WARNING_MESSAGES = (r"The \.grad attribute of a Tensor that is not a leaf Tensor",)

_TORCH_CPP = {"debug": "INFO", "info": "INFO", "warning": "WARNING", "error": "ERROR"}


def check_level(level: str) -> str:
    if level not in VENDOR_LEVELS:
        raise ValueError(f"vendor log level {level!r} is not one of {VENDOR_LEVELS}")
    return level


def vendor_env(level: str) -> dict[str, str]:
    """Environment variables that set the vendors' verbosity at import time (for worker processes); at `info` only
    the level itself (the vendors keep their defaults)."""
    check_level(level)
    if level == "info":
        return {LEVEL_ENV: level}
    return {
        LEVEL_ENV: level,
        "VLLM_LOGGING_LEVEL": level.upper(),
        "TRANSFORMERS_VERBOSITY": level,
        "TORCH_CPP_LOG_LEVEL": _TORCH_CPP[level],
    }


def quiet_vendors(level: str = DEFAULT_VENDOR_LEVEL) -> None:
    """Apply `level` in this process: environment (for vendors not imported yet and child processes), vendor
    logger levels (for those already imported), and warning filters (level `error` only). `info` changes nothing."""
    os.environ.update(vendor_env(level))
    if level == "info":
        return
    py_level = getattr(logging, level.upper())
    for name in VENDOR_PACKAGES:
        logging.getLogger(name).setLevel(py_level)
    if "transformers" in sys.modules:  # transformers keeps its own verbosity besides the logger level
        try:
            sys.modules["transformers"].logging.set_verbosity(py_level)
        except AttributeError:
            pass
    if level != "error":
        return
    for package in VENDOR_PACKAGES:
        warnings.filterwarnings("ignore", module=rf"{package}(\.|$)")
    for message in VENDOR_WARNING_MESSAGES:
        warnings.filterwarnings("ignore", message=message)


def quiet_from_env() -> None:
    """In a worker process: apply the level the controller put in MEGARL_VENDOR_LEVEL (nothing when unset)."""
    level = os.environ.get(LEVEL_ENV)
    if level in VENDOR_LEVELS:
        quiet_vendors(level)


def ray_init_kwargs(level: str) -> dict:
    """`ray.init` keywords for the driver's Ray logger ("Started a local Ray instance", token-auth notices)."""
    return {"logging_level": getattr(logging, check_level(level).upper())}
