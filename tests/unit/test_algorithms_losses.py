"""PPO / GSPO policy losses, the clipped value loss, KL estimators, KL penalty and KL controllers."""

import math

import pytest
import torch

from megarl.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    build_kl_controller,
    get_policy_loss,
    gspo_policy_loss,
    kl,
    kl_loss,
    policy_loss,
    value_loss,
)


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, t(expected), atol=atol, rtol=1e-5)


def log_probs_for(ratios):
    """log_probs (leaf, with grad) and old_log_probs = 0 such that exp(log_probs - old) = ratios."""
    lp = torch.log(t(ratios)).requires_grad_(True)
    return lp, torch.zeros_like(lp)


# ---------------------------------------------------------------- PPO

def test_ppo_clipped_surrogate_hand_computed_with_gradients():
    clip_low, clip_high = 0.2, 0.3  # ratio clamped to [0.8, 1.3]
    lp, old = log_probs_for([[1.5, 0.5, 0.5], [1.5, 1.0, 100.0]])
    adv = t([[1.0, 1.0, -1.0], [-1.0, 2.0, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss, m = policy_loss(lp, old, adv, mask, clip_low, clip_high)
    # a: r=1.5, A=+1: max(-1.5, -1.3) = -1.3   clipped, grad 0
    # b: r=0.5, A=+1: max(-0.5, -0.8) = -0.5   unclipped, dL/dlogp = -A*r = -0.5
    # c: r=0.5, A=-1: max( 0.5,  0.8) =  0.8   clipped, grad 0
    # d: r=1.5, A=-1: max( 1.5,  1.3) =  1.5   unclipped, grad -A*r = 1.5
    # e: r=1.0, A=+2: -2                        unclipped, grad -2
    # f: masked (ratio 100)
    assert loss.item() == pytest.approx((-1.3 - 0.5 + 0.8 + 1.5 - 2.0) / 5, abs=1e-6)  # -0.3
    loss.backward()
    close(lp.grad, [[0.0, -0.5 / 5, 0.0], [1.5 / 5, -2.0 / 5, 0.0]])
    assert m["clip_frac"].item() == pytest.approx(2 / 5)
    assert m["dual_clip_frac"].item() == 0.0
    assert m["ratio_mean"].item() == pytest.approx((1.5 + 0.5 + 0.5 + 1.5 + 1.0) / 5)
    log_r = [math.log(r) for r in (1.5, 0.5, 0.5, 1.5, 1.0)]
    assert m["approx_kl"].item() == pytest.approx(-sum(log_r) / 5, abs=1e-6)
    assert m["approx_kl_k3"].item() == pytest.approx(sum(math.exp(x) - 1 - x for x in log_r) / 5, abs=1e-6)
    for value in m.values():
        assert isinstance(value, torch.Tensor) and value.dim() == 0 and not value.requires_grad


def test_ppo_ratio_exactly_on_clip_edges_is_not_clipped_and_keeps_gradient():
    clip_low_d, clip_high_d = torch.tensor([math.log(0.8)]), torch.tensor([math.log(1.3)])
    lp = torch.cat([clip_high_d, clip_low_d]).view(1, 2).requires_grad_(True)
    old = torch.zeros_like(lp)
    r = torch.exp(lp.detach() - old)  # the exact float32 ratios the loss will see
    clip_high, clip_low = r[0, 0].item() - 1.0, 1.0 - r[0, 1].item()
    adv = t([[1.0, -1.0]])  # upper edge with A > 0, lower edge with A < 0
    loss, m = policy_loss(lp, old, adv, torch.ones(1, 2), clip_low, clip_high, agg="seq-mean-token-sum")
    assert m["clip_frac"].item() == 0.0
    loss.backward()
    close(lp.grad, [[-r[0, 0].item(), r[0, 1].item()]])  # -A * r


def test_ppo_dual_clip_boundaries():
    lp = torch.log(t([[10.0, 2.0, 10.0, 3.0, 1.0]])).requires_grad_(True)
    old = torch.zeros_like(lp)
    r = torch.exp(lp.detach())
    clip_c = r[0, 3].item()  # exactly the fourth token's ratio (float32 of 3.0)
    adv = t([[-1.0, -1.0, 1.0, -1.0, -2.0]])
    loss, m = policy_loss(lp, old, adv, torch.ones(1, 5), 0.2, 0.2, clip_c=clip_c, agg="seq-mean-token-sum")
    # g: A=-1, r=10: PPO loss max(10, 1.2) = 10 > -A*c = 3 -> capped at 3, dual active, grad 0
    # h: A=-1, r=2: loss 2 < 3 -> not capped, grad -A*r = 2
    # i: A=+1, r=10: dual clip never applies to A > 0 -> max(-10, -1.2) = -1.2 (clipped), grad 0
    # j: A=-1, r=c exactly: loss c == cap -> not counted as dual-clipped, grad -A*r = c
    # k: A=-2, r=1: loss 2, grad 2
    assert loss.item() == pytest.approx(3.0 + 2.0 - 1.2 + clip_c + 2.0, abs=1e-5)
    assert m["dual_clip_frac"].item() == pytest.approx(1 / 5)
    assert m["clip_frac"].item() == pytest.approx(1 / 5)  # only i: for g the clipped branch (1.2) is not the max
    loss.backward()
    close(lp.grad, [[0.0, 2.0, 0.0, clip_c, 2.0]])


def test_ppo_negative_advantage_with_huge_ratio_stays_finite():
    lp = t([[50.0, 50.0]]).requires_grad_(True)  # log-ratio 50: exp would be ~5e21 (or inf at 100)
    old = torch.zeros_like(lp)
    adv = t([[-1.0, -1.0]])
    loss, m = policy_loss(lp, old, adv, torch.ones(1, 2), 0.2, 0.2, clip_c=3.0)
    assert loss.item() == pytest.approx(3.0)
    assert m["dual_clip_frac"].item() == 1.0
    loss.backward()
    close(lp.grad, [[0.0, 0.0]])
    loss, _ = policy_loss(lp * 2, old, adv, torch.ones(1, 2), 0.2, 0.2)  # no dual clip, log-ratio 100
    assert math.isfinite(loss.item()) and loss.item() == pytest.approx(math.exp(20.0), rel=1e-5)


def test_ppo_argument_checks_and_registry():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="clip_c must be > 1"):
        policy_loss(x, x, x, torch.ones(1, 2), 0.2, 0.2, clip_c=1.0)
    with pytest.raises(ValueError, match="shapes must match"):
        policy_loss(x, x, torch.zeros(2, 1), torch.ones(1, 2), 0.2, 0.2)
    with pytest.raises(ValueError, match="GSPO has no dual clip"):
        gspo_policy_loss(x, x, x, torch.ones(1, 2), clip_c=3.0)
    assert get_policy_loss("ppo") is policy_loss and get_policy_loss("gspo") is gspo_policy_loss


# ---------------------------------------------------------------- GSPO

def test_gspo_sequence_ratio_clipping_and_gradient_form():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    lp = t([[0.1, 0.2, 0.3], [0.6, 0.4, 7.0]]).requires_grad_(True)  # 7.0 is masked garbage
    old = torch.zeros_like(lp)
    adv = t([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]])
    loss, m = gspo_policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.3)
    s0, s1 = math.exp((0.1 + 0.2 + 0.3) / 3), math.exp((0.6 + 0.4) / 2)  # e^0.2 = 1.2214, e^0.5 = 1.6487
    # row 0: s0 in [0.8, 1.3] -> per-token loss -A*s0 = -s0 ; row 1: s1 > 1.3, A > 0 -> clipped -2*1.3 = -2.6
    # seq-mean-token-mean: (mean(-s0, -s0, -s0) + mean(-2.6, -2.6)) / 2
    assert loss.item() == pytest.approx((-s0 - 2.6) / 2, abs=1e-6)
    assert m["clip_frac"].item() == pytest.approx(2 / 5)
    assert m["ratio_mean"].item() == pytest.approx((s0 + s1) / 2, abs=1e-6)
    loss.backward()
    # every token of row 0 gets the *sequence* ratio: (1/2) * (1/3) * (-A * s0); clipped row 1 gets 0.
    # (token-level PPO would give e^0.1/6, e^0.2/6, e^0.3/6 instead.)
    close(lp.grad, [[-s0 / 6] * 3, [0.0, 0.0, 0.0]])


def test_gspo_gradient_matches_the_sequence_level_objective():
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    lp = (0.05 * torch.randn(3, 4)).requires_grad_(True)
    old = torch.zeros(3, 4)
    adv = t([[1.5], [-0.5], [2.0]]).expand(3, 4)
    loss, m = gspo_policy_loss(lp, old, adv, mask, clip_low=10.0 / 11, clip_high=10.0)  # wide: nothing clipped
    assert m["clip_frac"].item() == 0.0
    loss.backward()
    ref = lp.detach().clone().requires_grad_(True)
    lengths = mask.sum(-1)
    s = torch.exp((ref * mask).sum(-1) / lengths)  # the paper's length-normalised sequence ratio
    (-(s * adv[:, 0]).mean()).backward()
    torch.testing.assert_close(lp.grad, ref.grad * mask)


# ---------------------------------------------------------------- value loss

def test_value_loss_clipped_hand_computed_with_gradients():
    values = t([[1.0, 1.0], [0.2, 50.0]]).requires_grad_(True)
    old = t([[0.0, 0.0], [0.0, 0.0]])
    returns = t([[2.0, 0.0], [1.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, m = value_loss(values, old, returns, mask, clip=0.5)
    # a: v=1, old=0 -> v_clip=0.5, R=2: (1-2)^2 = 1 vs (0.5-2)^2 = 2.25 -> clipped wins: 0.5*2.25, grad 0
    # b: v=1, v_clip=0.5, R=0: 1 vs 0.25 -> 0.5*1 = 0.5, grad (v - R) = 1
    # c: v=0.2 inside the clip, R=1: 0.5*0.64 = 0.32, grad -0.8
    assert loss.item() == pytest.approx((1.125 + 0.5 + 0.32) / 3, abs=1e-6)
    assert m["value_clip_frac"].item() == pytest.approx(1 / 3)
    loss.backward()
    close(values.grad, [[0.0, 1.0 / 3], [-0.8 / 3, 0.0]])
    with pytest.raises(ValueError, match="value clip must be > 0"):
        value_loss(values, old, returns, mask, clip=0.0)


# ---------------------------------------------------------------- KL

LP = t([[-1.0, -2.0], [-0.5, 0.0]])
REF = t([[-1.5, -1.0], [-0.5, -3.0]])  # d = logp - ref = [[0.5, -1], [0, 3]]
KL_MASK = torch.tensor([[1, 1], [1, 0]])


def test_kl_estimators_hand_computed():
    close(kl(LP, REF, "k1"), [[0.5, -1.0], [0.0, 3.0]])
    close(kl(LP, REF, "k2"), [[0.125, 0.5], [0.0, 4.5]])
    close(kl(LP, REF, "mse"), [[0.125, 0.5], [0.0, 4.5]])
    # k3 = exp(-d) - (-d) - 1 = exp(-d) + d - 1
    k3 = [[math.exp(-0.5) - 0.5, math.exp(1.0) - 2.0], [0.0, math.exp(-3.0) + 2.0]]
    close(kl(LP, REF, "k3"), k3)
    close(kl(LP, REF, "low_var_kl"), k3)
    close(kl(LP, REF, "abs"), [[0.5, 1.0], [0.0, 3.0]])


def test_k3_is_clamped_to_ten_and_finite():
    lp, ref = t([[0.0, 0.0]]), t([[15.0, -50.0]])
    # ref - logp = 15: exp(15) - 16 ~ 3.3e6 -> 10 ; = -50 -> exponent clamped to -20: e^-20 + 19 -> 10
    close(kl(lp, ref, "k3"), [[10.0, 10.0]])


def test_kl_loss_aggregates_and_differentiates():
    lp = LP.clone().requires_grad_(True)
    loss = kl_loss(lp, REF, KL_MASK, kind="k1", agg="token-mean")
    assert loss.item() == pytest.approx((0.5 - 1.0 + 0.0) / 3)
    loss.backward()
    close(lp.grad, [[1 / 3, 1 / 3], [1 / 3, 0.0]])
    # k2, seq-mean-token-mean: row 0 (0.125 + 0.5) / 2 = 0.3125, row 1 0 -> 0.15625
    assert kl_loss(LP, REF, KL_MASK, kind="k2", agg="seq-mean-token-mean").item() == pytest.approx(0.15625)


def test_apply_kl_penalty_hand_computed():
    rewards = t([[0.0, 1.0], [2.0, 9.0]])
    out, m = apply_kl_penalty(rewards, LP, REF, KL_MASK, coef=0.1, kind="k1")
    # r - 0.1 * d: 0 - 0.05, 1 + 0.1, 2 - 0 ; masked -> 0
    close(out, [[-0.05, 1.1], [2.0, 0.0]])
    # per-sequence mean KL: (0.5 - 1) / 2 = -0.25 and 0 -> mean -0.125
    assert m["kl"].item() == pytest.approx(-0.125)
    # per-sequence summed KL: 0.5 - 1 = -0.5 and 0 -> mean -0.25
    assert m["kl_seq_sum"].item() == pytest.approx(-0.25)
    assert m["kl_coef"].item() == pytest.approx(0.1)


def test_kl_controllers():
    fixed = FixedKLController(0.05)
    fixed.update(100.0, 256)
    assert fixed.value == 0.05
    ctl = AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10000)
    ctl.update(9.0, n_steps=256)  # 9/6 - 1 = 0.5 -> clipped to 0.2 ; mult = 1 + 0.2*256/10000 = 1.00512
    assert ctl.value == pytest.approx(0.1 * 1.00512)
    ctl.update(torch.tensor(5.4), n_steps=1000)  # 5.4/6 - 1 = -0.1 ; mult = 1 - 0.1*1000/10000 = 0.99
    assert ctl.value == pytest.approx(0.1 * 1.00512 * 0.99)
    ctl.update(0.0, n_steps=10000)  # -1 -> clipped to -0.2 ; mult 0.8
    assert ctl.value == pytest.approx(0.1 * 1.00512 * 0.99 * 0.8)
    assert isinstance(build_kl_controller("adaptive", 0.1, target=6, horizon=10), AdaptiveKLController)
    assert isinstance(build_kl_controller("fixed", 0.1), FixedKLController)
    with pytest.raises(ValueError, match="valid: adaptive, fixed"):
        build_kl_controller("pid", 0.1)
