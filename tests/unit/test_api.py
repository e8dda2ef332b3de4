"""`megarl.RLTrainer` / `megarl.api.build_config` without starting anything: keyword arguments mean what the same
dotted overrides mean on the command line, and bad ones fail with the CLI's own error (its stderr line)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import megarl
from megarl.api import build_config
from megarl.cli import main
from megarl.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "yaml_configs" / "cpu_quickstart.yaml")


def test_exports():
    from megarl.api import RLTrainer
    from megarl.config.schema import JobConfig

    assert megarl.RLTrainer is RLTrainer and megarl.JobConfig is JobConfig


def test_keyword_arguments_equal_the_cli_overrides(tmp_path):
    cfg, fn = build_config(QUICKSTART, actor={"tp": 2, "lr": 1e-4, "mini_batch_prompts": 8},
                           algorithm={"name": "dr_grpo", "coef": 0.002}, rollout={"max_new_tokens": 16},
                           trainer={"total_steps": 2}, run_dir=str(tmp_path), overrides=["data.shuffle=false"])
    cli = load_config(QUICKSTART, ["actor.parallel.tp=2", "actor.optimizer.lr=1e-4", "actor.mini_batch_prompts=8",
                                   "algorithm.name=dr_grpo", "algorithm.kl.coef=0.002", "rollout.max_new_tokens=16",
                                   "trainer.total_steps=2", f"logging.dir={tmp_path}", "data.shuffle=false"])
    assert cfg == cli and fn is None
    base = load_config(QUICKSTART)
    assert build_config(base)[0] == base  # a resolved JobConfig as the base: validating it again changes nothing
    assert build_config(base, trainer={"total_steps": 3})[0] == load_config(QUICKSTART, ["trainer.total_steps=3"])


@pytest.mark.parametrize("kwargs,override", [
    ({"actor": {"tp": 0}}, "actor.parallel.tp=0"),
    ({"actor": {"tp": 3}}, "actor.parallel.tp=3"),
    ({"actor": {"tp": "two"}}, "actor.parallel.tp=two"),
    ({"actor": {"tpp": 2}}, "actor.tpp=2"),
    ({"rollout": {"temperature": "hot"}}, "rollout.temperature=hot"),
    ({"algorithm": "grpoo"}, "algorithm.name=grpoo"),
    ({"trainer": {"total_steps": 0}}, "trainer.total_steps=0"),
])
def test_errors_are_the_clis(kwargs, override, capsys):
    assert main(["train", QUICKSTART, override]) == 2
    cli_error = capsys.readouterr().err.strip()
    with pytest.raises(ConfigError) as e:
        build_config(QUICKSTART, **kwargs)
    assert f"megarl: error: {e.value}" == cli_error


def test_records_callable_reward_and_nothing_started(tmp_path):
    import ray

    records = [{"prompt": "w1 w2", "answer": "w3"}, {"prompt": "w4", "answer": "w5", "extra": [1, 2]}] * 4
    scale = 2.0

    def reward(response, answer, record):  # a closure: never pickled, it runs on the controller
        return scale * float(response == answer)

    trainer = megarl.RLTrainer(QUICKSTART, reward=reward, train_data=records, val_data=records[:2],
                               trainer={"total_steps": 1}, run_dir=str(tmp_path / "run"))
    try:
        cfg = trainer.config
        assert cfg.reward.function == "python:tests.unit.test_api.test_records_callable_reward_and_nothing_started" \
                                      ".<locals>.reward" and cfg.reward.file is None
        assert trainer._session.reward_fn is reward
        assert cfg.data.train_path == str(tmp_path / "run" / "data" / "train.jsonl")
        assert [json.loads(line) for line in open(cfg.data.train_path)] == records
        assert [json.loads(line) for line in open(cfg.data.val_path)] == records[:2]
        assert not ray.is_initialized()  # construction checks inputs, starts nothing
    finally:
        trainer.close()
    with pytest.raises(ConfigError, match=r"train_data\[1\]: a record is a mapping"):
        build_config(QUICKSTART, train_data=[{"prompt": "a"}, "b"], run_dir=str(tmp_path / "r2"))
    with pytest.raises(ConfigError, match="data.train_path"):
        megarl.RLTrainer(QUICKSTART, train_data=str(tmp_path / "missing.jsonl"), run_dir=str(tmp_path / "r3"))


def test_model_path_replaces_the_inline_arch(tmp_path):
    with pytest.raises(ConfigError) as e:
        build_config(QUICKSTART, model=str(tmp_path / "no_such_model"))
    assert "model" in str(e.value) and "no_such_model" in str(e.value)


def test_a_misspelt_argument_is_named_with_the_closest_one():
    with pytest.raises(ConfigError, match="unknown argument 'trian_data' \\(did you mean 'train_data'\\?\\); "
                                         "RLTrainer takes config, model, reward"):
        build_config(QUICKSTART, trian_data=[])
