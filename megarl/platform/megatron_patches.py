"""Fixes for megatron-core behaviour that breaks megarl's per-role process groups, on every device.

(CPU-only redirects live in `megatron_cpu_compat`.) Each fix names the megatron-core version and code it serves and
is applied as narrowly as possible: a context manager around the one call that needs it.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch.distributed as dist


@contextlib.contextmanager
def default_group_collectives(group: Optional[dist.ProcessGroup]) -> Iterator[None]:
    """Make group-less `get_world_size` / `all_gather_object` calls use `group` inside this scope.

    megatron-core 0.16.1 `optimizer/__init__.py:_get_param_groups` aligns parameter-group keys with
    `torch.distributed.all_gather_object(...)` over the *whole world*. A role that does not span the world (a critic
    on its own pool, two roles built side by side) then deadlocks: ranks outside the role never join. Wrapping
    `get_megatron_optimizer` in this scope makes that gather run over the role's own ranks, which is what the
    alignment is for (every rank of one optimizer agreeing on its groups).
    """
    if group is None:
        yield
        return
    orig_world_size = dist.get_world_size
    orig_all_gather_object = dist.all_gather_object

    def world_size(group_=None):
        return orig_world_size(group if group_ is None else group_)

    def all_gather_object(object_list, obj, group_=None, **kwargs):
        return orig_all_gather_object(object_list, obj, group=group if group_ is None else group_, **kwargs)

    dist.get_world_size = world_size
    dist.all_gather_object = all_gather_object
    try:
        yield
    finally:
        dist.get_world_size = orig_world_size
        dist.all_gather_object = orig_all_gather_object


def define_moe_router_gemm_without_te() -> None:
    """Let megatron-core's MoE router run without Transformer Engine (CPU machines, CUDA without TE).

    megatron-core 0.16.1 `transformer/moe/moe_utils.py` imports `te_general_gemm` only inside `try: ... except
    ImportError` and never defines it otherwise, yet `RouterGatingLinearFunction.forward/backward` test
    `te_general_gemm is not None` first: without TE every router forward raises
    "NameError: name 'te_general_gemm' is not defined". Defining it as None selects the torch.mm path that
    megatron has for exactly this case. Idempotent; leaves a TE import alone.
    """
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


class SequenceParallelTorchNorm:
    """megatron-core 0.16.1's `WrappedTorchNorm` (the local spec's norm: torch LayerNorm/RMSNorm) without its
    `assert not config.sequence_parallel`: the torch norm is per token, so it is correct on a sequence slice; its
    weight is marked `sequence_parallel` so `finalize_model_grads` sums its gradient over the TP group, as megatron
    does for Transformer Engine's norms. Needed because megatron's MoE layer refuses TP > 1 in training without
    sequence parallelism while the local spec refuses sequence parallelism."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        import torch

        norm_cls = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}.get(config.normalization)
        if norm_cls is None:
            raise ValueError(f"normalization {config.normalization!r}: only LayerNorm and RMSNorm are supported")
        norm = norm_cls(normalized_shape=hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm


def allow_sequence_parallel_torch_norms(spec):
    """Replace every `WrappedTorchNorm` in a megatron-core layer/block spec (nested ModuleSpecs and submodule
    dataclasses) by `SequenceParallelTorchNorm`, in place; returns `spec`."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def fix(value):
        if value is WrappedTorchNorm:
            return SequenceParallelTorchNorm
        if isinstance(value, ModuleSpec):
            value.module = fix(value.module)
            value.submodules = fix(value.submodules)
        elif isinstance(value, list):
            value[:] = [fix(v) for v in value]
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                setattr(value, f.name, fix(getattr(value, f.name)))
        return value

    return fix(spec)


def unbatched_p2p_for_two_stage_gloo_ring(config, pp_group) -> None:
    """Turn off `config.batch_p2p_comm` when the interleaved (VPP) schedule runs over a 2-rank gloo pipeline group.

    megatron-core 0.16.1 `p2p_communication._batched_p2p_ops` posts send_prev, recv_prev, send_next, recv_next on
    every rank. With pp=2 the previous and the next rank are the same peer, and the interleaved schedule's steady
    state (`send_forward_backward_recv_forward_backward`) sends an activation and a gradient to it at once: rank 0
    sends [gradient, activation] while rank 1 receives [activation, gradient], and gloo matches the messages of a
    peer pair in posting order. Equal shapes swap silently (wrong gradients), different shapes fail in backward
    ("Mismatch in shape: grad_output[0] ..."). The unbatched `_p2p_ops` orders sends and receives by even/odd rank,
    so both sides agree. NCCL runs keep the batched path."""
    import torch.distributed as dist

    if pp_group.size() == 2 and dist.get_backend(pp_group) == "gloo":
        config.batch_p2p_comm = False
