"""Collective helpers shared by the vocab-parallel log-prob and entropy functions.

The logits of a tensor-parallel output layer are split along the vocabulary: TP rank r holds columns
``[vocab_start_r, vocab_start_r + V/tp)``. Reductions over the vocabulary become a local reduction followed by
an all-reduce over the TP group; full-vocabulary logits are never gathered.

``group=None`` means the default process group; if torch.distributed is not initialised at all, the local
shard is taken to be the whole vocabulary (a TP group of one), so the same code runs without a process group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group) -> torch.Tensor:
    """In-place all-reduce over ``group``; returns ``tensor``. A no-op without an initialised process group and over
    a group of one rank (TP 1: the sum, max... of one shard is itself, and a collective over one rank still costs a
    call into the backend, several per micro-batch)."""
    if (group is not None or dist.is_initialized()) and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def shifted_logits(logits_shard: torch.Tensor, group) -> torch.Tensor:
    """``logits - max over the full vocabulary`` ([..., V/tp] float32), the usual overflow guard."""
    logits = logits_shard.float()
    vocab_max = all_reduce(logits.detach().amax(dim=-1), dist.ReduceOp.MAX, group)
    return logits - vocab_max.unsqueeze(-1)
