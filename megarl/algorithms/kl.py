"""Per-token KL estimators between the policy and a reference policy, and their two uses in RL:
as a reward penalty (``apply_kl_penalty``, PPO-style) and as a loss term (``kl_loss``, GRPO-style).

Estimators of KL(pi || ref) from a sample of pi (Schulman, "Approximating KL divergence", 2020), with
``d = log_probs - ref_log_probs`` (nats per token):

| kind | value | notes |
|---|---|---|
| ``k1`` (alias ``kl``) | ``d`` | unbiased, high variance, can be negative |
| ``k2`` (alias ``mse``) | ``0.5 * d**2`` | biased, low variance, >= 0 |
| ``k3`` (alias ``low_var_kl``) | ``exp(-d) - (-d) - 1`` | unbiased, low variance, >= 0; clamped to [-10, 10] |
| ``abs`` | ``abs(d)`` | |

All keep the input shape and dtype and are differentiable (in ``log_probs``).
"""

from __future__ import annotations

import torch

from megarl.algorithms.aggregate import Normalizer, aggregate
from megarl.algorithms.masked import masked_mean, masked_sum
from megarl.algorithms.registry import KL_ESTIMATORS, get_kl, register_kl

K3_CLAMP = 10.0  # the k3 value is clamped to [-K3_CLAMP, K3_CLAMP] (nats)
_LOG_RATIO_CLAMP = 20.0  # the exponent in k3 is clamped so exp() cannot overflow to inf


@register_kl("k1", "kl")
def kl_k1(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """``logp - ref``."""
    return log_probs - ref_log_probs


@register_kl("k2", "mse")
def kl_k2(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """``0.5 * (logp - ref)**2``."""
    return 0.5 * (log_probs - ref_log_probs).square()


@register_kl("k3", "low_var_kl")
def kl_k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """``exp(ref - logp) - (ref - logp) - 1``, clamped to [-10, 10] (exponent clamped to [-20, 20] first)."""
    x = (ref_log_probs - log_probs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return (torch.exp(x) - x - 1).clamp(-K3_CLAMP, K3_CLAMP)


@register_kl("abs")
def kl_abs(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """``|logp - ref|``."""
    return (log_probs - ref_log_probs).abs()


def kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token KL estimate of ``kind`` (see the module table); same shape as the inputs, nats per token.

    Args: log_probs, ref_log_probs: [...] float, log-probabilities of the sampled tokens under the policy and
        the reference. kind: one of ``kl_kinds()``; unknown kinds raise ``UnknownNameError`` listing them.
    """
    return get_kl(kind)(log_probs, ref_log_probs)


def kl_kinds() -> list[str]:
    """Registered KL estimator names (aliases included)."""
    return KL_ESTIMATORS.names()


def kl_loss(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    kind: str = "low_var_kl",
    agg: str = "token-mean",
    norm_horizon: int | None = None,
    global_normalizer: Normalizer = None,
) -> torch.Tensor:
    """KL to the reference as a loss term: ``aggregate(kl(log_probs, ref_log_probs, kind), response_mask, agg)``.

    Args: log_probs [B, T] float (with grad); ref_log_probs [B, T] float; response_mask [B, T] 0/1;
        ``agg``/``norm_horizon``/``global_normalizer`` as in ``megarl.algorithms.aggregate.aggregate``.
    Returns: 0-dim tensor, nats per token (or per sequence for ``seq-mean-token-sum``). The caller multiplies
        it by its coefficient and adds it to the policy loss.
    """
    return aggregate(
        kl(log_probs, ref_log_probs, kind), response_mask, agg, norm_horizon=norm_horizon,
        global_normalizer=global_normalizer,
    )


@torch.no_grad()
def apply_kl_penalty(
    token_rewards: torch.Tensor,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    coef: float,
    kind: str = "k1",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL in the reward: ``token_rewards - coef * kl(log_probs, ref_log_probs, kind)`` on valid tokens.

    Args: token_rewards, log_probs, ref_log_probs: [B, T] float; response_mask [B, T] 0/1; coef: penalty
        coefficient (e.g. ``controller.value``); kind: KL estimator.
    Returns:
        rewards: [B, T], penalised rewards, 0 where masked.
        metrics: 0-dim detached tensors, means over sequences with at least one valid token:
            ``"kl"``: of each sequence's per-token mean KL (nats per token);
            ``"kl_seq_sum"``: of each sequence's summed KL (nats per sequence; Ziegler et al.'s quantity, the
            one to feed ``AdaptiveKLController.update`` when its ``target`` is a per-sequence KL);
            ``"kl_coef"``: the ``coef`` used.
    """
    if not (token_rewards.shape == log_probs.shape == ref_log_probs.shape == response_mask.shape):
        raise ValueError(
            f"shapes must match: token_rewards {tuple(token_rewards.shape)}, log_probs {tuple(log_probs.shape)}, "
            f"ref_log_probs {tuple(ref_log_probs.shape)}, response_mask {tuple(response_mask.shape)}"
        )
    per_token = kl(log_probs, ref_log_probs, kind)
    valid = response_mask.bool()
    rewards = torch.where(valid, token_rewards - coef * per_token, 0.0)
    has_tokens = valid.any(-1)
    metrics = {
        "kl": masked_mean(masked_mean(per_token, response_mask, dim=-1), has_tokens),
        "kl_seq_sum": masked_mean(masked_sum(per_token, response_mask, dim=-1), has_tokens),
        "kl_coef": torch.tensor(float(coef)),
    }
    return rewards, metrics
