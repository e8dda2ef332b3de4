"""The environment of every `megarl train` subprocess a test starts (e2e runs, trainer-through-the-CLI tests)."""

from __future__ import annotations

import os

# Variables that earlier tests (or the caller's shell) may have set and that change what a training run does:
# thread counts, vLLM switches, torch.distributed rendezvous, CUDA visibility. None of them reaches a run.
_DROPPED_PREFIXES = ("OMP_", "MKL_", "KMP_", "VLLM_", "TORCH_", "NCCL_", "GLOO_", "RAY_", "CUDA_", "PYTORCH_")
_DROPPED = {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PYTHONHASHSEED"}


def clean_env() -> dict[str, str]:
    """The environment of every training subprocess here: the caller's, minus every variable above, plus an explicit
    OMP_NUM_THREADS=1 (what tests/conftest.py gives the suite), so `pytest tests/e2e` and the full suite run the
    same thing whatever ran before."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_DROPPED_PREFIXES) and k not in _DROPPED}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env
