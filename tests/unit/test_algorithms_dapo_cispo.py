"""CISPO, DAPO's overlong filtering / soft punishment and the algorithm presets (dr_grpo, gspo, cispo), against
hand-computed values."""

from __future__ import annotations

import math
import re

import pytest
import torch

from megarl.algorithms import cispo_policy_loss, filter_truncated, get_policy_loss, grpo, soft_overlong_penalty
from megarl.config import ConfigError, load_config
from megarl.config.validate import validate


def test_cispo_weight_is_clipped_and_stop_gradient():
    # ratios r = [0.5/0.25, 0.2/0.4, 0.3/0.3] = [2, 0.5, 1]; clip to [1 - 0.2, 1 + 0.5] -> w = [1.5, 0.8, 1]
    lp = torch.log(torch.tensor([[0.5, 0.2, 0.3]])).requires_grad_()
    old = torch.log(torch.tensor([[0.25, 0.4, 0.3]]))
    adv = torch.tensor([[1.0, -2.0, 3.0]])
    mask = torch.ones(1, 3)
    loss, m = cispo_policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.5)
    # L = -w * A * logp, token-mean over 3 tokens
    want = (-1.5 * 1 * math.log(0.5) - 0.8 * -2 * math.log(0.2) - 1 * 3 * math.log(0.3)) / 3
    assert loss.item() == pytest.approx(want, rel=1e-6)  # = (1.039721 - 2.575101 + 3.611918) / 3 = 0.692179
    assert loss.item() == pytest.approx(0.692179, abs=1e-6)
    loss.backward()
    # d L / d logp_t = -w_t * A_t / 3: every token keeps its gradient, clipped or not (unlike PPO)
    assert torch.allclose(lp.grad, torch.tensor([[-1.5 / 3, 1.6 / 3, -1.0]]), atol=1e-7)
    assert m["clip_frac"].item() == pytest.approx(2 / 3)
    assert m["ratio_mean"].item() == pytest.approx((2 + 0.5 + 1) / 3)
    assert get_policy_loss("cispo") is cispo_policy_loss


def test_cispo_default_has_no_lower_bound_and_refuses_dual_clip():
    lp = torch.log(torch.tensor([[0.01]])).requires_grad_()
    old = torch.log(torch.tensor([[0.5]]))  # r = 0.02: PPO would floor it at 0.8, CISPO (clip_low=1) keeps 0.02
    loss, m = cispo_policy_loss(lp, old, torch.tensor([[1.0]]), torch.ones(1, 1))
    assert loss.item() == pytest.approx(-0.02 * math.log(0.01), rel=1e-5) and m["clip_frac"].item() == 0.0
    with pytest.raises(ValueError, match=re.escape("CISPO has no dual clip; clip_c must be None, got 3.0")):
        cispo_policy_loss(lp, old, torch.ones(1, 1), torch.ones(1, 1), clip_c=3.0)
    with pytest.raises(ValueError, match=re.escape("CISPO needs 0 <= clip_low <= 1 and clip_high >= 0")):
        cispo_policy_loss(lp, old, torch.ones(1, 1), torch.ones(1, 1), clip_low=1.5)


def test_soft_overlong_penalty_is_dapos_linear_ramp():
    # L_max = 20, L_cache = 8: no penalty up to 12 tokens, then (12 - |y|) / 8, -1 beyond 20
    lengths = torch.tensor([5, 12, 13, 16, 20, 21])
    got = soft_overlong_penalty(lengths, max_len=20, cache_len=8)
    assert got.tolist() == [0.0, 0.0, -0.125, -0.5, -1.0, -1.0]
    assert soft_overlong_penalty(lengths, 20, 8, factor=0.5).tolist() == [0.0, 0.0, -0.0625, -0.25, -0.5, -0.5]
    with pytest.raises(ValueError, match=re.escape("need 1 <= cache_len <= max_len (tokens), got cache_len=30")):
        soft_overlong_penalty(lengths, 20, 30)


def test_filter_truncated_masks_whole_rows():
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1], [1, 1, 1, 1]])
    got = filter_truncated(mask, torch.tensor([False, True, False]))
    assert got.tolist() == [[0, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]] and got.dtype == mask.dtype


@pytest.mark.parametrize("name, want", [
    ("grpo", ("grpo", "ppo", True, "token-mean", 0.2, 0.2)),
    ("dr_grpo", ("grpo", "ppo", False, "seq-mean-token-sum-norm", 0.2, 0.2)),
    ("gspo", ("grpo", "gspo", True, "seq-mean-token-mean", 3e-4, 4e-4)),
    ("cispo", ("grpo", "cispo", True, "token-mean", 1.0, 5.0)),
])
def test_presets_fill_the_null_fields_and_explicit_values_win(name, want):
    nulls = [f"algorithm.{k}=null" for k in ("clip_low", "clip_high", "loss_agg")]  # the quickstart sets them
    a = validate(load_config("yaml_configs/cpu_quickstart.yaml", [f"algorithm.name={name}", *nulls])).algorithm
    assert (a.advantage_estimator, a.policy_loss, a.grpo_norm_by_std, a.loss_agg, a.clip_low, a.clip_high) == want
    cfg = validate(load_config("yaml_configs/cpu_quickstart.yaml", [f"algorithm.name={name}", "algorithm.loss_agg=null",
                                                                    "algorithm.grpo_norm_by_std=true"]))
    assert cfg.algorithm.grpo_norm_by_std is True and cfg.algorithm.clip_high == 0.28  # the file's, explicit


def test_dr_grpo_advantages_are_centred_not_scaled():
    # group 0: scores [1, 0, 0, 1] -> mean 0.5 -> [0.5, -0.5, -0.5, 0.5] (GRPO would divide by std 0.57735)
    adv, _ = grpo(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.zeros(4, dtype=torch.long), torch.ones(4, 2),
                  norm_by_std=False)
    assert adv[:, 0].tolist() == [0.5, -0.5, -0.5, 0.5]


def test_overlong_and_cispo_config_rules():
    with pytest.raises(ConfigError, match=re.escape(
            "algorithm.overlong.soft_cache_tokens=64: the penalty ramp must fit in rollout.max_new_tokens=32")):
        validate(load_config("yaml_configs/cpu_quickstart.yaml", ["algorithm.overlong.soft_cache_tokens=64"]))
    validate(load_config("yaml_configs/cpu_quickstart.yaml", ["algorithm.name=cispo", "algorithm.clip_low=1.0"]))
    with pytest.raises(ConfigError, match=re.escape("algorithm.clip_low: must be < 1 (ratio >= 1 - clip_low), got 1")):
        validate(load_config("yaml_configs/cpu_quickstart.yaml", ["algorithm.clip_low=1.0"]))
