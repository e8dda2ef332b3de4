"""When the trainer skips the separate old-log-prob forward (`megarl.trainer.rl_trainer.old_log_probs_from_update`):
only for a single optimizer step per RL step with nothing that needs the old log-probs before the update. The
rules are written here from the PPO argument (the update's forward runs on the sampling-time weights only before
its first optimizer step), not read from the code."""

from __future__ import annotations

import pytest

from megarl.trainer.rl_trainer import old_log_probs_from_update
from tests.unit.test_config import base, load

ONE_STEP = ["actor.mini_batch_prompts=4"]  # base(): data.prompts_per_step=4 -> one mini-batch


@pytest.mark.parametrize("overrides,fused", [
    (ONE_STEP, True),
    (["actor.mini_batch_prompts=null"], True),  # the whole step is one mini-batch
    (["actor.mini_batch_prompts=2"], False),  # two optimizer steps: the second is off-policy
    (ONE_STEP + ["algorithm.ppo_epochs=2"], False),  # a second epoch reuses the old log-probs after a step
    (ONE_STEP + ["algorithm.old_log_probs=recompute"], False),  # asked for
    (ONE_STEP + ["algorithm.rollout_correction.tis=token"], False),  # weights from old vs rollout log-probs
    (ONE_STEP + ["algorithm.rollout_correction.mask=sequence"], False),
    (ONE_STEP + ["reference.enabled=true", "reference.parallel.tp=2", "algorithm.name=reinforce_plus_plus",
                 "algorithm.kl.placement=reward", "algorithm.kl.coef=0.01"], False),  # KL in the reward
    (ONE_STEP + ["reference.enabled=true", "reference.parallel.tp=2", "algorithm.kl.placement=loss",
                 "algorithm.kl.coef=0.01"], True),  # KL in the loss needs only the reference's log-probs
])
def test_fused_only_for_one_optimizer_step_with_nothing_needing_them_first(tmp_path, overrides, fused):
    assert old_log_probs_from_update(load(tmp_path, base(), overrides)) is fused
