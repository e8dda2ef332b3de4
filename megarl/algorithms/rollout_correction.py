"""Rollout/train mismatch: measured every step, corrected on request (truncated importance sampling, masking).

The rollout engine (vLLM) and the trainer (Megatron) evaluate the same weights with different kernels, so the
log-prob vLLM reports for a sampled token differs slightly from the one Megatron computes (CPU quickstart, bf16:
|d| ~2e-3 nats on average, up to ~0.1; fp32: ~1e-7, up to ~2e-6). Once rollouts come from older weights
(asynchronous modes) the gap is a real off-policy gap.
Per sampled token t of sample i (``response_mask``, the loss mask, is 1; context tokens of a multi-turn row
hold 0 in both log-probs and never count) (token-aligned [B, S] tensors, see `megarl.data.batch`; float32)::

    logp_rollout[i, t]   vLLM's raw log-prob of the sampled token (batch key ``rollout_log_probs``)
    logp_actor[i, t]     the OLD-policy log-prob, recomputed by Megatron before the update (``old_log_probs``);
                         the policy that the PPO ratio is taken against
    d[i, t] = logp_actor - logp_rollout        (nats)
    r[i, t] = exp(d)                           token importance ratio pi_actor / pi_rollout
    R[i]    = exp(sum_t d[i, t])               sequence importance ratio (product of the token ratios)

Both log-probs are of the raw model distribution (vLLM ``logprobs_mode="raw_logprobs"``: before temperature,
top-k, top-p), so with ``rollout.temperature == 1`` and no top-k / top-p the tokens are samples of pi_rollout and
``mean(r - 1 - log r)`` (k3) estimates KL(pi_rollout || pi_actor) per token without bias.

Corrections (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"; Ionides
2008 for truncated IS). Both use only the detached log-probs above, never the current policy's, so the weights
and masks are constants of the update (the same for every PPO epoch and mini-batch):

    tis="token":     w[i, t] = min(r[i, t], c)        a weight on the per-token policy-gradient loss
    tis="sequence":  w[i, t] = min(R[i], c)           the same weight on every token of sequence i
    mask="token":    token t of i is excluded from the loss when r[i, t] is outside [1/mask_c, mask_c]
    mask="sequence": every token of i is excluded when R[i] is outside [1/mask_c, mask_c]

Masks and weights are independent: both are computed from all response tokens of a sequence.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from megarl.algorithms.masked import masked_mean, masked_sum

TIS_MODES = ("off", "token", "sequence")
MASK_MODES = ("off", "token", "sequence")


def _check(actor_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor) -> None:
    if not (actor_log_probs.shape == rollout_log_probs.shape == response_mask.shape) or actor_log_probs.dim() != 2:
        raise ValueError(
            "need [batch, seq] tensors of one shape: actor_log_probs "
            f"{tuple(actor_log_probs.shape)}, rollout_log_probs {tuple(rollout_log_probs.shape)}, "
            f"response_mask {tuple(response_mask.shape)}"
        )


def _check_bound(name: str, value: float) -> None:
    if not value > 1.0:
        raise ValueError(f"{name} must be > 1 (the ratio band is [1/{name}, {name}]), got {value}")


def log_ratio(actor_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
              response_mask: torch.Tensor) -> torch.Tensor:
    """``d = actor_log_probs - rollout_log_probs`` [B, S] float32 (nats), 0 where ``response_mask`` is 0."""
    _check(actor_log_probs, rollout_log_probs, response_mask)
    d = actor_log_probs.detach().float() - rollout_log_probs.detach().float()
    return torch.where(response_mask.bool(), d, torch.zeros((), dtype=d.dtype, device=d.device))


# What `mismatch_sums` returns: additive over micro-batches and data-parallel ranks, except the max.
MISMATCH_SUM_KEYS = ("abs_diff_sum", "kl_sum", "kl_k1_sum", "ratio_out_count", "tokens", "seq_ratio_out_count",
                     "sequences")
MISMATCH_MAX_KEYS = ("abs_diff_max",)


def mismatch_sums(actor_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
                  c: float = 2.0) -> dict[str, torch.Tensor]:
    """The parts of `mismatch_metrics` that add up over micro-batches and DP ranks (0-dim float32 tensors):
    sums over response tokens of |d|, k3 and -d, the count of tokens with |d| > log c, the token count, the count
    of sequences with |sum_t d| > log c and of sequences with a response token; plus ``abs_diff_max`` (combine by
    max). Whole sequences must lie in one call (the sequence terms sum each row). `mismatch_from_sums` finishes."""
    _check_bound("c", c)
    d = log_ratio(actor_log_probs, rollout_log_probs, response_mask)
    valid = response_mask.bool()
    abs_d = d.abs()
    log_c = math.log(c)
    has_tokens = valid.any(-1)
    return {
        "abs_diff_sum": masked_sum(abs_d, valid),
        "kl_sum": masked_sum(torch.expm1(d) - d, valid),  # r - 1 - log r, 0 at masked positions (d = 0 there)
        "kl_k1_sum": masked_sum(-d, valid),
        "ratio_out_count": masked_sum((abs_d > log_c).float(), valid),
        "tokens": valid.float().sum(),
        "seq_ratio_out_count": masked_sum((d.sum(-1).abs() > log_c).float(), has_tokens),
        "sequences": has_tokens.float().sum(),
        "abs_diff_max": abs_d.max() if abs_d.numel() else torch.zeros(()),  # masked positions hold 0
    }


def mismatch_from_sums(sums: dict) -> dict:
    """`mismatch_metrics`' names from (combined) `mismatch_sums`; works on floats or 0-dim tensors."""
    tokens, sequences = max(sums["tokens"], 1), max(sums["sequences"], 1)
    return {
        "abs_diff_mean": sums["abs_diff_sum"] / tokens,
        "abs_diff_max": sums["abs_diff_max"],
        "kl": sums["kl_sum"] / tokens,
        "kl_k1": sums["kl_k1_sum"] / tokens,
        "ratio_out_frac": sums["ratio_out_count"] / tokens,
        "seq_ratio_out_frac": sums["seq_ratio_out_count"] / sequences,
    }


# Result keys of `mismatch_rows` (the actor's forward adds them to its result; `RLLoop` reads them back).
MISMATCH_ROWS = "mismatch_rows/"


def mismatch_rows(actor_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
                  c: float = 2.0, policy_version: Optional[torch.Tensor] = None,
                  versions: Optional[Sequence[int]] = None) -> dict[str, torch.Tensor]:
    """`mismatch_sums` row by row, so a batch's rows can be summed where they were computed (each DP rank its share of
    the old log-prob forward) and only [B] numbers come up (`mismatch_from_rows` finishes on the controller).

    Inputs [B, S] as `mismatch_metrics`. Returns [B] float32 per key of `mismatch_sums` (``abs_diff_max``: the row's
    max), under ``MISMATCH_ROWS + key``; with `versions` (and `policy_version` [B, S], the weights version each token
    was sampled with), also ``MISMATCH_ROWS + f"v{v}/" + key`` over the response tokens of version v only."""
    _check_bound("c", c)
    masks = {"": response_mask}
    if versions:
        if policy_version is None:
            raise ValueError("mismatch_rows: versions need the batch's policy_version [B, S]")
        masks.update({f"v{int(v)}/": (response_mask.bool() & (policy_version == int(v))).to(response_mask.dtype)
                      for v in versions})
    out = {}
    log_c = math.log(c)
    for prefix, mask in masks.items():
        d = log_ratio(actor_log_probs, rollout_log_probs, mask)
        valid = mask.bool()
        abs_d = d.abs()
        has_tokens = valid.any(-1)
        rows = {
            "abs_diff_sum": masked_sum(abs_d, valid, dim=-1),
            "kl_sum": masked_sum(torch.expm1(d) - d, valid, dim=-1),
            "kl_k1_sum": masked_sum(-d, valid, dim=-1),
            "ratio_out_count": masked_sum((abs_d > log_c).float(), valid, dim=-1),
            "tokens": valid.float().sum(-1),
            "seq_ratio_out_count": ((d.sum(-1).abs() > log_c) & has_tokens).float(),
            "sequences": has_tokens.float(),
            "abs_diff_max": abs_d.amax(-1) if abs_d.shape[-1] else torch.zeros(abs_d.shape[0]),
        }
        out.update({f"{MISMATCH_ROWS}{prefix}{k}": v.float() for k, v in rows.items()})
    return out


def mismatch_from_rows(rows: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """`mismatch_metrics`' names from the [B] rows of `mismatch_rows` (all of a batch's rows, in any order), for the
    tokens of `prefix` ("" all, "v3/" version 3's)."""
    sums = {k: rows[f"{MISMATCH_ROWS}{prefix}{k}"].sum() for k in MISMATCH_SUM_KEYS}
    top = rows[f"{MISMATCH_ROWS}{prefix}abs_diff_max"]
    sums["abs_diff_max"] = top.max() if top.numel() else torch.zeros(())
    return mismatch_from_sums(sums)


def mismatch_metrics(actor_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
                     c: float = 2.0) -> dict[str, torch.Tensor]:
    """How far the rollout engine's log-probs are from the actor's (see the module docstring for the names).

    Inputs [B, S] (``response_mask`` 0/1; masked positions ignored whatever they hold). Returns 0-dim float32
    tensors, token means over the response tokens unless named otherwise:

    - ``abs_diff_mean``, ``abs_diff_max``: mean and max of |d| (nats)
    - ``kl``: k3 estimate ``mean(r - 1 - d)`` of KL(pi_rollout || pi_actor) (nats per token, >= 0)
    - ``kl_k1``: k1 estimate ``mean(-d)`` of the same KL (unbiased, can be negative)
    - ``ratio_out_frac``: fraction of tokens with r outside [1/c, c] (i.e. |d| > log c)
    - ``seq_ratio_out_frac``: fraction of sequences (with a response token) with R outside [1/c, c]

    An empty response mask gives 0 for every metric. (The actor's update computes the same from `mismatch_sums`
    per micro-batch when it takes the old log-probs from its own forward.)
    """
    return mismatch_from_sums(mismatch_sums(actor_log_probs, rollout_log_probs, response_mask, c))


def rollout_correction(actor_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
                       tis: str = "off", c: float = 2.0, mask: str = "off", mask_c: float | None = None):
    """Truncated importance weights and the loss mask that corrects for the rollout/train mismatch.

    Args:
        actor_log_probs: [B, S] old-policy log-probs recomputed by the trainer (no grad needed; detached here).
        rollout_log_probs: [B, S] the rollout engine's log-probs of the same tokens.
        response_mask: [B, S] 0/1, the response tokens.
        tis: 'off', 'token' (w = min(r, c)) or 'sequence' (w = min(R, c) on every token of the sequence).
        c: truncation cap of the weights, > 1.
        mask: 'off', 'token' or 'sequence' (see the module docstring).
        mask_c: band [1/mask_c, mask_c] of the masks, > 1; None = ``c``.

    Returns ``(weights, keep, metrics)``:
        weights: [B, S] float32 >= 0, detached; 1 everywhere with tis='off'; 0 where ``keep`` is False.
        keep: [B, S] bool, the response tokens that stay in the loss (``response_mask`` minus the masked ones).
        metrics: 0-dim float32 tensors: ``tis_weight_mean`` (mean weight over kept tokens), ``tis_clip_frac``
            (fraction of kept tokens whose weight was truncated at c), ``masked_token_frac`` (fraction of
            response tokens excluded) and ``masked_seq_frac`` (fraction of sequences with a response token that
            lost all of them).
    """
    if tis not in TIS_MODES:
        raise ValueError(f"unknown tis mode {tis!r}; valid: {', '.join(TIS_MODES)}")
    if mask not in MASK_MODES:
        raise ValueError(f"unknown mask mode {mask!r}; valid: {', '.join(MASK_MODES)}")
    _check_bound("c", c)
    mask_c = c if mask_c is None else mask_c
    _check_bound("mask_c", mask_c)
    d = log_ratio(actor_log_probs, rollout_log_probs, response_mask)
    valid = response_mask.bool()
    seq = d.sum(-1, keepdim=True).expand_as(d)  # log R[i] on every position of row i
    log_c, log_mc = math.log(c), math.log(mask_c)

    if mask == "token":
        keep = valid & (d.abs() <= log_mc)
    elif mask == "sequence":
        keep = valid & (seq.abs() <= log_mc)
    else:
        keep = valid

    if tis == "token":
        log_w = d
    elif tis == "sequence":
        log_w = seq
    else:
        log_w = torch.zeros_like(d)
    # min(exp(x), c) = exp(min(x, log c)): no overflow for a large positive log-ratio
    weights = torch.exp(log_w.clamp(max=log_c))
    clipped = (log_w > log_c) & keep
    weights = torch.where(keep, weights, torch.zeros((), dtype=weights.dtype, device=weights.device))

    has_tokens = valid.any(-1)
    lost_all = has_tokens & ~keep.any(-1)
    metrics = {
        "tis_weight_mean": masked_mean(weights, keep),
        "tis_clip_frac": masked_mean(clipped.float(), keep),
        "masked_token_frac": masked_sum((~keep).float(), valid) / valid.float().sum().clamp(min=1),
        "masked_seq_frac": masked_mean(lost_all.float(), has_tokens),
    }
    return weights, keep, metrics
