"""The judge's pure pieces (`megarl.rollout.judge`): template checks, parsers, the two-way softmax, and the config
rules of `reward.judge` (`megarl.config.validate`). The engine-backed judge: tests/distributed/test_judge.py."""

from __future__ import annotations

import dataclasses
import math

import pytest

from megarl.config.errors import ConfigError
from megarl.rollout.judge import (
    JudgeTemplateError,
    load_template,
    parse_number,
    parse_verdict,
    question_text,
    yes_probability,
)


def test_template_placeholders_are_checked(tmp_path):
    assert load_template("Q {question} A {response}") == "Q {question} A {response}"
    assert load_template("{transcript}\n{response}") == "{transcript}\n{response}"
    f = tmp_path / "t.txt"
    f.write_text("{response} vs {reference} {{literal}}")
    assert load_template(f"@{f}") == "{response} vs {reference} {{literal}}"
    with pytest.raises(JudgeTemplateError, match=r"unknown placeholder.*'answer'"):
        load_template("{question} {answer}")
    with pytest.raises(JudgeTemplateError, match="no {response}"):
        load_template("{question}")
    with pytest.raises(JudgeTemplateError, match="cannot read the template file"):
        load_template(f"@{tmp_path}/missing.txt")
    with pytest.raises(JudgeTemplateError, match="literal braces"):
        load_template("{response} {")


def test_parse_number_first_number_in_range():
    assert parse_number("Score: 7/10", 0, 10) == 7.0
    assert parse_number("I give it -0.5 then 3", -1, 1) == -0.5
    assert parse_number("about 12.5 points", 0, 10) is None  # the first number is out of range
    assert parse_number("no digits here", 0, 10) is None


def test_parse_verdict_first_verdict_word():
    verdicts = {"Correct": 1.0, "incorrect": 0.0}
    assert parse_verdict("The answer is INCORRECT, not correct.", verdicts) == 0.0
    assert parse_verdict("correct.", verdicts) == 1.0
    assert parse_verdict("maybe", verdicts) is None


def test_yes_probability_is_the_two_way_softmax():
    assert yes_probability(math.log(0.3), math.log(0.1)) == pytest.approx(0.75, abs=1e-12)
    assert yes_probability(-1000.0, 0.0) == pytest.approx(0.0, abs=1e-300)  # no overflow
    assert yes_probability(0.0, -1000.0) == 1.0


def test_question_text_of_chat_prompts():
    assert question_text("1+1=") == "1+1="
    assert question_text([{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2="}]) == "2+2="


def _cfg(**judge):
    import os

    import yaml

    from megarl.config.loader import parse_config

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    raw = yaml.safe_load(open(os.path.join(root, "yaml_configs", "cpu_quickstart.yaml")))
    raw["resources"]["pools"]["judge"] = {"nodes": 1, "devices_per_node": 2}
    raw["reward"] = {"judge": {"model": "/judge", "pool": "judge", **judge}}
    return parse_config(raw)


@pytest.mark.parametrize("judge, message", [
    ({"pool": "nope"}, "reward.judge.pool: unknown pool 'nope'"),
    ({"pool": "default"}, "reward.judge.pool: pool 'default' also hosts the actor"),
    ({"tp": 4}, "reward.judge.tp=4 does not divide the 2 devices"),
    ({"template": "{question}"}, "reward.judge.template: the template has no {response}"),
    ({"parse": "verdict"}, "reward.judge.verdicts: parse=verdict needs"),
    ({"parse": "number", "score_range": [5, 1]}, "reward.judge.score_range: low must be below high"),
    ({"yes_no": ["Yes", "Yes"]}, "reward.judge.yes_no: two different"),
    ({"weight": 0.0}, "reward.judge: weight and function_weight are both 0"),
    ({"function_weight": float("nan")}, "reward.judge.function_weight: a finite number is needed"),
    ({"template": "{response} {transcripts}"}, "unknown placeholder(s) ['transcripts']"),
])
def test_config_errors_name_the_key(judge, message):
    from megarl.config.validate import validate

    with pytest.raises(ConfigError) as e:
        validate(_cfg(**judge))
    assert message in str(e.value)


def test_judge_on_another_roles_pool_is_refused_saying_why():
    """Colocation with a role's pool: refused, naming the role and why (one worker group per pool's devices; the
    judge serves through the whole rollout phase)."""
    from megarl.config.validate import validate

    raw_cfg = _cfg()
    with pytest.raises(ConfigError) as e:
        validate(dataclasses.replace(raw_cfg, reference=dataclasses.replace(raw_cfg.reference, pool="judge")))
    assert "also hosts the reference (reference.pool)" in str(e.value)
    assert "Colocation is not supported" in str(e.value) and "whole rollout phase" in str(e.value)


def test_multi_turn_runs_take_a_judge():
    """rollout.env with reward.judge validates (its episodes' final turns are judged, tests/distributed)."""
    from megarl.config.validate import validate

    cfg = _cfg(template="{transcript} => {response}", function_weight=0.5)
    cfg = validate(dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, env="calculator"),
                                       data=dataclasses.replace(cfg.data, chat_template="hf")))
    assert cfg.reward.judge.function_weight == 0.5 and cfg.rollout.env == "calculator"


def test_a_valid_judge_config_passes():
    from megarl.config.validate import validate

    cfg = validate(_cfg(parse="verdict", verdicts={"good": 1.0, "bad": 0.0}, max_concurrent=4))
    assert cfg.reward.judge.verdicts == {"good": 1.0, "bad": 0.0} and cfg.reward.judge.max_concurrent == 4


def test_judge_model_checked_before_workers_start(tmp_path):
    """The session's start-up check of reward.judge.model: an HF dir, a chat template, distinct yes/no tokens."""
    from megarl.config.schema import JudgeConfig
    from megarl.data.chat_bpe import build_chat_bpe_tokenizer
    from megarl.trainer.session import load_judge_tokenizer

    with pytest.raises(ConfigError, match="not an HF model directory"):
        load_judge_tokenizer(JudgeConfig(model=str(tmp_path), pool="judge"))
    tokenizer = build_chat_bpe_tokenizer(str(tmp_path), 300)
    (tmp_path / "config.json").write_text("{}")
    assert load_judge_tokenizer(JudgeConfig(model=str(tmp_path), pool="judge")).chat_template
    with pytest.raises(ConfigError, match=r"\['Yes', 'Yeah'\] start with the same token"):
        load_judge_tokenizer(JudgeConfig(model=str(tmp_path), pool="judge", yes_no=("Yes", "Yeah")))
    tokenizer.chat_template = None
    tokenizer.save_pretrained(str(tmp_path))
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ConfigError, match="has no chat template"):
        load_judge_tokenizer(JudgeConfig(model=str(tmp_path), pool="judge"))
