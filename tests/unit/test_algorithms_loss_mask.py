"""The RL maths on a multi-turn batch: the loss mask has a gap (tool tokens) between two sampled spans, and every
advantage, loss, KL, metric and correction reads the mask, never the span from the first to the last sampled token.
Expected values are computed by hand in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from megarl.algorithms import (
    aggregate,
    cispo_policy_loss,
    gae,
    grpo,
    gspo_policy_loss,
    kl_loss,
    mismatch_metrics,
    policy_loss,
    reinforce_plus_plus,
    rloo,
    rollout_correction,
    value_loss,
)
from megarl.data.trajectory import Trajectory, TrajectoryBuilder, trajectories_to_batch
from megarl.rollout.engine import RolloutSample

GARBAGE = 1000.0  # what context (mask-0) positions hold in these tests; it must never show up in a result


def mask3() -> torch.Tensor:
    """The loss mask of three trajectories laid out by `trajectories_to_batch` (see tests/unit/test_trajectory.py):
    row 0: prompt 0-2, sampled 3-4, tool 5-7, sampled 8-9; row 1: prompt 0-1, sampled 2; row 2: prompt 0-2,
    sampled 3."""
    multi = (TrajectoryBuilder([1, 2, 3], uid="a", group_uid="q0").sampled([7, 8], [-0.5, -0.25], 4)
             .context([50, 51, 52]).sampled([9, 10], [-1.0, -0.125], 5).build("stop"))
    single = Trajectory.from_rollout_sample(RolloutSample(7, 0, [1, 4], [6], [-2.0], "length"), policy_version=5)
    other = TrajectoryBuilder([1, 2, 3], uid="c", group_uid="q0").sampled([11], [-0.75], 5).build("stop")
    batch = trajectories_to_batch([multi, single, other])
    return batch["loss_mask"]


def with_garbage(values: list[list[float]], mask: torch.Tensor) -> torch.Tensor:
    """[B, S] float32 from `values` on the mask-1 positions (row-major), GARBAGE everywhere else."""
    out = torch.full(mask.shape, GARBAGE)
    for i, row in enumerate(values):
        out[i, mask[i].bool()] = torch.tensor(row)
    return out


def test_the_fixture_mask_has_a_gap():
    assert mask3().tolist() == [[0, 0, 0, 1, 1, 0, 0, 0, 1, 1], [0, 0, 1] + [0] * 7, [0, 0, 0, 1] + [0] * 6]


# ---------------------------------------------------------------- advantages

def test_grpo_and_rloo_put_the_group_advantage_on_sampled_tokens_only():
    mask = mask3()
    scores, groups = torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0, 1, 0])
    adv, _ = grpo(scores, groups, mask)
    # group 0 = rows 0 and 2, scores [1, 0]: mean 0.5, unbiased std sqrt(0.5); row 1 alone: 0
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    want = torch.zeros(3, 10)
    want[0, [3, 4, 8, 9]] = a
    want[2, 3] = -a
    torch.testing.assert_close(adv, want)
    assert torch.all(adv[0, 5:8] == 0)  # the tool tokens between the spans
    adv, _ = rloo(scores, groups, mask)
    want = torch.zeros(3, 10)
    want[0, [3, 4, 8, 9]], want[2, 3] = 1.0, -1.0  # 1 - 0 and 0 - 1
    torch.testing.assert_close(adv, want)


def test_gae_bootstraps_across_the_tool_gap_with_one_discount_step():
    mask = mask3()[:1]  # sampled 3, 4 | tool 5, 6, 7 | sampled 8, 9
    gamma = lam = 0.5
    rewards = torch.zeros(1, 10)
    rewards[0, 9] = 1.0  # the score on the last sampled token
    rewards[0, 6], rewards[0, 1] = 5.0, 7.0  # on a tool token and a prompt token: dropped (docstring)
    values = with_garbage([[0.5, 0.25, 0.5, 0.25]], mask)  # V3, V4, V8, V9; GARBAGE on the gap
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    # backwards over the sampled tokens only (gamma * lam = 0.25):
    # t=9: delta = 1 + 0.5*0 - 0.25 = 0.75                         A9 = 0.75
    # t=8: delta = 0 + 0.5*0.25 - 0.5 = -0.375                     A8 = -0.375 + 0.25*0.75 = -0.1875
    # t=4 (next sampled token is 8, one discount step across the gap, bootstrapping from V8):
    #      delta = 0 + 0.5*0.5 - 0.25 = 0                          A4 = 0 + 0.25*(-0.1875) = -0.046875
    # t=3: delta = 0 + 0.5*0.25 - 0.5 = -0.375                     A3 = -0.375 + 0.25*(-0.046875) = -0.38671875
    # (a gap read as the end of the episode would give A4 = -0.25; a discount per position, t=4 -> 8 in 4 steps,
    # A4 = 0.0625*0.5 - 0.25 + 0.0039*(-0.1875) = -0.2195)
    raw = {3: -0.38671875, 4: -0.046875, 8: -0.1875, 9: 0.75}
    want_ret = torch.zeros(1, 10)
    for pos, v in {3: 0.5, 4: 0.25, 8: 0.5, 9: 0.25}.items():
        want_ret[0, pos] = raw[pos] + v
    torch.testing.assert_close(ret, want_ret)
    xs = list(raw.values())
    mean = sum(xs) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / 3 + 1e-8)
    want_adv = torch.zeros(1, 10)
    for pos, x in raw.items():
        want_adv[0, pos] = (x - mean) / std
    torch.testing.assert_close(adv, want_adv)


def test_reinforce_plus_plus_returns_cross_the_gap_with_one_discount_step():
    mask = mask3()[:1]
    rewards = torch.zeros(1, 10)
    rewards[0, 9], rewards[0, 6] = 1.0, 5.0
    _, ret = reinforce_plus_plus(rewards, mask, gamma=0.5)
    # G9 = 1, G8 = 0.5, G4 = 0.25 (one step across the gap, the tool token's 5 dropped), G3 = 0.125
    want = torch.zeros(1, 10)
    want[0, [3, 4, 8, 9]] = torch.tensor([0.125, 0.25, 0.5, 1.0])
    torch.testing.assert_close(ret, want)


# ---------------------------------------------------------------- aggregation and losses

def test_aggregation_counts_only_mask_one_tokens():
    mask = mask3()
    loss = torch.arange(10.0).expand(3, 10).clone()  # loss at position t is t; tool positions 5..7 hold 5, 6, 7
    # valid tokens: row 0 at 3, 4, 8, 9 (sum 24, 4 tokens); row 1 at 2 (2); row 2 at 3 (3)
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(29 / 6)  # a span would give 47/9
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((24 / 4 + 2 + 3) / 3)
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx(29 / 3)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", norm_horizon=4).item() == pytest.approx(29 / 12)
    assert aggregate(loss, mask, "token-mean", global_normalizer=12).item() == pytest.approx(29 / 12)


def _compact(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's mask-1 entries moved to the front (right-padded with 0) and the matching contiguous mask: the same
    sampled tokens with the gaps and the prompt removed."""
    n = int(mask.sum(-1).max())
    out, m = torch.zeros(mask.shape[0], n, dtype=x.dtype), torch.zeros(mask.shape[0], n, dtype=mask.dtype)
    for i in range(mask.shape[0]):
        row = x[i][mask[i].bool()]
        out[i, : row.numel()], m[i, : row.numel()] = row, 1
    return out, m


@pytest.mark.parametrize("loss_fn,kwargs", [
    (policy_loss, dict(clip_low=0.2, clip_high=0.28, clip_c=3.0)),
    (gspo_policy_loss, dict()),
    (cispo_policy_loss, dict()),
])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_a_context_token_never_contributes_to_the_policy_loss(loss_fn, kwargs, agg):
    mask = mask3()
    sampled_logp = [[-0.5, -0.25, -1.0, -0.125], [-2.0], [-0.75]]
    old = with_garbage([[-0.4, -0.3, -1.2, -0.1], [-1.5], [-0.75]], mask) - 2 * GARBAGE * (1 - mask)  # ratio e^20
    adv = with_garbage([[1.0, 2.0, -1.0, 0.5], [3.0], [-2.0]], mask)
    logp = with_garbage(sampled_logp, mask).requires_grad_()  # context: log-prob 1000, advantage 1000
    loss, metrics = loss_fn(logp, old, adv, mask, agg=agg, norm_horizon=5, **kwargs)
    loss.backward()
    assert torch.all(logp.grad[~mask.bool()] == 0)  # no gradient reaches a context token
    # the same sampled tokens with the prompt and the tool tokens cut out give the same loss and metrics
    c_logp, c_mask = _compact(logp.detach(), mask)
    c_logp.requires_grad_()
    c_loss, c_metrics = loss_fn(c_logp, _compact(old, mask)[0], _compact(adv, mask)[0], c_mask, agg=agg,
                                norm_horizon=5, **kwargs)
    c_loss.backward()
    torch.testing.assert_close(loss, c_loss)
    torch.testing.assert_close(logp.grad[mask.bool()], c_logp.grad[c_mask.bool()])
    for k in metrics:
        torch.testing.assert_close(metrics[k], c_metrics[k], msg=k)


def test_ppo_token_mean_by_hand_on_the_multi_turn_batch():
    mask = mask3()
    logp = with_garbage([[-0.5, -0.25, -1.0, -0.125], [-2.0], [-0.75]], mask).requires_grad_()
    adv = with_garbage([[1.0, 2.0, -1.0, 0.5], [3.0], [-2.0]], mask)
    loss, metrics = policy_loss(logp, logp.detach(), adv, mask)  # ratio 1 on every token: L_t = -A_t
    # sampled advantages sum to 1 + 2 - 1 + 0.5 + 3 - 2 = 3.5 over 6 tokens
    assert loss.item() == pytest.approx(-3.5 / 6)
    loss.backward()
    want = torch.zeros(3, 10)
    want[mask.bool()] = -torch.tensor([1.0, 2.0, -1.0, 0.5, 3.0, -2.0]) / 6
    torch.testing.assert_close(logp.grad, want)
    assert metrics["clip_frac"].item() == 0.0 and metrics["ratio_mean"].item() == pytest.approx(1.0)


def test_kl_loss_and_value_loss_ignore_context_tokens():
    mask = mask3()
    logp = with_garbage([[-0.5, -0.25, -1.0, -0.125], [-2.0], [-0.75]], mask)
    ref = with_garbage([[-0.5, -0.75, -1.0, -0.125], [-1.0], [-0.75]], mask) - 7.0 * (1 - mask)  # context differs
    # k1 = logp - ref: 0, 0.5, 0, 0, -1, 0 -> token-mean -0.5 / 6
    assert kl_loss(logp, ref, mask, kind="k1").item() == pytest.approx(-0.5 / 6)
    values = with_garbage([[1.0, 2.0, 0.0, 0.0], [1.0], [0.0]], mask)
    returns = with_garbage([[0.0, 2.0, 0.0, 0.5], [3.0], [0.0]], mask) * mask  # 0 on context (as gae gives)
    loss, m = value_loss(values, values, returns, mask, clip=10.0)
    # 0.5 * (v - R)^2: 0.5, 0, 0, 0.125, 2, 0 -> 2.625 / 6
    assert loss.item() == pytest.approx(2.625 / 6)
    assert m["value_mean"].item() == pytest.approx(4.0 / 6)


# ---------------------------------------------------------------- mismatch and rollout correction

def test_mismatch_metrics_ignore_context_tokens():
    mask = mask3()[:2]
    # d = actor - rollout on the sampled tokens: row 0: 0.1, -0.2, 1.0, 0.3; row 1: 0.05
    rollout = with_garbage([[-1.0, -1.0, -1.0, -1.0], [-1.0]], mask)
    actor = with_garbage([[-0.9, -1.2, 0.0, -0.7], [-0.95]], mask) * mask + (-30.0) * (1 - mask)  # d = -1030 there
    m = mismatch_metrics(actor, rollout, mask, c=2.0)
    d = [0.1, -0.2, 1.0, 0.3, 0.05]
    assert m["abs_diff_mean"].item() == pytest.approx(sum(abs(x) for x in d) / 5)
    assert m["abs_diff_max"].item() == pytest.approx(1.0)
    assert m["kl"].item() == pytest.approx(sum(math.expm1(x) - x for x in d) / 5, rel=1e-5)
    assert m["kl_k1"].item() == pytest.approx(-sum(d) / 5)
    assert m["ratio_out_frac"].item() == pytest.approx(1 / 5)  # |1.0| > log 2
    assert m["seq_ratio_out_frac"].item() == pytest.approx(1 / 2)  # row 0: sum 1.2 > log 2; row 1: 0.05


def test_rollout_correction_never_keeps_or_weights_a_context_token():
    mask = mask3()[:2]
    rollout = with_garbage([[-1.0, -1.0, -1.0, -1.0], [-1.0]], mask)
    actor = with_garbage([[-0.9, -1.2, 0.0, -0.7], [-0.95]], mask) * mask + (-30.0) * (1 - mask)
    weights, keep, m = rollout_correction(actor, rollout, mask, tis="token", c=2.0, mask="token", mask_c=2.0)
    assert not keep[~mask.bool()].any() and torch.all(weights[~mask.bool()] == 0)
    assert keep[mask.bool()].tolist() == [True, True, False, True, True]  # only d = 1.0 is outside [1/2, 2]
    torch.testing.assert_close(weights[keep], torch.exp(torch.tensor([0.1, -0.2, 0.3, 0.05])))
    assert m["masked_token_frac"].item() == pytest.approx(1 / 5)
