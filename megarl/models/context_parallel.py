"""Context parallelism (CP) where Transformer Engine is absent: sequence chunking, differentiable gathers over the
role's CP group, and an all-gather core attention for megatron-core's local layer spec.

megatron-core 0.16.1 runs CP only through TE's attention (`DotProductAttention` asserts
`context_parallel_size == 1`). With TE on GPU megarl uses TE's; on CPU (and on GPUs without TE) the local spec's
core attention is replaced by `AllGatherContextParallelAttention`, the "all-gather KV" CP scheme megatron calls
`cp_comm_type="all_gather"`: each CP rank keeps its own queries and gathers the keys and values of the whole
sequence (memory O(S) per rank for K/V, O(S/cp) for everything else).

Sequence split (megatron-core's load-balanced one, `get_batch_on_this_cp_rank`): the sequence of length S (a
multiple of 2*cp) is cut into 2*cp chunks of S/(2*cp) tokens; CP rank r holds chunks r and 2*cp-1-r, in that
order, so every rank does the same share of causal attention work. megatron's rotary embedding slices its
position table the same way (`get_pos_emb_on_this_cp_rank`), so positions need no extra handling.

Data path of one forward at CP size c (b = micro-batch size, s = S/c tokens per rank):
  input_ids [b, S] -> `split_for_cp_rank` -> [b, s] -> GPTModel (attention gathers K/V [S, b, groups, head_dim])
  -> logits [b, s, V/tp] -> `gather_cp_sequence` -> [b, S, V/tp] on every CP rank -> the role's loss.
The loss is then computed identically on every CP rank; `gather_cp_sequence`'s backward keeps only this rank's
slice of the gradient (no sum), so each token's gradient enters the model exactly once across the CP group.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist


def cp_chunk_order(cp: int, rank: int) -> tuple[int, int]:
    """The two chunk indices (of 2*cp) CP rank `rank` holds, in the order it holds them."""
    return rank, 2 * cp - 1 - rank


def cp_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global positions [s] (int64) of the tokens CP rank `rank` holds of a sequence of `seq_len` tokens."""
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in cp_chunk_order(cp, rank)])


def split_for_cp_rank(t: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This CP rank's two chunks of `t` along `dim` (its length must be a multiple of 2*cp)."""
    size = t.shape[dim]
    if size % (2 * cp):
        raise ValueError(f"sequence length {size} is not a multiple of 2*cp = {2 * cp}")
    chunk = size // (2 * cp)
    first, second = cp_chunk_order(cp, rank)
    return torch.cat([t.narrow(dim, first * chunk, chunk), t.narrow(dim, second * chunk, chunk)], dim=dim)


def _to_global_order(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Per-rank tensors (rank order, each [.., 2 chunks, ..] along `dim`) -> the whole sequence in order."""
    cp = len(parts)
    chunks: list[Optional[torch.Tensor]] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        first, second = cp_chunk_order(cp, rank)
        a, b = part.chunk(2, dim=dim)
        chunks[first], chunks[second] = a, b
    return torch.cat(chunks, dim=dim)


def _all_gather(t: torch.Tensor, group) -> list[torch.Tensor]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


class _GatherSequence(torch.autograd.Function):
    """All-gather along `dim` into global order. Backward, `sum_grads=True` (keys and values: every rank's queries
    read every rank's keys, so a rank's K/V gradient is the sum of what all ranks send back): all-reduce, keep this
    rank's slice. `sum_grads=False` (logits: every CP rank computes the same loss on the gathered sequence, so each
    rank's gradient for a position is already the whole one): keep this rank's slice only.
    """

    @staticmethod
    def forward(ctx, t, group, dim, sum_grads):
        ctx.group, ctx.dim, ctx.sum_grads = group, dim, sum_grads
        return _to_global_order(_all_gather(t, group), dim)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if ctx.sum_grads:
            dist.all_reduce(grad, group=ctx.group)
        cp, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return split_for_cp_rank(grad, cp, rank, ctx.dim).contiguous(), None, None, None


def gather_cp_sequence(t: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """Per-rank output [.., s, ..] -> the whole sequence [.., S, ..] on every CP rank (see module docstring)."""
    return _GatherSequence.apply(t, group, dim, False)


def _core_attention_base():
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


class AllGatherContextParallelAttention(_core_attention_base()):
    """Causal core attention at CP > 1 for the local spec: local queries against the gathered keys and values.

    Same constructor and forward signature as megatron-core 0.16.1's `DotProductAttention` (it is placed in the
    layer spec's `core_attention` slot). In: query [s, b, heads/tp, d], key and value [s, b, groups/tp, d] for this
    rank's two chunks. Out: [s, b, heads/tp * d]. Softmax in float32, no dropout (RL fine-tuning runs without).
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None) -> None:
        super().__init__(config=config)
        if pg_collection is None or getattr(pg_collection, "cp", None) is None:
            raise ValueError("AllGatherContextParallelAttention needs the role's pg_collection with a cp group")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"context parallelism without Transformer Engine runs without attention dropout, "
                             f"got {dropout}")
        tp = pg_collection.tp.size()
        self.tp_group = pg_collection.tp  # MegatronModule.sharded_state_dict reads it (else megatron's global group)
        self.cp_group = pg_collection.cp
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("packed sequences / attention bias need Transformer Engine's attention")
        cp, rank = dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)
        s_local = query.shape[0]
        key = _GatherSequence.apply(key, self.cp_group, 0, True)  # [S, b, g, d]
        value = _GatherSequence.apply(value, self.cp_group, 0, True)
        if self.heads != self.groups:
            key = key.repeat_interleave(self.heads // self.groups, dim=2)
            value = value.repeat_interleave(self.heads // self.groups, dim=2)
        q_pos = cp_positions(s_local * cp, cp, rank, device=query.device)
        k_pos = torch.arange(key.shape[0], device=query.device)
        masked = k_pos.unsqueeze(0) > q_pos.unsqueeze(1)  # [s, S] True where the key is in the future
        # [b, h, s, d] x [b, h, d, S] -> [b, h, s, S]
        scores = torch.matmul(query.permute(1, 2, 0, 3), key.permute(1, 2, 3, 0)).float() * self.softmax_scale
        scores = scores.masked_fill(masked, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(value.dtype)
        context = torch.matmul(probs, value.permute(1, 2, 0, 3))  # [b, h, s, d]
        return context.permute(2, 0, 1, 3).reshape(s_local, query.shape[1], self.heads * self.head_dim)


def use_all_gather_cp_attention(layer_spec) -> None:
    """Put `AllGatherContextParallelAttention` into the core-attention slot of a local layer spec (a `ModuleSpec`)
    or of every layer of a decoder block spec (`layer_specs`, the per-layer specs MoE models use)."""
    layers = getattr(layer_spec, "layer_specs", None) or [layer_spec]
    for layer in layers:
        layer.submodules.self_attention.submodules.core_attention = AllGatherContextParallelAttention
