"""Policy-gradient losses: PPO's clipped surrogate (with asymmetric and dual clipping), GSPO and CISPO.

All are registered (``get_policy_loss("ppo")``, ``"gspo"``, ``"cispo"``) with the same call shape::

    loss, metrics = fn(log_probs, old_log_probs, advantages, response_mask, clip_low=..., clip_high=...,
                       clip_c=None, agg=..., norm_horizon=None, global_normalizer=None, weights=None)

Inputs are [batch, response_len]: ``log_probs`` (float, with grad) are the current policy's log-probs of the
sampled tokens, ``old_log_probs`` those of the policy that sampled them (no grad needed), ``advantages`` are
per token, ``response_mask`` is the 0/1 loss mask (1 on sampled tokens; may have gaps, see ``megarl.algorithms``:
every term and metric below is over its 1s only). ``agg``, ``norm_horizon`` and ``global_normalizer`` are passed to
``megarl.algorithms.aggregate.aggregate``. ``weights`` ([batch, response_len], detached, or None) multiplies
each token's loss before aggregation: the rollout-correction importance weights of
``megarl.algorithms.rollout_correction`` (None = all 1, the loss unchanged).

``loss`` is a 0-dim tensor to minimise. ``metrics`` maps names to **0-dim detached tensors** (no host sync is
forced inside the loss; call ``.item()`` when logging), all masked means over this micro-batch's valid tokens:

- ``clip_frac``: fraction of tokens where the clipped branch is active (strictly worse than the unclipped one)
- ``dual_clip_frac``: fraction of tokens where the dual clip (``clip_c``) caps the loss (0 without ``clip_c``)
- ``approx_kl``: mean of ``old_log_probs - log_probs`` (k1 estimate of KL(old || new), nats per token)
- ``approx_kl_k3``: mean of ``(r - 1) - log r`` with ``r = exp(log_probs - old_log_probs)`` (k3, >= 0)
- ``ratio_mean``: mean importance ratio (per token for PPO; per sequence, over sequences, for GSPO)
"""

from __future__ import annotations

import torch

from megarl.algorithms.aggregate import Normalizer, aggregate
from megarl.algorithms.masked import masked_mean
from megarl.algorithms.registry import POLICY_LOSSES, register_policy_loss

# log-ratios are clamped to [-20, 20] before exp() so that a stale or corrupted log-prob cannot produce inf/nan;
# exp(20) ~ 4.9e8 is far outside any clip range, and a clamped token gets no gradient (as a clipped one would).
LOG_RATIO_CLAMP = 20.0


def _check_shapes(log_probs, old_log_probs, advantages, response_mask) -> None:
    if not (log_probs.shape == old_log_probs.shape == advantages.shape == response_mask.shape):
        raise ValueError(
            f"shapes must match: log_probs {tuple(log_probs.shape)}, old_log_probs {tuple(old_log_probs.shape)}, "
            f"advantages {tuple(advantages.shape)}, response_mask {tuple(response_mask.shape)}"
        )


def _check_clip(clip_low: float, clip_high: float) -> None:
    if not (0 <= clip_low < 1) or clip_high < 0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got clip_low={clip_low}, clip_high={clip_high}")


def _clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float):
    """PPO's ``max(-A*r, -A*clip(r))`` per token and where the clipped branch is (strictly) active.

    Ties take the unclipped branch, so a ratio exactly on a clip edge keeps its gradient.
    """
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    clip_active = clipped > unclipped
    return torch.where(clip_active, clipped, unclipped), clip_active


def _weighted(loss_mat: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """Per-token loss times the (detached) importance weights; None leaves the loss untouched."""
    if weights is None:
        return loss_mat
    if weights.shape != loss_mat.shape:
        raise ValueError(f"weights {tuple(weights.shape)} must have the loss's shape {tuple(loss_mat.shape)}")
    return loss_mat * weights.detach().to(loss_mat.dtype)


def _kl_metrics(log_ratio: torch.Tensor, response_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    log_ratio = log_ratio.detach()
    k3 = torch.expm1(log_ratio) - log_ratio
    return {
        "approx_kl": masked_mean(-log_ratio, response_mask),
        "approx_kl_k3": masked_mean(k3, response_mask),
    }


@register_policy_loss("ppo", "vanilla")
def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_c: float | None = None,
    agg: str = "token-mean",
    norm_horizon: int | None = None,
    global_normalizer: Normalizer = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017) with asymmetric clip (DAPO's clip-higher) and dual clip.

    Per token, with ``r = exp(log_probs - old_log_probs)``::

        L = max(-A * r, -A * clip(r, 1 - clip_low, 1 + clip_high))
        if clip_c is not None and A < 0:  L = min(L, -A * clip_c)      # dual clip (Ye et al. 2020)

    The dual clip bounds the loss of a negative-advantage token whose ratio has exploded; it needs
    ``clip_c > 1``. Clipped branches carry no gradient. Returns ``(aggregate(L, response_mask, agg), metrics)``;
    see the module docstring for the metrics (0-dim detached tensors).
    """
    _check_shapes(log_probs, old_log_probs, advantages, response_mask)
    _check_clip(clip_low, clip_high)
    if clip_c is not None and clip_c <= 1.0:
        raise ValueError(f"dual-clip constant clip_c must be > 1, got {clip_c}")
    log_ratio = (log_probs - old_log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    loss_mat, clip_active = _clipped_surrogate(ratio, advantages, clip_low, clip_high)
    dual_active = torch.zeros_like(clip_active)
    if clip_c is not None:
        capped = -advantages * clip_c
        dual_active = (advantages < 0) & (capped < loss_mat)
        loss_mat = torch.where(dual_active, capped, loss_mat)
    loss_mat = _weighted(loss_mat, weights)
    loss = aggregate(loss_mat, response_mask, agg, norm_horizon=norm_horizon, global_normalizer=global_normalizer)
    metrics = {
        "clip_frac": masked_mean(clip_active.float(), response_mask),
        "dual_clip_frac": masked_mean(dual_active.float(), response_mask),
        **_kl_metrics(log_ratio, response_mask),
        "ratio_mean": masked_mean(ratio.detach(), response_mask),
    }
    return loss, metrics


@register_policy_loss("gspo")
def gspo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    clip_c: float | None = None,
    agg: str = "seq-mean-token-mean",
    norm_horizon: int | None = None,
    global_normalizer: Normalizer = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025): PPO clipping on a *sequence-level* importance ratio.

    ``s_i = exp(mean over i's valid tokens of (log_probs - old_log_probs))`` (the length-normalised sequence
    likelihood ratio). Per token it is used in the paper's token form ("GSPO-token")::

        s_it = sg(s_i) * exp(log_probs_t - sg(log_probs_t))        # value s_i, d s_it / d log_probs_t = s_i
        L_t  = max(-A_t * s_it, -A_t * clip(s_it, 1 - clip_low, 1 + clip_high))

    aggregated with ``agg`` (default ``seq-mean-token-mean``). With a per-sequence advantage this has exactly
    the gradient of the sequence-level GSPO objective, ``-(1/B) sum_i s_i A_i / |y_i| sum_t grad log_probs_t``
    for unclipped sequences, and zero for clipped ones. GSPO's clip ranges are small (paper: 3e-4 / 4e-4),
    because ``s_i`` is a per-token geometric mean. ``clip_c`` (dual clip) is not defined for GSPO and must be
    None. The detached sequence log-ratio is clamped to [-20, 20]. ``ratio_mean`` is the mean of ``s_i`` over
    sequences with at least one valid token.
    """
    _check_shapes(log_probs, old_log_probs, advantages, response_mask)
    _check_clip(clip_low, clip_high)
    if clip_c is not None:
        raise ValueError(f"GSPO has no dual clip; clip_c must be None, got {clip_c}")
    log_ratio = log_probs - old_log_probs
    seq_log_ratio = masked_mean(log_ratio, response_mask, dim=-1).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    token_log_ratio = log_probs - log_probs.detach() + seq_log_ratio.unsqueeze(-1)
    seq_ratio_tok = torch.exp(token_log_ratio)
    loss_mat, clip_active = _clipped_surrogate(seq_ratio_tok, advantages, clip_low, clip_high)
    loss_mat = _weighted(loss_mat, weights)
    loss = aggregate(loss_mat, response_mask, agg, norm_horizon=norm_horizon, global_normalizer=global_normalizer)
    has_tokens = response_mask.bool().any(-1)
    metrics = {
        "clip_frac": masked_mean(clip_active.float(), response_mask),
        "dual_clip_frac": torch.zeros((), dtype=torch.float32, device=log_probs.device),
        **_kl_metrics(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), response_mask),
        "ratio_mean": masked_mean(torch.exp(seq_log_ratio), has_tokens),
    }
    return loss, metrics


@register_policy_loss("cispo")
def cispo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = 1.0,
    clip_high: float = 5.0,
    clip_c: float | None = None,
    agg: str = "token-mean",
    norm_horizon: int | None = None,
    global_normalizer: Normalizer = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, Chen et al. 2025): REINFORCE on every token, weighted by a clipped, stop-gradient ratio.

    Per token, with ``r = exp(log_probs - old_log_probs)``::

        w = sg(clip(r, 1 - clip_low, 1 + clip_high))
        L = -w * A * log_probs                       # d L / d log_probs = -w * A: no token loses its gradient

    Unlike PPO, a clipped token keeps its gradient (only its weight is capped), so rare tokens whose ratio
    moved far still learn. The paper sets no lower bound (``clip_low = 1``: ``1 - clip_low = 0``, the default) and
    tunes only ``clip_high``; 5.0 is SkyRL's example value, not a published constant. ``0 <= clip_low <= 1``.
    ``clip_c`` (dual clip) is not defined for CISPO and must be None. The log-ratio is clamped to [-20, 20]
    before exp(). ``clip_frac`` counts tokens whose weight was capped (``w != r``).
    """
    _check_shapes(log_probs, old_log_probs, advantages, response_mask)
    if not (0 <= clip_low <= 1) or clip_high < 0:
        raise ValueError(f"CISPO needs 0 <= clip_low <= 1 and clip_high >= 0, got clip_low={clip_low}, "
                         f"clip_high={clip_high}")
    if clip_c is not None:
        raise ValueError(f"CISPO has no dual clip; clip_c must be None, got {clip_c}")
    log_ratio = (log_probs.detach() - old_log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    w = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_mat = _weighted(-w * advantages * log_probs, weights)
    loss = aggregate(loss_mat, response_mask, agg, norm_horizon=norm_horizon, global_normalizer=global_normalizer)
    metrics = {
        "clip_frac": masked_mean((w != ratio).float(), response_mask),
        "dual_clip_frac": torch.zeros((), dtype=torch.float32, device=log_probs.device),
        **_kl_metrics(log_ratio, response_mask),
        "ratio_mean": masked_mean(ratio, response_mask),
    }
    return loss, metrics


def policy_loss_names() -> list[str]:
    """Registered policy-loss names (aliases included)."""
    return POLICY_LOSSES.names()
