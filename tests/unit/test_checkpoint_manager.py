"""State that saves itself (`megarl.trainer.checkpoint_manager`): each Stateful of the controller (the RL loop, the
prompt loader, the KL controllers, the process RNG; the schedules': tests/unit/test_schedule.py) through
`state_dict` -> torch.save -> torch.load(weights_only=True) -> a fresh object's `load_state_dict` behaves as the
uninterrupted object does; the manager restores them all from one step directory, writes it atomically (a failure
mid-save leaves no step directory) and refuses an older format. The real run's checkpoints: tests/e2e/test_resume.py
and tests/e2e/test_async_modes.py."""

from __future__ import annotations

import json
import os
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megarl.algorithms.kl_controller import AdaptiveKLController, FixedKLController
from megarl.config import ConfigError
from megarl.data.dataset import PromptLoader, PromptRecord
from megarl.trainer import checkpointing as ck
from megarl.trainer.checkpoint_manager import CONTROLLER_STATE, CheckpointManager, ProcessRNG
from megarl.trainer.rl_trainer import RLLoop, StepResult


def through_checkpoint(state, tmp_path):
    """`state` written with torch.save and read back with weights_only=True (raises on any pickled object)."""
    file = tmp_path / "state.pt"
    torch.save(state, file)
    return torch.load(file, weights_only=True)


def _records(n):
    return [PromptRecord(i, f"{i}+1=", str(i + 1), {}) for i in range(n)]


def _ids(batches):
    return [[r.index for r in b] for b in batches]


# ----------------------------------------------------------------------------------------------- each Stateful
def test_the_loader_resumed_from_its_state_yields_the_uninterrupted_batches(tmp_path):
    """7 records, 3 per step, shuffled: the stream crosses epochs mid-step; the resumed loader's next 5 batches are
    the uninterrupted loader's, and a loader that was not resumed yields other ones (the test can fail)."""
    full = PromptLoader(_records(7), 3, seed=4)
    uninterrupted = _ids(full.next_batch() for _ in range(9))
    first = PromptLoader(_records(7), 3, seed=4)
    [first.next_batch() for _ in range(4)]
    resumed = PromptLoader(_records(7), 3, seed=4)
    resumed.load_state_dict(through_checkpoint(first.state_dict(), tmp_path))
    assert _ids(resumed.next_batch() for _ in range(5)) == uninterrupted[4:]
    assert _ids(PromptLoader(_records(7), 3, seed=4).next_batch() for _ in range(5)) != uninterrupted[4:]


def test_the_adaptive_kl_controller_resumed_gives_the_next_coefficients(tmp_path):
    """Ziegler's controller, KL above the target then below it: after a resume the next coefficients are the
    uninterrupted controller's, computed here by its formula (value *= 1 + clip(kl / target - 1, +-0.2) * n / h)."""
    kls = [9.0, 7.0, 2.0, 3.0, 5.5]
    expected, value = [], 0.1
    for kl in kls:
        value *= 1 + min(max(kl / 6.0 - 1, -0.2), 0.2) * 64 / 1000
        expected.append(value)
    first = AdaptiveKLController(0.1, target=6.0, horizon=1000)
    for kl in kls[:2]:
        first.update(kl, n_steps=64)
    resumed = AdaptiveKLController(0.1, target=6.0, horizon=1000)
    resumed.load_state_dict(through_checkpoint(first.state_dict(), tmp_path))
    got = []
    for kl in kls[2:]:
        resumed.update(kl, n_steps=64)
        got.append(resumed.value)
    assert got == pytest.approx(expected[2:], rel=1e-12)
    assert resumed.value != AdaptiveKLController(0.1, 6.0, 1000).value
    fixed = FixedKLController(0.05)
    back = FixedKLController(0.05)
    back.load_state_dict(through_checkpoint(fixed.state_dict(), tmp_path))
    assert back.value == 0.05 and back.state_dict() == {"value": 0.05}


def test_the_process_rng_resumed_draws_the_same_numbers(tmp_path):
    """Python, numpy and torch draws after a restore repeat the draws made after the save, not the seeded ones."""
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    random.random(), np.random.rand(), torch.rand(1)  # move every generator off its seed
    state = through_checkpoint(ProcessRNG().state_dict(), tmp_path)

    def draws():
        return random.random(), float(np.random.rand()), float(np.random.normal()), float(torch.rand(1))

    after_save = draws()
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    assert draws() != after_save
    ProcessRNG().load_state_dict(state)
    assert draws() == after_save


def test_the_loop_resumed_continues_its_skipped_step_streak(tmp_path):
    """The loop's own state is its skipped-step streak: 2 all-skipped steps saved, then a third after the resume
    reaches trainer.max_skipped_steps=3 and stops the run, as in the uninterrupted one."""
    from megarl.trainer.faults import RunAborted

    def host():
        return SimpleNamespace(skip_streak={}, cfg=SimpleNamespace(trainer=SimpleNamespace(max_skipped_steps=3)))

    skipped = {"actor/skipped_steps": 1.0, "actor/skipped_trailing": 1.0, "actor/optimizer_steps": 1.0}
    first = host()
    for _ in range(2):
        RLLoop._count_skips(first, dict(skipped))
    state = through_checkpoint(RLLoop.state_dict(first), tmp_path)
    assert state == {"skip_streak": {"actor": 2}}
    resumed = host()
    RLLoop.load_state_dict(resumed, state)
    metrics = dict(skipped)
    RLLoop._count_skips(resumed, metrics)
    assert metrics["actor/skipped_streak"] == 3.0
    with pytest.raises(RunAborted, match="3 actor optimizer steps in a row"):
        RLLoop._check_skips(resumed, StepResult(3, metrics))


# ----------------------------------------------------------------------------------------------- the manager
class Shard:
    """A worker group's checkpoint interface (`save_checkpoint` / `load_checkpoint` of a step directory): writes
    `<step_dir>/actor/weights.pt`; `fail_after_write`: raises once its file is written (a rank dying mid-save)."""

    def __init__(self, fail_after_write=False):
        self.fail_after_write = fail_after_write
        self.loaded_from = []

    def save_checkpoint(self, step_dir):
        os.makedirs(os.path.join(step_dir, "actor"))
        torch.save({"w": torch.arange(4.0)}, os.path.join(step_dir, "actor", "weights.pt"))
        if self.fail_after_write:
            raise RuntimeError("actor rank 1 died during the save")
        return ["actor+optimizer"]

    def load_checkpoint(self, step_dir):
        self.loaded_from.append(step_dir)
        assert torch.equal(torch.load(os.path.join(step_dir, "actor", "weights.pt"), weights_only=True)["w"],
                           torch.arange(4.0))
        return ["actor+optimizer"]


def _objects():
    return {"loader": PromptLoader(_records(5), 2, seed=3), "kl": AdaptiveKLController(0.2, 6.0, 100),
            "rng": ProcessRNG()}


def test_the_manager_restores_every_state_and_shard_from_one_step_directory(tmp_path):
    root = str(tmp_path / "ckpt")
    objs = _objects()
    objs["loader"].next_batch()
    objs["kl"].update(9.0, n_steps=10)
    random.seed(5)
    path = CheckpointManager(objs, shards=[Shard()]).save(root, 3, {"config": {"trainer": {"total_steps": 9}}})
    want_batches = _ids(objs["loader"].next_batch() for _ in range(3))
    want_draw = random.random()
    assert path == ck.step_dir(root, 3) and ck.complete_steps(root) == [3]
    assert sorted(os.listdir(path)) == ["actor", CONTROLLER_STATE, "trainer_state.json"]
    assert json.load(open(os.path.join(path, "trainer_state.json"))) == {
        "format": 2, "step": 3, "states": ["loader", "kl", "rng"], "config": {"trainer": {"total_steps": 9}}}
    fresh, shard = _objects(), Shard()
    random.seed(99)
    step, loaded = CheckpointManager(fresh, shards=[shard]).load(path)
    assert (step, loaded, shard.loaded_from) == (3, ["actor+optimizer"], [path])
    assert _ids(fresh["loader"].next_batch() for _ in range(3)) == want_batches
    assert fresh["kl"].value == objs["kl"].value != 0.2
    assert random.random() == want_draw
    with pytest.raises(RuntimeError, match="refusing to overwrite the complete checkpoint"):
        CheckpointManager(objs).save(root, 3)
    with pytest.raises(RuntimeError, match=r"holds no state for \['schedule'\]"):
        CheckpointManager({**_objects(), "schedule": None}).load(path)


@pytest.mark.parametrize("failure", ["a shard", "a state", "unplain state"])
def test_a_failure_mid_save_leaves_no_step_directory(tmp_path, failure):
    """A shard dying after writing its files, a state_dict raising after the shards wrote, or a state that is not
    plain data (it would not load with weights_only=True): no step directory appears, the previous checkpoint stays
    the latest, and the next save removes the leftover and completes."""
    root = str(tmp_path / "ckpt")
    CheckpointManager(_objects(), shards=[Shard()]).save(root, 1)

    class Broken:
        def state_dict(self):
            if failure == "unplain state":
                return {"records": [PromptRecord(0, "p", "a", {})]}
            raise OSError("disk full")

        def load_state_dict(self, state):
            pass

    objs = _objects()
    shards = [Shard(fail_after_write=failure == "a shard")]
    if failure != "a shard":
        objs["broken"] = Broken()
    expected = {"a shard": "actor rank 1 died", "a state": "disk full",
                "unplain state": r"state.broken.records\[0\] is a megarl.data.dataset.PromptRecord, not plain data"}
    with pytest.raises((RuntimeError, OSError, TypeError), match=expected[failure]):
        CheckpointManager(objs, shards=shards).save(root, 2)
    assert sorted(os.listdir(root)) == ["step_000001", "step_000002.tmp-saving"]
    assert ck.complete_steps(root) == [1] and ck.latest(root) == ck.step_dir(root, 1)
    CheckpointManager(_objects(), shards=[Shard()]).save(root, 2)
    assert sorted(os.listdir(root)) == ["step_000001", "step_000002"]
    assert CheckpointManager(_objects(), shards=[Shard()]).load(ck.step_dir(root, 2))[0] == 2


def test_keep_last_prunes_the_oldest_complete_checkpoints(tmp_path):
    root = str(tmp_path / "ckpt")
    manager = CheckpointManager(_objects())
    for step in (1, 2, 3):
        manager.save(root, step, keep_last=2)
    assert ck.complete_steps(root) == [2, 3] and sorted(os.listdir(root)) == ["step_000002", "step_000003"]


def test_a_checkpoint_of_the_older_format_is_refused_before_any_worker_starts(tmp_path):
    """Format 1 (the loader / KL / streak in trainer_state.json, the rollout buffer pickled): refused with what to do,
    by the manager and by the pre-flight check that runs before Ray."""
    root = tmp_path / "ckpt"
    path = ck.step_dir(str(root), 4)
    os.makedirs(os.path.join(path, "actor"))
    ck.write_state(path, {"step": 4, "loader": {"epoch": 0, "position": 2}, "kl_coef": 0.1, "config": None})
    msg = r"checkpoint.dir: .*step_000004 is a checkpoint of an older megarl \(format 1; .* another checkpoint.dir"
    with pytest.raises(ConfigError, match=msg):
        CheckpointManager(_objects()).load(path)
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(dir=str(root), resume=True))
    with pytest.raises(ConfigError, match=msg):
        ck.refuse_breaking_resume(cfg)
