"""Reduce a per-token loss matrix ``[batch, response_len]`` to a scalar, in one of several registered modes.

Modes (``aggregate(loss_mat, response_mask, mode)``):

- ``token-mean``: sum over all valid tokens / number of valid tokens. Every token weighs the same, so long
  responses weigh more (DAPO's choice).
- ``seq-mean-token-sum``: per sequence, sum over its valid tokens; then mean over sequences.
- ``seq-mean-token-mean``: per sequence, mean over its valid tokens; then mean over sequences (the original
  GRPO/PPO-for-LLMs choice; every sequence weighs the same).
- ``seq-mean-token-sum-norm``: per sequence, sum over its valid tokens / ``norm_horizon`` (a fixed number of
  tokens, e.g. the maximum response length, as in Dr. GRPO); then mean over sequences. No length bias.

"Valid tokens" are those where ``response_mask`` (the loss mask) is 1, wherever they sit: a multi-turn row's tool
tokens (0) between sampled spans count in no sum and no normaliser, and a sequence's length is its number of
sampled tokens, not the span from its first to its last one. "Sequences" are those with at least one valid token;
an all-masked row is not counted. An all-masked input
gives a loss of 0 (not nan), which still carries a (zero) gradient.

Distributed training. A mini-batch is split into micro-batches and over data-parallel ranks, and the mean of
per-micro-batch means is not the mini-batch mean when micro-batches hold different numbers of tokens (or
sequences). Pass ``global_normalizer`` = the number of valid tokens (for ``token-mean``) or of sequences with at
least one valid token (for the ``seq-mean-*`` modes) in the *whole* mini-batch, over all micro-batches and DP
ranks. The function then returns this micro-batch's share: the sum of the results over all micro-batches and
DP ranks is exactly the global mean. Gradients accumulated over micro-batches add up, as they should; but
Megatron's DDP *averages* gradients over the DP group, so multiply the loss by the DP world size (or turn off
DDP's averaging) to keep the exact global mean. Without ``global_normalizer`` the local count is used.
"""

from __future__ import annotations

import torch

from megarl.algorithms.masked import masked_sum
from megarl.algorithms.registry import AGGREGATIONS, get_aggregation, register_aggregation

Normalizer = float | int | torch.Tensor | None


def _denominator(local_count: torch.Tensor, global_normalizer: Normalizer) -> torch.Tensor:
    if global_normalizer is None:
        return local_count.clamp(min=1)
    if isinstance(global_normalizer, torch.Tensor):
        return global_normalizer.to(local_count.dtype).clamp(min=1)
    if global_normalizer <= 0:
        raise ValueError(f"global_normalizer must be positive, got {global_normalizer}")
    return torch.as_tensor(float(global_normalizer), dtype=local_count.dtype, device=local_count.device)


def _seq_mean(per_seq: torch.Tensor, mask: torch.Tensor, global_normalizer: Normalizer) -> torch.Tensor:
    has_tokens = mask.sum(-1) > 0
    count = has_tokens.to(per_seq.dtype).sum()
    return masked_sum(per_seq, has_tokens) / _denominator(count, global_normalizer)


@register_aggregation("token-mean")
def token_mean(loss_mat, response_mask, norm_horizon=None, global_normalizer=None):
    """Sum over valid tokens / number of valid tokens (or ``global_normalizer``)."""
    count = response_mask.to(loss_mat.dtype).sum()
    return masked_sum(loss_mat, response_mask) / _denominator(count, global_normalizer)


@register_aggregation("seq-mean-token-sum")
def seq_mean_token_sum(loss_mat, response_mask, norm_horizon=None, global_normalizer=None):
    """Per-sequence token sum, mean over sequences (or / ``global_normalizer`` sequences)."""
    return _seq_mean(masked_sum(loss_mat, response_mask, dim=-1), response_mask, global_normalizer)


@register_aggregation("seq-mean-token-mean")
def seq_mean_token_mean(loss_mat, response_mask, norm_horizon=None, global_normalizer=None):
    """Per-sequence token mean, mean over sequences (or / ``global_normalizer`` sequences)."""
    lengths = response_mask.to(loss_mat.dtype).sum(-1).clamp(min=1)
    per_seq = masked_sum(loss_mat, response_mask, dim=-1) / lengths
    return _seq_mean(per_seq, response_mask, global_normalizer)


@register_aggregation("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(loss_mat, response_mask, norm_horizon=None, global_normalizer=None):
    """Per-sequence token sum / ``norm_horizon`` tokens, mean over sequences (or / ``global_normalizer``)."""
    if norm_horizon is None or norm_horizon <= 0:
        raise ValueError(
            f"aggregation 'seq-mean-token-sum-norm' needs a positive norm_horizon (tokens, e.g. the maximum "
            f"response length), got {norm_horizon!r}"
        )
    per_seq = masked_sum(loss_mat, response_mask, dim=-1) / float(norm_horizon)
    return _seq_mean(per_seq, response_mask, global_normalizer)


def aggregate(
    loss_mat: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str = "token-mean",
    norm_horizon: int | None = None,
    global_normalizer: Normalizer = None,
) -> torch.Tensor:
    """Reduce ``loss_mat`` [batch, response_len] to a 0-dim tensor (same dtype) under ``response_mask``.

    Args:
        loss_mat: [batch, response_len] per-token loss; values at masked positions are ignored.
        response_mask: [batch, response_len] 0/1 (any dtype); 1 marks a response token that counts.
        mode: one of ``aggregation_modes()``; an unknown mode raises ``UnknownNameError`` listing them.
        norm_horizon: tokens; required by ``seq-mean-token-sum-norm`` only.
        global_normalizer: valid tokens (``token-mean``) or sequences (``seq-mean-*``) in the whole mini-batch
            across micro-batches and DP ranks; see the module docstring. ``None`` uses the local count.
    """
    fn = get_aggregation(mode)
    return fn(loss_mat, response_mask, norm_horizon=norm_horizon, global_normalizer=global_normalizer)


def aggregation_modes() -> list[str]:
    """The registered aggregation mode names."""
    return AGGREGATIONS.names()
