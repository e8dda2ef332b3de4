"""Registries, masked statistics and loss aggregation, against hand-computed values."""

import statistics

import pytest
import torch

from megarl.algorithms import (
    UnknownNameError,
    aggregate,
    aggregation_modes,
    get_advantage,
    get_aggregation,
    get_kl,
    get_policy_loss,
    masked_mean,
    masked_var,
    masked_whiten,
)
from megarl.registry import Registry

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])


def test_registries_hold_every_algorithm():
    assert get_advantage("grpo").__name__ == "grpo"
    assert get_policy_loss("ppo") is get_policy_loss("vanilla")
    assert get_kl("k3") is get_kl("low_var_kl")
    assert aggregation_modes() == [
        "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-mean"
    ]
    for name in ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        get_advantage(name)
    get_policy_loss("gspo")


def test_unknown_name_lists_valid_names_and_suggests():
    with pytest.raises(UnknownNameError) as err:
        get_advantage("gpro")
    message = str(err.value)
    assert "unknown advantage estimator 'gpro'" in message
    assert "did you mean 'grpo'" in message
    assert "gae, grpo, reinforce_plus_plus, reinforce_plus_plus_baseline, rloo" in message
    assert isinstance(err.value, KeyError) and isinstance(err.value, ValueError)
    with pytest.raises(UnknownNameError, match="valid: seq-mean-token-mean, seq-mean-token-sum"):
        aggregate(LOSS, MASK, "mean")
    with pytest.raises(UnknownNameError, match="valid: abs, k1, k2, k3, kl, low_var_kl, mse"):
        get_kl("k4")


def test_duplicate_registration_is_an_error():
    reg = Registry("thing")
    reg.register("a")(lambda: 1)
    with pytest.raises(ValueError, match="'a' is already registered"):
        reg.register("a")(lambda: 2)


def test_masked_statistics_ignore_masked_values_even_nan():
    x = torch.tensor([[1.0, 2.0, float("nan")], [3.0, 6.0, 0.0]])
    m = torch.tensor([[1, 1, 0], [1, 1, 0]])
    # valid values 1, 2, 3, 6: mean 3, unbiased var ((-2)^2 + (-1)^2 + 0 + 3^2) / 3 = 14/3
    assert masked_mean(x, m).item() == pytest.approx(3.0)
    assert masked_var(x, m).item() == pytest.approx(14 / 3)
    assert masked_var(x, m, unbiased=False).item() == pytest.approx(14 / 4)
    assert masked_mean(x, m, dim=-1).tolist() == pytest.approx([1.5, 4.5])
    w = masked_whiten(x, m)
    expected = [(v - 3.0) / (14 / 3 + 1e-8) ** 0.5 for v in (1.0, 2.0, 3.0, 6.0)]
    assert [w[0, 0].item(), w[0, 1].item(), w[1, 0].item(), w[1, 1].item()] == pytest.approx(expected)
    assert w[0, 2].item() == 0.0 and w[1, 2].item() == 0.0
    assert statistics.variance([1.0, 2.0, 3.0, 6.0]) == pytest.approx(14 / 3)  # the reference we mean


def test_masked_mean_of_empty_selection_is_zero():
    assert masked_mean(torch.ones(2, 2), torch.zeros(2, 2)).item() == 0.0


def test_aggregation_modes_hand_computed():
    # valid tokens: row 0 -> 1, 2 ; row 1 -> 4, 5, 6
    assert aggregate(LOSS, MASK, "token-mean").item() == pytest.approx((1 + 2 + 4 + 5 + 6) / 5)  # 3.6
    assert aggregate(LOSS, MASK, "seq-mean-token-sum").item() == pytest.approx((3 + 15) / 2)  # 9
    assert aggregate(LOSS, MASK, "seq-mean-token-mean").item() == pytest.approx((1.5 + 5.0) / 2)  # 3.25
    assert aggregate(LOSS, MASK, "seq-mean-token-sum-norm", norm_horizon=4).item() == pytest.approx(
        (3 / 4 + 15 / 4) / 2
    )  # 2.25
    assert get_aggregation("token-mean")(LOSS, MASK).item() == pytest.approx(3.6)


def test_aggregation_ignores_nan_at_masked_positions_and_its_gradient_is_masked():
    loss = LOSS.clone()
    loss[0, 2] = float("nan")
    loss.requires_grad_(True)
    out = aggregate(loss, MASK, "token-mean")
    assert out.item() == pytest.approx(3.6)
    out.backward()
    torch.testing.assert_close(loss.grad, torch.tensor([[0.2, 0.2, 0.0], [0.2, 0.2, 0.2]]))


def test_seq_modes_skip_empty_rows_and_all_masked_is_zero():
    loss = torch.tensor([[1.0, 2.0], [100.0, 100.0]])
    mask = torch.tensor([[1, 1], [0, 0]])
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx(1.5)  # not (1.5 + 0) / 2
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx(3.0)
    for mode in aggregation_modes():
        out = aggregate(loss, torch.zeros_like(mask), mode, norm_horizon=2)
        assert out.item() == 0.0, mode


def test_global_normalizer_makes_micro_batch_shares_sum_to_the_global_mean():
    # two micro-batches of one row each: the plain means would average 1.5 and 5 -> 3.25 for token-mean, wrong
    for mode, n in [("token-mean", 5), ("seq-mean-token-mean", 2), ("seq-mean-token-sum", 2)]:
        full = aggregate(LOSS, MASK, mode)
        shares = [aggregate(LOSS[i : i + 1], MASK[i : i + 1], mode, global_normalizer=n) for i in range(2)]
        assert (shares[0] + shares[1]).item() == pytest.approx(full.item()), mode
    assert aggregate(LOSS, MASK, "token-mean", global_normalizer=10).item() == pytest.approx(18 / 10)
    assert aggregate(LOSS, MASK, "token-mean", global_normalizer=torch.tensor(10)).item() == pytest.approx(1.8)
    assert aggregate(LOSS[:1], MASK[:1], "token-mean").item() == pytest.approx(1.5)  # local count without it
    with pytest.raises(ValueError, match="global_normalizer must be positive"):
        aggregate(LOSS, MASK, "token-mean", global_normalizer=0)


def test_token_sum_norm_needs_a_horizon():
    with pytest.raises(ValueError, match="needs a positive norm_horizon"):
        aggregate(LOSS, MASK, "seq-mean-token-sum-norm")
