"""Score-based advantages go down as [B] (issue 30, item 1): the controller's [B, S] advantages of each estimator
whose advantage is one number per sequence become [B] values plus an expansion, and the actor's ranks expand them
over the loss mask of their update share. The expected tensor is the estimator's own [B, S] output (what the
controller sent before), compared bit for bit (the sign of every zero included), through the controller's real cut of
the update (`plan_calls` with `RoleHost.update_actor`'s dispatch spec, mini-batches over two DP replicas)."""

import pytest
import torch

from megarl.algorithms import (
    gae,
    grpo,
    per_sequence_advantages,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    rloo,
)
from megarl.controller.dispatch import dispatched_methods, plan_calls
from megarl.data.batch import Batch
from megarl.data.mini_batches import SHARE_META, ShareLayout
from megarl.trainer.rl_trainer import _sequence_advantages
from megarl.workers.role_host import RoleHost, _expand_sequence_advantages

B, S = 16, 9


def _inputs():
    g = torch.Generator().manual_seed(3)
    scores = torch.randint(0, 5, (B,), generator=g).float() / 4  # ties within groups: zero advantages too
    group_ids = torch.arange(B) // 4
    mask = (torch.rand(B, S, generator=g) > 0.3).long()  # ragged, not contiguous (multi-turn gaps)
    mask[:, :2] = 0  # the prompt
    mask[5] = 0  # a row with no sampled token
    return scores, group_ids, mask


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


ESTIMATORS = {
    "grpo": lambda s, g, m: grpo(scores=s, group_ids=g, response_mask=m),
    "dr_grpo": lambda s, g, m: grpo(scores=s, group_ids=g, response_mask=m, norm_by_std=False),
    "rloo": lambda s, g, m: rloo(scores=s, group_ids=g, response_mask=m),
    "reinforce_plus_plus_baseline": lambda s, g, m: reinforce_plus_plus_baseline(scores=s, group_ids=g,
                                                                                 response_mask=m),
}


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_each_rank_expands_exactly_the_advantages_the_controller_computed(name):
    scores, group_ids, mask = _inputs()
    advantages, _ = ESTIMATORS[name](scores, group_ids, mask)
    assert (advantages < 0).any() and (advantages > 0).any()  # signed zeros at masked positions are exercised
    batch = Batch({"input_ids": torch.arange(B * S).reshape(B, S), "attention_mask": torch.ones(B, S, dtype=torch.long),
                   "loss_mask": mask, "advantages": advantages, "old_log_probs": torch.rand(B, S)})
    sent, expansion = _sequence_advantages(batch)
    assert expansion is not None, name
    assert "advantages" not in sent and sent["sequence_advantages"].shape == (B,)
    spec = dispatched_methods(RoleHost)["update_actor"]
    calls = plan_calls(spec, (sent,), {"per_sequence": expansion}, 4, [0, 0, 1, 1], "RoleHost.update_actor",
                       mini_batch_samples=8)
    for args, kwargs in calls:
        share = args[0]
        assert "advantages" not in share.keys() and share["sequence_advantages"].dim() == 1  # [b] crossed, not [b, S]
        got = _expand_sequence_advantages(share, kwargs["per_sequence"])
        rows = torch.cat([torch.arange(lo, hi) for lo, hi in ShareLayout.from_meta(share.meta[SHARE_META]).rows])
        assert torch.equal(_bits(got["advantages"]), _bits(advantages[rows])), name
        assert "sequence_advantages" not in got


def test_token_level_advantages_are_sent_as_they_are():
    scores, group_ids, mask = _inputs()
    token_rewards = torch.rand(B, S) * mask
    for advantages in (gae(token_rewards, torch.rand(B, S), mask, 1.0, 0.95)[0],
                       reinforce_plus_plus(token_rewards, mask, 0.99)[0]):
        assert per_sequence_advantages(advantages, mask) is None
        batch = Batch({"loss_mask": mask, "advantages": advantages})
        sent, expansion = _sequence_advantages(batch)
        assert expansion is None and sent is batch


def test_a_mask_changed_after_the_advantages_keeps_the_token_tensor():
    """The overlong filter zeroes truncated rows' loss mask after the advantages: expanding over the new mask would
    not reproduce them, so they travel as [B, S]."""
    scores, group_ids, mask = _inputs()
    advantages, _ = grpo(scores=scores, group_ids=group_ids, response_mask=mask)
    filtered = mask.clone()
    filtered[int((advantages != 0).any(-1).nonzero()[0])] = 0
    assert per_sequence_advantages(advantages, filtered) is None
    assert per_sequence_advantages(advantages, mask) is not None


def test_a_rank_asked_to_expand_without_the_values_says_what_to_send():
    batch = Batch({"loss_mask": torch.ones(2, 3, dtype=torch.long), "advantages": torch.rand(2, 3)})
    with pytest.raises(KeyError, match="sequence_advantages"):
        _expand_sequence_advantages(batch, "product")
