"""Rollout/train mismatch metrics and corrections (megarl.algorithms.rollout_correction), against hand-computed
values on a ragged batch, and the importance weights inside the PPO / GSPO losses."""

import math

import pytest
import torch

from megarl.algorithms import gspo_policy_loss, mismatch_metrics, policy_loss, rollout_correction

NAN = float("nan")

# A ragged batch: 4 samples, S = 4 positions; position 0 is always the prompt. Token importance ratios
# r = pi_actor / pi_rollout on the response tokens, written out by hand:
#   row 0: 3 tokens, r = 1.5, 0.25, 1.0   -> sequence ratio R = 0.375
#   row 1: 2 tokens, r = 3.0, 1.2         -> R = 3.6
#   row 2: 1 token,  r = 1.1              -> R = 1.1
#   row 3: no response token
RATIOS = [[1.5, 0.25, 1.0], [3.0, 1.2], [1.1], []]
MASK = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]])
TOKENS = [r for row in RATIOS for r in row]  # the 6 response tokens, in order


def batch():
    """(actor_log_probs, rollout_log_probs) with exp(actor - rollout) = RATIOS on the response tokens; masked
    positions hold garbage (nan, huge values) that must be ignored."""
    rollout = torch.tensor([[NAN, -1.0, -2.0, -0.5], [50.0, -3.0, -0.25, NAN], [7.0, -1.5, -80.0, 3.0],
                            [NAN, 9.0, -9.0, 0.0]])
    actor = torch.tensor([[3.0, 0.0, 0.0, 0.0], [-40.0, 0.0, 0.0, 11.0], [0.0, 0.0, 90.0, NAN],
                          [1.0, NAN, 2.0, -5.0]])
    for i, row in enumerate(RATIOS):
        for j, r in enumerate(row):
            actor[i, 1 + j] = rollout[i, 1 + j] + math.log(r)
    return actor, rollout


def approx(x, abs=1e-6):
    return pytest.approx(x, abs=abs)


# ---------------------------------------------------------------- metrics

def test_mismatch_metrics_hand_computed_on_a_ragged_batch():
    actor, rollout = batch()
    m = mismatch_metrics(actor, rollout, MASK, c=2.0)
    logs = [math.log(r) for r in TOKENS]
    assert m["abs_diff_mean"].item() == approx(sum(abs(x) for x in logs) / 6)
    assert m["abs_diff_max"].item() == approx(math.log(4.0))  # the r = 0.25 token
    # k3 per token: r - 1 - log r; by hand 0.094535, 0.636294, 0, 0.901388, 0.017678, 0.004690
    assert m["kl"].item() == approx((0.094535 + 0.636294 + 0 + 0.901388 + 0.017678 + 0.004690) / 6, abs=2e-6)
    assert m["kl_k1"].item() == approx(-sum(logs) / 6)
    # outside [1/2, 2]: the 0.25 and 3.0 tokens; sequences 0.375 and 3.6 of the 3 with tokens (row 3 has none)
    assert m["ratio_out_frac"].item() == approx(2 / 6)
    assert m["seq_ratio_out_frac"].item() == approx(2 / 3)
    for v in m.values():
        assert v.dim() == 0 and torch.isfinite(v)


def test_mismatch_sums_combined_over_micro_batches_give_the_hand_computed_metrics():
    """The actor's fused path sums `mismatch_sums` over micro-batches (and DP ranks) and finishes once: splitting
    the ragged batch into rows {0, 3} and {1, 2} must give the whole batch's hand-computed values."""
    from megarl.algorithms.rollout_correction import MISMATCH_MAX_KEYS, mismatch_from_sums, mismatch_sums

    actor, rollout = batch()
    parts = [mismatch_sums(actor[idx], rollout[idx], MASK[idx], c=2.0) for idx in ([0, 3], [1, 2])]
    combined = {k: (max if k in MISMATCH_MAX_KEYS else sum)(float(p[k]) for p in parts) for k in parts[0]}
    m = mismatch_from_sums(combined)
    logs = [math.log(r) for r in TOKENS]
    assert m["abs_diff_mean"] == approx(sum(abs(x) for x in logs) / 6)
    assert m["abs_diff_max"] == approx(math.log(4.0))
    assert m["kl"] == approx((0.094535 + 0.636294 + 0 + 0.901388 + 0.017678 + 0.004690) / 6, abs=2e-6)
    assert m["kl_k1"] == approx(-sum(logs) / 6)
    assert m["ratio_out_frac"] == approx(2 / 6) and m["seq_ratio_out_frac"] == approx(2 / 3)


def test_mismatch_metrics_band_follows_c():
    actor, rollout = batch()
    # c = 3.5: only the 0.25 token (1/0.25 = 4 > 3.5) is out; sequence 3.6 > 3.5 and 1/0.375 = 2.67 < 3.5
    m = mismatch_metrics(actor, rollout, MASK, c=3.5)
    assert m["ratio_out_frac"].item() == approx(1 / 6)
    assert m["seq_ratio_out_frac"].item() == approx(1 / 3)


def test_identical_log_probs_give_zero_mismatch_and_an_empty_mask_gives_zeros():
    lp = torch.tensor([[0.0, -0.7, -1.3], [0.0, -2.0, 0.0]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]])
    m = mismatch_metrics(lp, lp.clone(), mask)
    assert all(v.item() == 0.0 for v in m.values())
    empty = mismatch_metrics(lp, lp + 1.0, torch.zeros_like(mask))
    assert all(v.item() == 0.0 for v in empty.values())


# ---------------------------------------------------------------- corrections

def test_token_tis_weights_are_the_ratios_truncated_at_c():
    actor, rollout = batch()
    w, keep, m = rollout_correction(actor, rollout, MASK, tis="token", c=2.0)
    expected = torch.tensor([[0, 1.5, 0.25, 1.0], [0, 2.0, 1.2, 0], [0, 1.1, 0, 0], [0, 0, 0, 0]])
    torch.testing.assert_close(w, expected, atol=1e-6, rtol=1e-6)
    assert torch.equal(keep, MASK.bool())  # no masking asked for
    assert m["tis_weight_mean"].item() == approx((1.5 + 0.25 + 1.0 + 2.0 + 1.2 + 1.1) / 6)
    assert m["tis_clip_frac"].item() == approx(1 / 6)  # the r = 3 token
    assert m["masked_token_frac"].item() == 0.0 and m["masked_seq_frac"].item() == 0.0


def test_sequence_tis_weights_are_the_product_of_ratios_truncated_at_c():
    actor, rollout = batch()
    w, keep, m = rollout_correction(actor, rollout, MASK, tis="sequence", c=2.0)
    # R = 0.375 (row 0), min(3.6, 2) = 2 (row 1), 1.1 (row 2), on every response token of the row
    expected = torch.tensor([[0, 0.375, 0.375, 0.375], [0, 2.0, 2.0, 0], [0, 1.1, 0, 0], [0, 0, 0, 0]])
    torch.testing.assert_close(w, expected, atol=1e-6, rtol=1e-6)
    assert m["tis_weight_mean"].item() == approx((3 * 0.375 + 2 * 2.0 + 1.1) / 6)
    assert m["tis_clip_frac"].item() == approx(2 / 6)  # both tokens of row 1


def test_off_gives_unit_weights_on_the_response_and_nothing_masked():
    actor, rollout = batch()
    w, keep, m = rollout_correction(actor, rollout, MASK)
    torch.testing.assert_close(w, MASK.float())
    assert torch.equal(keep, MASK.bool())
    assert m["tis_weight_mean"].item() == 1.0 and m["tis_clip_frac"].item() == 0.0


def test_token_mask_excludes_tokens_outside_the_band_and_counts_them():
    actor, rollout = batch()
    _, keep, m = rollout_correction(actor, rollout, MASK, mask="token", c=2.0)
    # [1/2, 2]: the 0.25 (row 0, t=2) and 3.0 (row 1, t=1) tokens go
    assert keep.int().tolist() == [[0, 1, 0, 1], [0, 0, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]]
    assert m["masked_token_frac"].item() == approx(2 / 6)
    assert m["masked_seq_frac"].item() == 0.0
    # a tight band [1/1.05, 1.05]: only row 0's r = 1.0 survives; rows 1 and 2 lose every token
    w, keep, m = rollout_correction(actor, rollout, MASK, mask="token", mask_c=1.05, tis="token", c=2.0)
    assert keep.int().tolist() == [[0, 0, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert m["masked_token_frac"].item() == approx(5 / 6)
    assert m["masked_seq_frac"].item() == approx(2 / 3)
    assert w.tolist() == [[0, 0, 0, 1.0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]  # masked tokens weigh 0
    assert m["tis_weight_mean"].item() == approx(1.0)  # over the one kept token


def test_sequence_mask_excludes_whole_sequences_and_combines_with_token_tis():
    actor, rollout = batch()
    # band [1/3, 3]: row 1 (R = 3.6) goes; row 0 (R = 0.375 >= 1/3) and row 2 stay
    w, keep, m = rollout_correction(actor, rollout, MASK, tis="token", c=2.0, mask="sequence", mask_c=3.0)
    assert keep.int().tolist() == [[0, 1, 1, 1], [0, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0]]
    torch.testing.assert_close(w, torch.tensor([[0, 1.5, 0.25, 1.0], [0, 0, 0, 0], [0, 1.1, 0, 0], [0, 0, 0, 0]]),
                               atol=1e-6, rtol=1e-6)
    assert m["masked_token_frac"].item() == approx(2 / 6)
    assert m["masked_seq_frac"].item() == approx(1 / 3)
    assert m["tis_weight_mean"].item() == approx((1.5 + 0.25 + 1.0 + 1.1) / 4)
    assert m["tis_clip_frac"].item() == 0.0  # the truncated r = 3 token was masked away
    # band [1/2, 2]: rows 0 and 1 go
    _, keep, m = rollout_correction(actor, rollout, MASK, mask="sequence", c=2.0)
    assert keep.int().tolist() == [[0, 0, 0, 0], [0, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0]]
    assert m["masked_seq_frac"].item() == approx(2 / 3)


def test_a_huge_log_ratio_truncates_without_overflow():
    actor = torch.tensor([[0.0, 500.0, -500.0]])
    rollout = torch.zeros_like(actor)
    mask = torch.tensor([[0, 1, 1]])
    w, _, _ = rollout_correction(actor, rollout, mask, tis="token", c=3.0)
    assert w.tolist() == [[0.0, 3.0, 0.0]]
    w, _, _ = rollout_correction(torch.tensor([[0.0, 500.0, 1.0]]), rollout, mask, tis="sequence", c=3.0)
    assert w.tolist() == [[0.0, 3.0, 3.0]]


def test_bad_arguments_are_refused_by_name():
    actor, rollout = batch()
    with pytest.raises(ValueError, match="unknown tis mode 'tokens'"):
        rollout_correction(actor, rollout, MASK, tis="tokens")
    with pytest.raises(ValueError, match="unknown mask mode 'seq'"):
        rollout_correction(actor, rollout, MASK, mask="seq")
    with pytest.raises(ValueError, match="c must be > 1"):
        rollout_correction(actor, rollout, MASK, tis="token", c=1.0)
    with pytest.raises(ValueError, match="mask_c must be > 1"):
        rollout_correction(actor, rollout, MASK, mask="token", mask_c=0.5)
    with pytest.raises(ValueError, match="c must be > 1"):
        mismatch_metrics(actor, rollout, MASK, c=0.9)
    with pytest.raises(ValueError, match="one shape"):
        mismatch_metrics(actor, rollout[:, :3], MASK)


# ---------------------------------------------------------------- weights inside the policy losses

def test_ppo_loss_weights_scale_each_tokens_loss_and_gradient():
    # ratios (current / old) 1.0 and 1.5, advantages +1 and -1, clip [0.8, 1.2]
    lp = torch.log(torch.tensor([[1.0, 1.5, 1.0]])).requires_grad_(True)
    old = torch.zeros_like(lp)
    adv = torch.tensor([[1.0, -1.0, 3.0]])
    mask = torch.tensor([[1, 1, 0]])
    weights = torch.tensor([[2.0, 0.5, 7.0]])
    loss, m = policy_loss(lp, old, adv, mask, 0.2, 0.2, weights=weights)
    # token 0: L = -1 * 1.0 = -1, weight 2 -> -2; token 1: r=1.5, A=-1: max(1.5, 1.2) = 1.5 (unclipped), x0.5
    assert loss.item() == approx((-2.0 + 0.75) / 2)
    loss.backward()
    # dL/dlogp = w * (-A * r) / 2: token 0: 2 * -1 / 2 = -1; token 1: 0.5 * 1.5 / 2 = 0.375; masked: 0
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0, 0.375, 0.0]]))
    assert m["clip_frac"].item() == 0.0  # the weights do not change which branch is active
    unweighted, _ = policy_loss(lp.detach(), old, adv, mask, 0.2, 0.2)
    assert unweighted.item() == approx((-1.0 + 1.5) / 2)
    with pytest.raises(ValueError, match="weights"):
        policy_loss(lp, old, adv, mask, weights=weights[:, :2])


def test_gspo_loss_weights_scale_each_tokens_loss():
    lp = torch.zeros(1, 3, requires_grad=True)  # sequence ratio 1
    old = torch.zeros(1, 3)
    adv = torch.tensor([[2.0, 2.0, 2.0]])
    mask = torch.tensor([[1, 1, 1]])
    loss, _ = gspo_policy_loss(lp, old, adv, mask, weights=torch.tensor([[1.0, 0.5, 0.0]]))
    # seq-mean-token-mean: (-2*1 - 2*0.5 - 0) / 3 over the one sequence
    assert loss.item() == approx(-1.0)


def test_decoupled_ppo_loss_by_hand():
    """Decoupled PPO (Hilton et al. 2022; AReaL): the ratio is clipped against the proximal policy (the old
    log-probs the trainer recomputes with the weights it updates) and each token is weighted by the truncated
    importance ratio proximal / behaviour (the stale rollout's own log-probs), tis=token, c=2. Numbers by hand:

        token  pi    prox  behaviour  r = pi/prox  clipped (0.8, 1.28)  w = min(prox/behav, 2)  -w * min(r, clip)
        1      0.5   0.4   0.2        1.25         1.25                 2.0                     -2.5
        2      0.3   0.2   0.25       1.5          1.28                 0.8                     -1.024
        3      0.1   0.2   0.05       0.5          0.8 (min: 0.5)       2.0 (4 capped)          -1.0
    advantages 1; token-mean: -4.524 / 3 = -1.508. (The actor's own wiring of the two log-probs:
    tests/distributed/test_roles.py::test_decoupled_ppo_update_clips_against_the_proximal_policy_and_weights_by_...)"""
    def logs(*p):
        return torch.tensor([[math.log(x) for x in p]])

    pi, prox, behaviour = logs(0.5, 0.3, 0.1), logs(0.4, 0.2, 0.2), logs(0.2, 0.25, 0.05)
    mask = torch.ones(1, 3)
    weights, keep, _ = rollout_correction(prox, behaviour, mask, tis="token", c=2.0)
    assert torch.allclose(weights, torch.tensor([[2.0, 0.8, 2.0]]))
    loss, _ = policy_loss(pi, prox, torch.ones(1, 3), keep.float(), clip_low=0.2, clip_high=0.28, weights=weights)
    assert loss.item() == pytest.approx(-4.524 / 3, abs=1e-6)
