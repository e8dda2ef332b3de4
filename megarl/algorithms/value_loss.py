"""The critic's clipped value loss (PPO, as in OpenAI's baselines / Ziegler et al.)."""

from __future__ import annotations

import torch

from megarl.algorithms.aggregate import Normalizer, aggregate
from megarl.algorithms.masked import masked_mean


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    clip: float = 0.2,
    agg: str = "token-mean",
    norm_horizon: int | None = None,
    global_normalizer: Normalizer = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss, per token::

        v_clip = clip(v, old - clip, old + clip)
        L = 0.5 * max((v - R)**2, (v_clip - R)**2)

    Args:
        values: [B, T] float, current critic values (with grad).
        old_values: [B, T] float, values from the critic that produced the rollout's advantages.
        returns: [B, T] float, value targets (e.g. ``gae(...)[1]``).
        response_mask: [B, T] 0/1.
        clip: half-width of the trust region around ``old_values``, in reward units (> 0).
        agg, norm_horizon, global_normalizer: see ``megarl.algorithms.aggregate.aggregate``.

    Returns:
        loss: 0-dim tensor.
        metrics: 0-dim detached tensors: ``value_clip_frac`` (masked fraction of tokens where the clipped
            term is strictly larger, i.e. the one in use, with zero gradient) and ``value_mean``.
    """
    if not (values.shape == old_values.shape == returns.shape == response_mask.shape):
        raise ValueError(
            f"shapes must match: values {tuple(values.shape)}, old_values {tuple(old_values.shape)}, "
            f"returns {tuple(returns.shape)}, response_mask {tuple(response_mask.shape)}"
        )
    if clip <= 0:
        raise ValueError(f"value clip must be > 0, got {clip}")
    v_clip = old_values + (values - old_values).clamp(-clip, clip)
    unclipped = (values - returns).square()
    clipped = (v_clip - returns).square()
    clip_active = clipped > unclipped
    loss_mat = 0.5 * torch.where(clip_active, clipped, unclipped)
    loss = aggregate(loss_mat, response_mask, agg, norm_horizon=norm_horizon, global_normalizer=global_normalizer)
    metrics = {
        "value_clip_frac": masked_mean(clip_active.float(), response_mask),
        "value_mean": masked_mean(values.detach(), response_mask),
    }
    return loss, metrics
