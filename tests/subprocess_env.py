"""The environment of every `megarl train` subprocess a test starts (e2e runs, trainer-through-the-CLI tests)."""

from __future__ import annotations

import os
from typing import Optional

# Variables that the caller's shell may have set and that change what a training run does: thread counts, vLLM
# switches, torch.distributed rendezvous, CUDA visibility, preloaded libraries. None of them reaches a run.
_DROPPED_PREFIXES = ("OMP_", "MKL_", "KMP_", "VLLM_", "TORCH_", "TORCHINDUCTOR_", "NCCL_", "GLOO_", "RAY_", "CUDA_",
                     "PYTORCH_", "MEGARL_", "WANDB_")
_DROPPED = {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PYTHONHASHSEED",
            "LD_PRELOAD", "PYTEST_CURRENT_TEST", "TRANSFORMERS_VERBOSITY", "MPLBACKEND"}

_BASE: Optional[dict[str, str]] = None


def freeze_base_environment() -> None:
    """Record the environment subprocesses start from (tests/conftest.py calls it once, before any test module is
    imported): what earlier tests or imported libraries put into `os.environ` later never reaches them."""
    global _BASE
    if _BASE is None:
        _BASE = dict(os.environ)


def clean_env() -> dict[str, str]:
    """The environment of every training subprocess here: the suite's starting environment (the caller's when no
    suite froze one), minus every variable above, plus an explicit OMP_NUM_THREADS=1 (what tests/conftest.py gives
    the suite), so `pytest tests/e2e` and the full suite run the same thing whatever ran before."""
    base = _BASE if _BASE is not None else dict(os.environ)
    env = {k: v for k, v in base.items() if not k.startswith(_DROPPED_PREFIXES) and k not in _DROPPED}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env
