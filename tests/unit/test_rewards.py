"""Rewards: registry (closest-name suggestion), built-ins on hand-written cases, batch scoring errors, user files."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from megarl.data.dataset import PromptRecord
from megarl.rewards import (
    RewardError,
    build_reward_fn,
    extract_number,
    get_reward,
    list_rewards,
    load_reward_file,
    register_reward,
    score_batch,
)
from megarl.rewards.registry import REWARDS


def test_registry_builtins_and_typo_suggestion():
    assert {"exact_match", "gsm8k", "token_fraction"} <= set(list_rewards())
    with pytest.raises(
        KeyError, match=re.escape("unknown reward function 'gms8k' (did you mean 'gsm8k'?); valid: ")
    ):
        get_reward("gms8k")
    with pytest.raises(KeyError, match=re.escape("unknown reward function 'zzz'; valid:")):
        get_reward("zzz")


def test_register_reward_and_duplicates():
    try:
        @register_reward("test_len")
        def f(text, answer, record):
            return len(text)

        assert get_reward("test_len") is f
        with pytest.raises(ValueError, match=re.escape("reward 'test_len' is already registered (pass override=True")):
            register_reward("test_len")(lambda t, a, r: 0.0)
        g = register_reward("test_len", override=True)(lambda t, a, r: 1.0)
        assert get_reward("test_len") is g
        with pytest.raises(TypeError, match=re.escape("reward 'x': 3 is not callable")):
            register_reward("x")(3)
    finally:
        REWARDS.unregister("test_len")


@pytest.mark.parametrize(
    "response, answer, want",
    [("  Paris ", "paris", 1.0), ("New   York", "new york", 1.0), ("Paris.", "Paris", 0.0), ("x", None, 0.0),
     ("4", 4, 1.0)],
)
def test_exact_match(response, answer, want):
    assert get_reward("exact_match")(response, answer, {}) == want


@pytest.mark.parametrize(
    "text, want",
    [
        ("Natalia sold 48/2 = 24 clips.\n#### 72", 72.0),
        ("#### 42", 42.0),
        ("the answer is 3.5", 3.5),
        ("the answer is 3.5.", 3.5),
        ("It costs $1,000 in total", 1000.0),
        ("#### 1,234,567", 1234567.0),
        ("the temperature fell to -7 degrees", -7.0),
        ("#### -12.5", -12.5),
        ("first 3 then 5 finally 8", 8.0),
        ("#### 10 apples, not 11", 10.0),
        ("no number here", None),
        ("#### none, but earlier 6", 6.0),
        (".5 of it", 0.5),
    ],
)
def test_extract_number(text, want):
    assert extract_number(text) == want


@pytest.mark.parametrize(
    "response, answer, want",
    [
        ("#### 42", "Janet ... #### 42", 1.0),
        ("So the answer is 42.", "#### 42", 1.0),
        ("the answer is 3.5", "#### 3.5", 1.0),
        ("The total is 1,000 dollars", "#### 1000", 1.0),
        ("#### 1000.0", "#### 1,000", 1.0),
        ("The change is -3", "#### -3", 1.0),
        ("The change is 3", "#### -3", 0.0),
        ("#### 41", "#### 42", 0.0),
        ("I don't know", "#### 42", 0.0),
        ("#### 42", None, 0.0),
        ("#### 42", "no number", 0.0),
    ],
)
def test_gsm8k(response, answer, want):
    assert get_reward("gsm8k")(response, answer, {}) == want


def test_token_fraction():
    fn = get_reward("token_fraction")
    assert fn("w3 w4 w9 w9", "w3 w4 w5", {}) == 0.5
    assert fn("w3 w4", None, {"targets": ["w3"]}) == 0.5
    assert fn("", "w3", {}) == 0.0 and fn("w3", None, {}) == 0.0


def test_score_batch_records_and_dicts():
    recs = [PromptRecord(0, "p", "#### 2", {"prompt": "p", "answer": "#### 2"}), {"prompt": "q", "sol": "#### 3"}]
    assert score_batch(get_reward("gsm8k"), ["2", "3"], recs, answer_key="sol") == [1.0, 1.0]
    assert score_batch(lambda t, a, r: True, ["x"], [{}]) == [1.0]


def test_score_batch_errors_name_the_record():
    recs = [PromptRecord(5, "p", None, {}), PromptRecord(9, "q", None, {})]

    def boom(text, answer, record):
        if text == "bad":
            raise ZeroDivisionError("division by zero")
        return 1.0

    with pytest.raises(RewardError, match=re.escape(
            "reward function 'boom' raised on response 1 (dataset record 9): ZeroDivisionError: division by zero")):
        score_batch(boom, ["ok", "bad"], recs)
    with pytest.raises(RewardError, match=re.escape(
            "reward function '<lambda>' returned None on response 0 (dataset record 5); expected a finite float")):
        score_batch(lambda t, a, r: None, ["x", "y"], recs)
    with pytest.raises(RewardError, match=re.escape("returned nan on response 0; expected a finite float")):
        score_batch(lambda t, a, r: float("nan"), ["x"], [{}])
    with pytest.raises(ValueError, match=re.escape("score_batch: 1 responses but 2 records")):
        score_batch(boom, ["x"], recs)


# ------------------------------------------------------------------------------------------------ user file
def test_load_reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("LIMIT = 3\n\ndef short(text, answer, record):\n    return float(len(text.split()) <= LIMIT)\n")
    fn = load_reward_file(str(path), "short")
    assert fn("a b", None, {}) == 1.0 and fn("a b c d", None, {}) == 0.0
    assert build_reward_fn(SimpleNamespace(file=str(path), function="short"))("a", None, {}) == 1.0
    assert build_reward_fn(SimpleNamespace(file=None, function="gsm8k")) is get_reward("gsm8k")
    with pytest.raises(
        AttributeError, match=re.escape(f"reward file '{path}' defines no 'shrt'; its callables: ['short']")
    ):
        load_reward_file(str(path), "shrt")
    with pytest.raises(TypeError, match=re.escape(f"'LIMIT' in reward file '{path}' is not callable (it is a int)")):
        load_reward_file(str(path), "LIMIT")


def test_load_reward_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(f"reward file '{tmp_path}/nope.py' does not exist")):
        load_reward_file(str(tmp_path / "nope.py"), "f")
    txt = tmp_path / "r.txt"
    txt.write_text("")
    with pytest.raises(ValueError, match=re.escape(f"reward file '{txt}' must be a Python file (.py)")):
        load_reward_file(str(txt), "f")
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_xyz\n")
    with pytest.raises(ImportError, match=re.escape(
            f"reward file '{broken}' failed to import: ModuleNotFoundError: No module named 'not_a_module_xyz'")):
        load_reward_file(str(broken), "f")
