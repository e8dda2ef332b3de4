"""Advantage estimators. Each returns ``(advantages, returns)``, both [batch, response_len], 0 where masked.

Registered by name (``get_advantage("grpo")``). Their inputs differ, so call them with keyword arguments:

| name | inputs | needs a critic |
|---|---|---|
| ``gae`` | token_rewards, values, response_mask, gamma, lam | yes |
| ``grpo`` | scores, group_ids, response_mask, norm_by_std, eps | no |
| ``rloo`` | scores, group_ids, response_mask | no |
| ``reinforce_plus_plus`` | token_rewards, response_mask, gamma | no |
| ``reinforce_plus_plus_baseline`` | scores, group_ids, response_mask | no |

For the critic-free estimators ``returns`` equals ``advantages`` (there is no value target to fit); it is
returned so that every estimator has the same output shape.

Conventions: ``token_rewards`` and ``values`` are [batch, response_len] float; ``scores`` is [batch] float (one
scalar reward per response); ``group_ids`` is [batch] int, equal ids mark responses to the same prompt (any
ints, any order, not necessarily contiguous); ``response_mask`` is [batch, response_len] 0/1: the **loss mask**
(the batch's ``loss_mask``, 1 on the tokens the policy sampled), which need not be one contiguous span — in a
multi-turn row, tool / environment tokens between two sampled spans are 0. Everything is computed in float32 (or
float64 if given) under ``torch.no_grad`` — advantages are targets, not graph nodes. Masked positions are
*skipped* by the recursions over time: a masked token's reward and value never reach an earlier token, and the
"next" value after the last valid token is 0, whatever the padding holds. Across a gap of masked tokens between
two sampled tokens the recursion continues as if the gap were not there (see ``gae`` for why).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from megarl.algorithms.masked import masked_whiten
from megarl.algorithms.registry import register_advantage


def _float(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _check_2d(name: str, x: torch.Tensor, mask: torch.Tensor) -> None:
    if x.shape != mask.shape:
        raise ValueError(f"{name} has shape {tuple(x.shape)}, response_mask has {tuple(mask.shape)}; they must match")


def _check_scores(scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor) -> None:
    if scores.dim() != 1 or group_ids.shape != scores.shape or mask.dim() != 2 or mask.shape[0] != scores.shape[0]:
        raise ValueError(
            f"expected scores [B], group_ids [B], response_mask [B, T]; got {tuple(scores.shape)}, "
            f"{tuple(group_ids.shape)}, {tuple(mask.shape)}"
        )


def _broadcast(per_seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return per_seq.unsqueeze(-1) * mask.to(per_seq.dtype)


def _group_stats(scores: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (group sum, group size, group index) for arbitrary integer ``group_ids`` [B]."""
    unique_ids, index = torch.unique(group_ids, return_inverse=True)
    n_groups = unique_ids.numel()
    sums = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, index, scores)
    sizes = torch.zeros_like(sums).index_add_(0, index, torch.ones_like(scores))
    return sums[index], sizes[index], index


def _discounted_sum_backwards(
    rewards: torch.Tensor, mask: torch.Tensor, gamma: float
) -> torch.Tensor:
    """``G_t = r_t + gamma * G_{next valid t}``, skipping masked positions; 0 after the last valid token."""
    valid = mask.bool()
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in range(rewards.shape[1] - 1, -1, -1):
        g = rewards[:, t] + gamma * running
        out[:, t] = g
        running = torch.where(valid[:, t], g, running)
    return out


@register_advantage("gae")
@torch.no_grad()
def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016), then whitening.

    Backwards over the valid tokens of each row (masked positions skipped)::

        delta_t = r_t + gamma * V_next - V_t          (V_next = 0 after the last valid token)
        A_t     = delta_t + gamma * lam * A_next

    where "next" is the next *valid* token t' > t, however many masked tokens lie between t and t'.

    Across masked (context) tokens inside a row — a multi-turn trajectory's tool / environment output between two
    sampled spans — GAE bootstraps straight through: for the last sampled token t before the gap and the first
    sampled token t' after it, ``delta_t = r_t + gamma * V_t' - V_t`` and ``A_t = delta_t + gamma * lam * A_t'``,
    with one factor of gamma (and of gamma * lam) for the whole gap; the gap's rewards and values are ignored.
    Why: the actions are the sampled tokens only. Context tokens are the environment's response to action t, part of
    the transition from the state before t to the state before t' (which the policy first sees with the tool output
    appended, and whose value the critic reads at t'-1: ``V_t'``). So the gap is neither an action (no advantage, no
    discount step of its own: gamma counts decisions, not the length of a tool's output) nor the end of the episode
    (no cut to V_next = 0: the trajectory goes on). Rewards placed on masked tokens are dropped (put an environment
    reward on the last sampled token before it). A single-turn row has no gap, and this is ordinary GAE.

    Args:
        token_rewards: [B, T] float, reward per token (typically the score on the last token, minus a KL penalty).
        values: [B, T] float, critic values V(s_t).
        response_mask: [B, T] 0/1, the loss mask (may have gaps, see above).
        gamma: discount per sampled token; lam: GAE lambda.

    Returns:
        advantages: [B, T] float32, whitened over valid tokens (masked mean, unbiased masked variance), 0 where
            masked.
        returns: [B, T] float32, ``A_t + V_t`` before whitening (the critic's target), 0 where masked.
    """
    adv, returns = gae_unwhitened(token_rewards, values, response_mask, gamma, lam)
    return masked_whiten(adv, response_mask), returns


@torch.no_grad()
def gae_unwhitened(token_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
                   gamma: float = 1.0, lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`gae` before its whitening: (advantages [B, T] float32, not whitened, masked positions not zeroed; returns
    [B, T] float32, 0 where masked). Row-wise: each row's output depends on that row alone, so a row share of the
    batch gives that share's rows bit for bit (`gae_on_share`)."""
    _check_2d("token_rewards", token_rewards, response_mask)
    _check_2d("values", values, response_mask)
    rewards, vals = _float(token_rewards), _float(values)
    valid = response_mask.bool()
    adv = torch.zeros_like(rewards)
    next_value = torch.zeros_like(vals[:, 0])
    next_adv = torch.zeros_like(vals[:, 0])
    for t in range(rewards.shape[1] - 1, -1, -1):
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        a = delta + gamma * lam * next_adv
        adv[:, t] = a
        next_value = torch.where(valid[:, t], vals[:, t], next_value)
        next_adv = torch.where(valid[:, t], a, next_adv)
    returns = torch.where(valid, adv + vals, 0.0)
    return adv, returns


@torch.no_grad()
def gae_on_share(scores: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float, lam: float,
                 rows: tuple[int, int],
                 gather: Optional[Callable[[tuple], list[tuple]]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE of one DP share of the batch, on the critic's rank that holds its values: bit for bit the share's rows
    of the controller's `gae(scores_to_token_rewards(scores_all, mask_all), values_all, mask_all, gamma, lam)`.

    Args:
        scores: [b] float, the share's sequence scores; values: [b, T] float32, its critic values; response_mask:
            [b, T] 0/1, its loss mask; rows: (lo, hi), the share's rows of the whole batch (b = hi - lo).
        gather: with several DP shares, an all-gather over them: called with this share's (lo, unwhitened
            advantages [b, T], mask [b, T] bool) and returning every share's tuple (any order); None: this share is
            the whole batch. The whitening's mean and variance are then those of the whole batch, computed
            by `masked_whiten` over the shares put back in row order -- the same tensor, so the same reduction order
            as the controller's (a sum of per-share partial sums would round differently).

    Returns: (advantages [b, T] float32 whitened over the whole batch's valid tokens, 0 where masked; returns [b, T]
        float32, the critic's target).
    """
    lo, hi = rows
    if scores.shape[0] != hi - lo or values.shape[0] != hi - lo:
        raise ValueError(f"gae_on_share: the share holds rows [{lo}, {hi}) but scores has {scores.shape[0]} and "
                         f"values {values.shape[0]} rows")
    adv, returns = gae_unwhitened(scores_to_token_rewards(scores, response_mask), values, response_mask, gamma, lam)
    if gather is None:
        return masked_whiten(adv, response_mask), returns
    shares = sorted(gather((lo, adv, response_mask.bool())), key=lambda s: s[0])  # a bool mask: 1 byte a token
    starts = [s[0] for s in shares]
    if starts[0] != 0 or any(s[0] + len(s[1]) != n for s, n in zip(shares, starts[1:])):
        raise ValueError(f"gae_on_share: the gathered shares start at rows {starts} with "
                         f"{[len(s[1]) for s in shares]} rows each: they must tile the batch from row 0")
    whole = masked_whiten(torch.cat([s[1] for s in shares]), torch.cat([s[2] for s in shares]))
    return whole[lo:hi], returns


@register_advantage("grpo")
@torch.no_grad()
def grpo(
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    response_mask: torch.Tensor,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO group-normalised outcome advantage (Shao et al. 2024), the same for every token of a response.

    ``A_i = (s_i - mean_g) / (std_g + eps)``, where mean/std are over the responses sharing ``group_ids[i]``;
    std is unbiased (divides by n-1, as ``torch.std``), and a group of one has std := 1 (so its advantage is
    0). All-equal scores in a group give 0. ``norm_by_std=False`` gives ``s_i - mean_g`` (Dr. GRPO).

    Args: scores [B] float; group_ids [B] int; response_mask [B, T] 0/1.
    Returns: (advantages, returns), both [B, T] float32, ``A_i`` on every valid token, 0 where masked;
        returns == advantages.
    """
    _check_scores(scores, group_ids, response_mask)
    s = _float(scores)
    sums, sizes, _ = _group_stats(s, group_ids)
    mean = sums / sizes
    centred = s - mean
    if norm_by_std:
        sq_sums, _, _ = _group_stats(centred**2, group_ids)
        std = torch.where(sizes > 1, (sq_sums / (sizes - 1).clamp(min=1)).sqrt(), torch.ones_like(sizes))
        centred = centred / (std + eps)
    adv = _broadcast(centred, response_mask)
    return adv, adv


@register_advantage("rloo")
@torch.no_grad()
def rloo(
    scores: torch.Tensor, group_ids: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out (Ahmadian et al. 2024): ``A_i = s_i - mean of the *other* members of i's group``.

    A group of one has no other member and gets advantage 0 (no baseline means no learning signal we trust).

    Args: scores [B] float; group_ids [B] int; response_mask [B, T] 0/1.
    Returns: (advantages, returns), both [B, T] float32, ``A_i`` on valid tokens, 0 where masked; returns ==
        advantages.
    """
    _check_scores(scores, group_ids, response_mask)
    s = _float(scores)
    sums, sizes, _ = _group_stats(s, group_ids)
    baseline = (sums - s) / (sizes - 1).clamp(min=1)
    adv_seq = torch.where(sizes > 1, s - baseline, torch.zeros_like(s))
    adv = _broadcast(adv_seq, response_mask)
    return adv, adv


@register_advantage("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted return-to-go per token, whitened over the batch's valid tokens.

    ``G_t = r_t + gamma * G_next`` over valid tokens (masked positions skipped, ``G`` = 0 after the last one); across
    a gap of masked tokens, as in ``gae``: one discount step, the gap's rewards ignored.

    Args: token_rewards [B, T] float; response_mask [B, T] 0/1; gamma: discount per token.
    Returns: advantages [B, T] float32 = whiten(G) (0 where masked); returns [B, T] float32 = G (0 where masked).
    """
    _check_2d("token_rewards", token_rewards, response_mask)
    returns = _discounted_sum_backwards(_float(token_rewards), response_mask, gamma)
    returns = torch.where(response_mask.bool(), returns, 0.0)
    return masked_whiten(returns, response_mask), returns


@register_advantage("reinforce_plus_plus_baseline")
@torch.no_grad()
def reinforce_plus_plus_baseline(
    scores: torch.Tensor, group_ids: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group-mean baseline: ``s_i - mean_g`` on every valid token, then whitened over the
    batch's valid tokens (so longer responses weigh more in the batch statistics).

    Args: scores [B] float; group_ids [B] int; response_mask [B, T] 0/1.
    Returns: (advantages, returns), both [B, T] float32, 0 where masked; returns == advantages.
    """
    _check_scores(scores, group_ids, response_mask)
    s = _float(scores)
    sums, sizes, _ = _group_stats(s, group_ids)
    adv = masked_whiten(_broadcast(s - sums / sizes, response_mask), response_mask)
    return adv, adv


# How [B] per-sequence advantages expand over a row's tokens on the actor's ranks (`per_sequence_advantages`): each is
# bit-identical, masked positions included, to what an estimator returns: "product" = value x mask (`_broadcast`: GRPO,
# RLOO; a masked position holds value x 0, signed like the value); "where" = the value where the mask is 1, +0
# elsewhere (`masked_whiten`'s zeroing: REINFORCE++ with a baseline).
SEQUENCE_EXPANSIONS = ("product", "where")


def expand_per_sequence(values: torch.Tensor, response_mask: torch.Tensor, expansion: str) -> torch.Tensor:
    """[B] per-sequence values -> [B, T] over the mask's tokens, as `expansion` (one of SEQUENCE_EXPANSIONS).

    Args: values [B] float; response_mask [B, T] 0/1 (the loss mask the update reads).
    Returns: [B, T] of values' dtype: ``values[i]`` where ``response_mask[i, t] == 1``; elsewhere ``values[i] * 0``
        ("product") or +0 ("where").
    """
    if values.dim() != 1 or response_mask.dim() != 2 or response_mask.shape[0] != values.shape[0]:
        raise ValueError(f"expected values [B], response_mask [B, T]; got {tuple(values.shape)}, "
                         f"{tuple(response_mask.shape)}")
    if expansion == "product":
        return _broadcast(values, response_mask)
    if expansion == "where":
        return torch.where(response_mask.bool(), values.unsqueeze(-1),
                           torch.zeros((), dtype=values.dtype, device=values.device))
    raise ValueError(f"unknown expansion {expansion!r}: expected one of {SEQUENCE_EXPANSIONS}")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element for element, the sign of every zero included (NaN never equal)."""
    return a.dtype == b.dtype and torch.equal(a, b) and torch.equal(torch.signbit(a), torch.signbit(b))


@torch.no_grad()
def per_sequence_advantages(
    advantages: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, str] | None:
    """The [B] form of token advantages that are one number per sequence (GRPO, RLOO, REINFORCE++ with a baseline):
    ``(values, expansion)`` with ``expand_per_sequence(values, response_mask, expansion)`` bit-identical to
    ``advantages`` (every element, the sign of zeros included), or None when no expansion reproduces them (token-level
    advantages: GAE, REINFORCE++; or a mask other than the one they were computed with). Sending the [B] values
    instead of the [B, T] tensor is exact by construction: the check is the expansion itself.

    Args: advantages [B, T] float; response_mask [B, T] 0/1.
    Returns: (values [B] of advantages' dtype, one of SEQUENCE_EXPANSIONS), or None.
    """
    _check_2d("advantages", advantages, response_mask)
    if not advantages.is_floating_point():
        return None
    valid = response_mask.bool()
    # a row's value at its first sampled token; a row with none: its first element (a zero whose sign "product" keeps)
    first = torch.where(valid.any(-1), valid.int().argmax(-1), torch.zeros_like(valid[:, 0], dtype=torch.long))
    values = advantages.gather(1, first.unsqueeze(-1)).squeeze(-1).contiguous()
    for expansion in SEQUENCE_EXPANSIONS:
        if _same_bits(expand_per_sequence(values, response_mask, expansion), advantages):
            return values, expansion
    return None


def scores_to_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence score on its last valid token.

    Args: scores [B] float; response_mask [B, T] 0/1 (ragged; need not be contiguous).
    Returns: [B, T] with ``scores[i]`` at the highest index t where ``response_mask[i, t] == 1`` and 0
        elsewhere; a row with no valid token is all 0. Dtype of ``scores`` (float32 if it is an integer type).
    """
    if scores.dim() != 1 or response_mask.dim() != 2 or response_mask.shape[0] != scores.shape[0]:
        raise ValueError(
            f"expected scores [B], response_mask [B, T]; got {tuple(scores.shape)}, {tuple(response_mask.shape)}"
        )
    s = scores if scores.is_floating_point() else scores.float()
    valid = response_mask.bool()
    positions = torch.arange(valid.shape[1], device=valid.device).expand_as(valid)
    last = torch.where(valid, positions, -1).max(dim=-1).values  # -1 for an empty row
    out = torch.zeros(valid.shape, dtype=s.dtype, device=s.device)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    out[rows, last[rows]] = s[rows]
    return out
