"""Checks that a `megarl train` run's critic was trained and, on its own pool, updated while the actor did.

For the e2e tests of `test_quickstart.py` (PPO with a colocated critic; the critic on its own pool with a reward
model), which otherwise check only that the critic's metrics are finite. Call them on the run's metrics rows
(`metrics.jsonl`) and, for the weights, on a checkpoint directory the run saved with `checkpoint_overrides(dir)`.

Not checked: that the value loss falls. Measured on those two runs as they are (3 steps, critic lr 1e-3), the
value loss per step was 0.496, 1.212, 0.782 (colocated) and 0.800, 1.666, 3.046 (own pool, reward-model scores),
with the critic's gradient norm rising 12 -> 59 -> 103 and its value mean 0.13 -> 2.16 against returns in [0, 1]:
at that learning rate the critic overshoots, and each step's loss is on a new batch anyway. (One update lowering
the loss on the same batch is checked in tests/distributed/test_roles.py::test_critic_update_lowers_value_loss.)

The overlap is read from durations (no clock is compared across processes): the trainer submits the critic's
update (`critic.update_critic.submit`, megarl/trainer/rl_trainer.py), starts the actor's right after, then waits
for the critic (`time/update_critic_wait_s`); the critic measured its own update as `critic/time_s`
(megarl/roles/base.py). It ended at the latest when the wait ended, and it started no earlier than the actor's
update did, so at least `critic/time_s - time/update_critic_wait_s` seconds of it ran during the actor's update.
A critic updated after the actor's update (blocking, or submitted late) gives wait >= critic/time_s and fails.
Blind spot: the second premise is the code's order. A controller that waited for the critic *before* starting the
actor's update would show a zero wait and pass; telling that apart needs start/end timestamps of both phases,
which the metrics do not carry.
"""

from __future__ import annotations

import os

import torch


def checkpoint_overrides(ckpt_dir) -> list[str]:
    """`megarl train` overrides that keep a checkpoint after every step (actor and critic weights, Adam moments)."""
    return [f"checkpoint.dir={ckpt_dir}", "checkpoint.save_every=1", "checkpoint.keep_last=0"]


def _critic_weights(step_dir: str) -> dict[str, torch.Tensor]:
    from tests.distributed.harness import read_dcp  # plain torch.distributed.checkpoint, no megarl

    tensors = read_dcp(os.path.join(step_dir, "critic"))
    return {k: v for k, v in tensors.items() if not k.startswith("optimizer.")}


def assert_critic_weights_changed(ckpt_dir, first: int, last: int, min_change: float = 1e-4) -> dict[str, float]:
    """The critic's weights in the step-`last` checkpoint moved from the step-`first` one's by more than
    `min_change` somewhere in the value head (`output_layer.score.weight`) and somewhere in the body, and are finite.
    `ckpt_dir`: saved with `checkpoint_overrides` (read with plain torch.distributed.checkpoint). Returns the largest
    |change| of the head and of the body.

    Why a threshold and not `> 0`: the critic's decoupled weight decay moves every weight by lr * wd * |w| per step
    even with a zero gradient (measured with the critic's loss multiplied by 0, steps 1 -> 3 of the own-pool run:
    4.7e-6 head, 2.0e-6 body), while Adam's steps move weights by up to ~lr each (measured: 2.0e-3 head and body at
    critic lr 1e-3). 1e-4 sits 20x above the first and 20x below the second."""
    before = _critic_weights(os.path.join(ckpt_dir, f"step_{first:06d}"))
    after = _critic_weights(os.path.join(ckpt_dir, f"step_{last:06d}"))
    assert sorted(before) == sorted(after) and before
    assert all(torch.isfinite(v).all() for v in after.values())
    change = {k: (after[k].double() - before[k].double()).abs().max().item() for k in before}
    heads = [k for k in change if k.endswith("score.weight")]
    assert heads, sorted(change)
    head = max(change[k] for k in heads)
    body = max(v for k, v in change.items() if k not in heads)
    assert head > min_change and body > min_change, (
        f"critic weights (nearly) unchanged from step {first} to {last}: max |change| head {head:.3g}, body {body:.3g}")
    return {"head": head, "body": body}


def assert_critic_update_overlaps_actor(rows: list[dict], min_overlap_frac: float = 0.2) -> list[float]:
    """Critic on its own pool: at every step, at least `min_overlap_frac` of the critic's own update time ran while
    the actor's update ran (module docstring: overlap >= critic/time_s - time/update_critic_wait_s). Returns each
    step's overlap fraction."""
    fracs = []
    for r in rows:
        assert "time/update_critic_wait_s" in r, "the critic was not updated on its own pool (no wait measured)"
        own, wait = r["critic/time_s"], r["time/update_critic_wait_s"]
        fracs.append((own - wait) / own)
    assert all(f >= min_overlap_frac for f in fracs), (
        f"critic update overlap per step {fracs}: critic/time_s {[r['critic/time_s'] for r in rows]}, "
        f"time/update_critic_wait_s {[r['time/update_critic_wait_s'] for r in rows]}, "
        f"time/update_actor_s {[r.get('time/update_actor_s') for r in rows]}")
    return fracs
