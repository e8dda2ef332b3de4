"""torch.distributed start-up (NCCL on GPU, gloo on CPU) and deterministic seeding."""

from __future__ import annotations

import datetime
import itertools
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


# Default bound of `named_barrier`, seconds: one rank's slow part of a collective step (rank 0 committing a
# checkpoint directory, writing the last shard of an HF export) while the others wait.
BARRIER_TIMEOUT_S = 1800.0
_barrier_numbers = itertools.count()  # the n-th named barrier of this process (the same n on every rank)


def named_barrier(what: str, timeout_s: float = BARRIER_TIMEOUT_S) -> None:
    """A barrier over the default world that names what it waited for and the ranks that did not arrive.

    On the default group's rendezvous store (the same on gloo and NCCL: `monitored_barrier` exists on gloo only):
    each rank adds itself under the barrier's key, the last to arrive marks it done, the others wait for that mark.
    Raises TimeoutError after `timeout_s` seconds naming `what`, the missing ranks and this rank. Every rank must
    call the same named barriers in the same order, like any collective. A world of one returns at once.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    key = f"megarl/barrier/{next(_barrier_numbers)}"
    store.set(f"{key}/rank{rank}", "1")
    if store.add(f"{key}/arrived", 1) == world:
        store.set(f"{key}/done", "1")
        return
    try:
        store.wait([f"{key}/done"], datetime.timedelta(seconds=timeout_s))
    except RuntimeError:  # torch's DistStoreError (a RuntimeError) on the timeout
        missing = [r for r in range(world) if not store.check([f"{key}/rank{r}"])]
        raise TimeoutError(f"rank {rank}: waited {timeout_s:g} s for {what}: rank(s) {missing} of {world} did not "
                           f"arrive (barrier {key})") from None


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
