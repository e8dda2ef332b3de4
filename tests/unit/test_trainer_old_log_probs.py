"""When the trainer skips the separate old-log-prob forward (`megarl.trainer.rl_trainer.old_log_probs_from_update`):
only for a single optimizer step per RL step with nothing that needs the old log-probs before the update. The
rules are written here from the PPO argument (the update's forward runs on the sampling-time weights only before
its first optimizer step), not read from the code."""

from __future__ import annotations

import pytest

from megarl.trainer.rl_trainer import old_log_probs_from_update, update_reads_rollout_log_probs
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


@pytest.mark.parametrize("overrides,reads", [
    (["actor.mini_batch_prompts=2"], False),  # a separate old-log-prob forward measured the mismatch
    (ONE_STEP, True),  # fused: the update's own forward measures it
    (["actor.mini_batch_prompts=2", "algorithm.rollout_correction.tis=token"], True),  # its weights need them
    (["actor.mini_batch_prompts=2", "algorithm.rollout_correction.mask=token"], True),  # its mask needs them
])
def test_the_update_is_sent_rollout_log_probs_only_when_it_reads_them(tmp_path, overrides, reads):
    """The actor's update reads vLLM's log-probs for a rollout correction or for the mismatch it measures when it
    takes the old log-probs from its own forward; else they are not sent to it (issue 30, item 1, part 3)."""
    assert update_reads_rollout_log_probs(load(tmp_path, base(), overrides)) is reads


def test_worker_threads_share_the_cores_among_every_pools_slots(tmp_path):
    """resources.threads_per_worker: explicit wins; auto = cores // slots of all pools (>= 1); 1 on a joined
    cluster. base(): one pool of 4 slots."""
    from megarl.trainer import worker_threads

    cfg = load(tmp_path, base())
    assert worker_threads(cfg, cores=8) == 2 and worker_threads(cfg, cores=2) == 1
    assert worker_threads(cfg, cores=8, joined_cluster=True) == 1
    assert worker_threads(load(tmp_path, base(), ["resources.threads_per_worker=3"]), cores=2) == 3
    one = load(tmp_path, base(), ["resources.pools.default.devices_per_node=1", "actor.parallel.tp=1",
                                  "rollout.tp=1", "actor.micro_batch_samples=1"])
    assert worker_threads(one, cores=2) == 2  # a single worker gets the whole machine
