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


def allow_uneven_allgather_dispatch() -> None:
    """Let megatron-core's allgather token dispatcher take a different number of tokens on each rank of its TP*EP
    group. megatron-core 0.16.1 `MoEAllGatherTokenDispatcher.token_dispatch` all-gathers the routing map, probs and
    hidden states [tokens, ...] with equal-size collectives and `token_combine` reduce-scatters them back equally:
    written for fixed-length batches. megarl trims every micro-batch to its longest sequence, so EP ranks (different
    DP shares) hold different token counts and gloo aborts ("Received data size doesn't match expected size"), NCCL
    would hang or read garbage. The patched pair gathers the token counts first and, only when they differ, passes
    them as megatron's own `output_split_sizes` / `input_split_sizes` (the uneven collectives megatron's
    alltoall path uses; autograd through them is megatron's). Equal counts take megatron's code unchanged.
    Idempotent."""
    import torch
    from megatron.core.transformer.moe import token_dispatcher as td

    cls = td.MoEAllGatherTokenDispatcher
    if getattr(cls, "_megarl_uneven_tokens", False):
        return
    original_dispatch, original_combine = cls.token_dispatch, cls.token_combine

    def token_dispatch(self, hidden_states, probs):
        self._megarl_split_sizes = None
        if self.tp_size == 1 and self.ep_size == 1:
            return original_dispatch(self, hidden_states, probs)
        group = self.tp_ep_group
        count = torch.tensor([hidden_states.shape[0]], dtype=torch.int64, device=hidden_states.device)
        counts = torch.empty(group.size(), dtype=torch.int64, device=hidden_states.device)
        dist.all_gather_into_tensor(counts, count, group=group)
        sizes = counts.tolist()
        if len(set(sizes)) == 1:
            return original_dispatch(self, hidden_states, probs)
        self._megarl_split_sizes = sizes
        with torch.no_grad():
            self.routing_map = td.gather_from_sequence_parallel_region(
                self.routing_map, group=group, output_split_sizes=sizes)
        probs = td.gather_from_sequence_parallel_region(probs, group=group, output_split_sizes=sizes)
        hidden_states = td.gather_from_sequence_parallel_region(hidden_states, group=group, output_split_sizes=sizes)
        return hidden_states, probs

    def token_combine(self, hidden_states):
        sizes = getattr(self, "_megarl_split_sizes", None)
        if sizes is None:
            return original_combine(self, hidden_states)
        return td.reduce_scatter_to_sequence_parallel_region(
            hidden_states.to(self.local_probs.dtype), group=self.tp_ep_group, input_split_sizes=sizes,
        ).to(hidden_states.dtype)

    cls.token_dispatch, cls.token_combine = token_dispatch, token_combine
    cls._megarl_uneven_tokens = True


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


def mark_experts_for_expert_data_parallel(model) -> int:
    """Set `allreduce = False` on every routed-expert parameter of `model` (a GPTModel chunk, before DDP wraps it);
    returns how many were marked.

    megatron-core 0.16.1 (tensor_parallel/layers.py) marks an expert weight `allreduce = not (is_expert and
    expert_model_parallel_size > 1)`: at ep = 1 the routed experts count as dense parameters, so DDP reduces their
    gradients over the dense data-parallel group and the distributed optimizer shards and all-gathers them over it.
    That group is the expert-data-parallel one only when expert TP = TP. With ep = 1 and etp != tp (e.g. tp 1, dp 2,
    etp 2: each rank holds half of every expert) it mixes different expert slices: one AdamW step at lr 1e-3 moved
    expert weights by ~0.58 (measured). Marked, they go to megatron's expert buffers over `expt_dp`, as at ep > 1.
    Shared experts (`mlp.shared_experts.`) follow the dense TP and stay dense."""
    marked = 0
    for name, param in model.named_parameters():
        if ".mlp.experts." in f".{name}":
            param.allreduce = False
            marked += 1
    return marked


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
