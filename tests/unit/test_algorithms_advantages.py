"""Advantage estimators and token rewards, against hand-computed values (arithmetic written out)."""

import math
import statistics

import pytest
import torch

from megarl.algorithms import (
    gae,
    get_advantage,
    grpo,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    rloo,
    scores_to_token_rewards,
)

EPS_W = 1e-8  # whitening epsilon


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, t(expected), atol=atol, rtol=1e-5)


def whiten(values):
    """Reference whitening of a flat list: (v - mean) / sqrt(unbiased var + eps)."""
    mean, var = statistics.fmean(values), statistics.variance(values)
    return [(v - mean) / math.sqrt(var + EPS_W) for v in values]


# ---------------------------------------------------------------- GAE

def test_gae_ragged_hand_computed():
    gamma, lam = 0.5, 0.5
    rewards = t([[0.0, 0.0, 1.0], [0.0, 2.0, 99.0]])  # 99 sits on a masked position and must not leak
    values = t([[0.5, 0.25, 0.5], [1.0, 0.5, 99.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # row 0, backwards: t=2 delta = 1 + 0.5*0 - 0.5 = 0.5            A2 = 0.5
    #                   t=1 delta = 0 + 0.5*0.5 - 0.25 = 0           A1 = 0 + 0.25*0.5 = 0.125
    #                   t=0 delta = 0 + 0.5*0.25 - 0.5 = -0.375      A0 = -0.375 + 0.25*0.125 = -0.34375
    # row 1 (last valid t=1, next value 0, not 99):
    #                   t=1 delta = 2 + 0 - 0.5 = 1.5                A1 = 1.5
    #                   t=0 delta = 0 + 0.5*0.5 - 1 = -0.75          A0 = -0.75 + 0.25*1.5 = -0.375
    raw = [-0.34375, 0.125, 0.5, -0.375, 1.5]
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    # returns = A + V before whitening
    close(ret, [[-0.34375 + 0.5, 0.125 + 0.25, 0.5 + 0.5], [-0.375 + 1.0, 1.5 + 0.5, 0.0]])
    w = whiten(raw)
    close(adv, [[w[0], w[1], w[2]], [w[3], w[4], 0.0]])


def test_gae_skips_interior_masked_tokens():
    # mask [1, 0, 1]: the middle token (reward 5, value 7) is skipped; t=0 bootstraps from t=2
    rewards, values = t([[0.0, 5.0, 1.0]]), t([[0.5, 7.0, 0.25]])
    _, ret = gae(rewards, values, torch.tensor([[1, 0, 1]]), gamma=1.0, lam=1.0)
    # t=2: delta = 1 - 0.25 = 0.75 -> A2 = 0.75, R2 = 1.0
    # t=0: delta = 0 + 0.25 - 0.5 = -0.25 -> A0 = -0.25 + 0.75 = 0.5, R0 = 1.0
    close(ret, [[1.0, 0.0, 1.0]])


def test_gae_lambda_zero_is_one_step_td():
    rewards, values = t([[1.0, 2.0]]), t([[3.0, 4.0]])
    _, ret = gae(rewards, values, torch.ones(1, 2), gamma=0.5, lam=0.0)
    # A0 = 1 + 0.5*4 - 3 = 0 -> R0 = 3 ; A1 = 2 - 4 = -2 -> R1 = 2
    close(ret, [[3.0, 2.0]])


def test_gae_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="values has shape"):
        gae(torch.zeros(2, 3), torch.zeros(2, 2), torch.ones(2, 3))


# ---------------------------------------------------------------- GRPO

def test_grpo_groups_any_ids_unbiased_std_singletons_and_ties():
    scores = t([1.0, 0.0, 2.0, 5.0, 3.0, 2.0, 2.0, 0.0, 1.0, 5.0])
    group_ids = torch.tensor([7, -3, 7, -3, 9, 4, 4, 12, 12, 12])
    mask = torch.ones(10, 2)
    adv, ret = grpo(scores, group_ids, mask)
    eps = 1e-6
    # group 7: [1, 2], mean 1.5, unbiased std sqrt((0.25 + 0.25) / 1) = sqrt(0.5)
    # group -3: [0, 5], mean 2.5, std sqrt((6.25 + 6.25) / 1) = sqrt(12.5)
    # group 9: [3] alone -> std := 1 -> (3 - 3) / (1 + eps) = 0
    # group 4: [2, 2] -> std 0 -> 0 / eps = 0
    # group 12: [0, 1, 5], mean 2, squares 4 + 1 + 9 = 14, unbiased var 14/2 = 7 (biased would be 14/3)
    expected = [
        -0.5 / (math.sqrt(0.5) + eps), -2.5 / (math.sqrt(12.5) + eps), 0.5 / (math.sqrt(0.5) + eps),
        2.5 / (math.sqrt(12.5) + eps), 0.0, 0.0, 0.0,
        -2 / (math.sqrt(7) + eps), -1 / (math.sqrt(7) + eps), 3 / (math.sqrt(7) + eps),
    ]
    close(adv, [[e, e] for e in expected])
    assert ret is adv or torch.equal(ret, adv)


def test_grpo_broadcasts_over_ragged_mask_and_without_std():
    scores, group_ids = t([1.0, 4.0]), torch.tensor([0, 0])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv, _ = grpo(scores, group_ids, mask, norm_by_std=False)
    close(adv, [[-1.5, -1.5, 0.0], [1.5, 0.0, 0.0]])  # mean 2.5
    adv, _ = grpo(scores, group_ids, mask, eps=0.0)
    s = math.sqrt(4.5)  # (1.5^2 * 2) / 1
    close(adv, [[-1.5 / s, -1.5 / s, 0.0], [1.5 / s, 0.0, 0.0]])


def test_grpo_via_registry_and_bad_shapes():
    adv, _ = get_advantage("grpo")(scores=t([0.0, 1.0]), group_ids=torch.tensor([3, 3]), response_mask=torch.ones(2, 1))
    close(adv, [[-0.5 / (math.sqrt(0.5) + 1e-6)], [0.5 / (math.sqrt(0.5) + 1e-6)]])
    with pytest.raises(ValueError, match="expected scores"):
        grpo(torch.zeros(2, 1), torch.zeros(2), torch.ones(2, 3))


# ---------------------------------------------------------------- RLOO

def test_rloo_leave_one_out_and_singleton_zero():
    scores = t([1.0, 2.0, 6.0, 9.0])
    group_ids = torch.tensor([5, 5, 5, 1])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]])
    adv, _ = rloo(scores, group_ids, mask)
    # 1 - (2 + 6)/2 = -3 ; 2 - (1 + 6)/2 = -1.5 ; 6 - (1 + 2)/2 = 4.5 ; group of one -> 0
    close(adv, [[-3.0, -3.0], [-1.5, 0.0], [4.5, 4.5], [0.0, 0.0]])


# ---------------------------------------------------------------- REINFORCE++

def test_reinforce_plus_plus_discounted_returns_then_whitened():
    rewards = t([[0.0, 0.0, 1.0], [0.0, 2.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = reinforce_plus_plus(rewards, mask, gamma=0.5)
    # row 0: G2 = 1, G1 = 0 + 0.5*1 = 0.5, G0 = 0.25 ; row 1 (9 masked): G1 = 2, G0 = 0 + 0.5*2 = 1
    close(ret, [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])
    w = whiten([0.25, 0.5, 1.0, 1.0, 2.0])  # mean 0.95
    close(adv, [[w[0], w[1], w[2]], [w[3], w[4], 0.0]])


def test_reinforce_plus_plus_baseline_group_mean_then_whitened():
    scores, group_ids = t([1.0, 3.0, 5.0]), torch.tensor([0, 0, 1])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    adv, _ = reinforce_plus_plus_baseline(scores, group_ids, mask)
    # group 0 mean 2 -> -1, +1 ; group 1 alone -> 0 ; tokens: -1, -1, 1, 0, 0 (mean -0.2)
    w = whiten([-1.0, -1.0, 1.0, 0.0, 0.0])
    close(adv, [[w[0], w[1]], [w[2], 0.0], [w[3], w[4]]])


def test_all_equal_scores_give_zero_advantage_everywhere():
    scores, group_ids, mask = t([3.0, 3.0, 3.0]), torch.tensor([1, 1, 1]), torch.ones(3, 2)
    for fn in (grpo, rloo, reinforce_plus_plus_baseline):
        adv, _ = fn(scores, group_ids, mask)
        close(adv, [[0.0, 0.0]] * 3)


# ---------------------------------------------------------------- token rewards

def test_scores_to_token_rewards_last_valid_token():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0], [1, 0, 1]])
    out = scores_to_token_rewards(t([1.0, 2.0, 3.0, 4.0]), mask)
    close(out, [[0.0, 1.0, 0.0], [0.0, 0.0, 2.0], [0.0, 0.0, 0.0], [0.0, 0.0, 4.0]])
    assert scores_to_token_rewards(torch.tensor([1, 2]), torch.ones(2, 2)).dtype == torch.float32
