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
