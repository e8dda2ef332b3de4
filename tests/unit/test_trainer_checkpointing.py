"""Trainer checkpoint bookkeeping: only complete step directories count; pruning keeps the newest."""

import os

from megarl.trainer import checkpointing as ck


def _complete(root, step):
    path = ck.step_dir(str(root), step)
    os.makedirs(os.path.join(path, "actor"))
    ck.write_state(path, {"step": step})
    return path


def test_incomplete_saves_are_never_resumed(tmp_path):
    _complete(tmp_path, 2)
    os.makedirs(ck.step_dir(str(tmp_path), 4) + "/actor")  # crashed before trainer_state.json
    (tmp_path / "notes").mkdir()
    assert ck.complete_steps(str(tmp_path)) == [2]
    assert ck.latest(str(tmp_path)).endswith("step_000002")
    assert ck.read_state(ck.latest(str(tmp_path))) == {"step": 2}
    assert ck.latest(str(tmp_path / "missing")) is None


def test_prune_keeps_newest_complete(tmp_path):
    for s in (1, 2, 3):
        _complete(tmp_path, s)
    assert ck.prune(str(tmp_path), keep_last=2) == [1]
    assert ck.complete_steps(str(tmp_path)) == [2, 3]
    assert ck.prune(str(tmp_path), keep_last=0) == []


def test_state_write_leaves_no_temporary(tmp_path):
    path = _complete(tmp_path, 7)
    assert sorted(os.listdir(path)) == ["actor", "trainer_state.json"]


def test_a_new_run_refuses_to_overwrite_an_earlier_runs_checkpoints(tmp_path):
    import pytest

    from megarl.config import ConfigError, load_config
    from megarl.trainer import run

    _complete(tmp_path, 5)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = load_config(os.path.join(root, "yaml_configs", "cpu_quickstart.yaml"),
                      [f"checkpoint.dir={tmp_path}", "checkpoint.resume=false", f"logging.dir={tmp_path / 'run'}",
                       f"data.train_path={root}/data/quickstart/train.jsonl",
                       f"data.val_path={root}/data/quickstart/val.jsonl",
                       f"model.tokenizer={root}/data/quickstart/tokenizer"])
    with pytest.raises(ConfigError, match=r"checkpoint.dir: .* holds checkpoints of an earlier run \(steps \[5\]\)"):
        run(cfg)  # refused before any Ray worker starts
    assert ck.complete_steps(str(tmp_path)) == [5]


# ----------------------------------------------------------------------------------------------- config changes
def _cfg(*overrides):
    from megarl.config import load_config

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return load_config(os.path.join(root, "yaml_configs", "cpu_quickstart.yaml"), list(overrides))


def test_config_changes_are_named_and_classified():
    saved = ck.config_record(_cfg())
    now = _cfg("trainer.total_steps=40", "logging.dir=/tmp/x", "actor.parallel.tp=1", "actor.parallel.pp=2",
               "algorithm.clip_low=0.3", "actor.offload.params=true")
    changes = {k: (a, b) for k, a, b in ck.config_changes(saved, ck.config_record(now))}
    assert changes == {"trainer.total_steps": (20, 40), "logging.dir": ("runs/cpu_quickstart", "/tmp/x"),
                       "actor.parallel.tp": (2, 1), "actor.parallel.pp": (1, 2), "algorithm.clip_low": (0.2, 0.3),
                       "actor.offload.params": (False, True)}
    rec = ck.config_record(now)
    kinds = {k: ck.change_kind(k, rec) for k in changes}
    assert kinds == {"trainer.total_steps": "neutral", "logging.dir": "neutral", "actor.parallel.tp": "layout",
                     "actor.parallel.pp": "layout", "algorithm.clip_low": "breaking", "actor.offload.params": "neutral"}
    # a cosine schedule's decay length is trainer.total_steps x optimizer steps per RL step: no longer neutral
    cosine = ck.config_record(_cfg("actor.optimizer.lr_schedule=cosine"))
    assert ck.change_kind("trainer.total_steps", cosine) == "breaking"


def test_resume_refuses_breaking_changes_unless_allowed():
    import pytest

    from megarl.config import ConfigError

    saved = ck.config_record(_cfg())
    assert ck.check_resume_config(saved, _cfg("trainer.total_steps=4", "checkpoint.keep_last=5"), "step_2") == [
        "config change since step_2: checkpoint.keep_last: 2 -> 5 (neutral)",
        "config change since step_2: trainer.total_steps: 20 -> 4 (neutral)",
    ]
    with pytest.raises(ConfigError) as e:
        ck.check_resume_config(saved, _cfg("algorithm.clip_low=0.3", "rollout.temperature=0.7"), "step_2")
    msg = str(e.value)
    assert msg.startswith("checkpoint.allow_config_change: resuming from step_2 with config changes")
    assert "algorithm.clip_low: 0.2 -> 0.3; rollout.temperature: 1.0 -> 0.7" in msg
    assert "set checkpoint.allow_config_change=true" in msg
    lines = ck.check_resume_config(saved, _cfg("algorithm.clip_low=0.3", "checkpoint.allow_config_change=true"),
                                   "step_2")
    assert "config change since step_2: algorithm.clip_low: 0.2 -> 0.3 (breaking)" in lines
    assert ck.check_resume_config(None, _cfg(), "step_2") == [
        "step_2 records no config (an older checkpoint): changes since cannot be checked"]


def test_a_breaking_resume_is_refused_before_any_worker_starts(tmp_path):
    """`megarl train` with a checkpoint whose recorded config differs in an exactness-breaking key fails in the
    session's constructor (no Ray, no workers: the CLI maps ConfigError to exit 2), naming the key."""
    import pytest

    from megarl.config import ConfigError
    from megarl.trainer.session import TrainingSession

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    common = [f"checkpoint.dir={tmp_path / 'ckpt'}", f"logging.dir={tmp_path / 'run'}",
              f"data.train_path={root}/data/quickstart/train.jsonl", f"data.val_path={root}/data/quickstart/val.jsonl",
              f"model.tokenizer={root}/data/quickstart/tokenizer"]
    from megarl.trainer.checkpoint_manager import CheckpointManager

    CheckpointManager(states={}).save(str(tmp_path / "ckpt"), 2, {"config": ck.config_record(_cfg(*common))})
    with pytest.raises(ConfigError, match=r"algorithm.clip_low: 0.2 -> 0.1"):
        TrainingSession(_cfg(*common, "algorithm.clip_low=0.1"))
    import ray

    assert not ray.is_initialized()
    assert ck.complete_steps(str(tmp_path / "ckpt")) == [2]
