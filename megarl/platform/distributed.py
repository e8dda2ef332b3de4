"""torch.distributed start-up (NCCL on GPU, gloo on CPU) and deterministic seeding."""

from __future__ import annotations

import datetime
import os
import random
import socket

import numpy as np
import torch
import torch.distributed as dist

from megarl.platform.device import device_kind, local_device


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> tuple[int, int]:
    """Initialise the default process group from torchrun-style env vars (RANK, WORLD_SIZE, MASTER_ADDR/PORT).

    Returns (rank, world_size). Idempotent. Backend defaults to 'nccl' with CUDA and 'gloo' without.
    A single process with no env vars becomes a world of one (handy for scripts and tests).
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    kind = device_kind()
    backend = backend or ("nccl" if kind == "cuda" else "gloo")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        if os.environ["WORLD_SIZE"] != "1":
            raise RuntimeError("MASTER_PORT is not set for a multi-rank job: launch with torchrun or set it")
        os.environ["MASTER_PORT"] = str(_free_port())
    if kind == "cuda":
        torch.cuda.set_device(local_device(kind))
    dist.init_process_group(
        backend=backend,
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return dist.get_rank(), dist.get_world_size()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and, when present, CUDA) with the same seed on every rank.

    Model-parallel RNG streams (megatron's tracker) are seeded by the role builder from this seed.
    """
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
