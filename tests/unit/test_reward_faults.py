"""Reward faults: `reward.on_error` (raise | zero), `reward.max_error_fraction`, `reward.timeout_s`, with hand-written
failing reward functions; and the producer's `scores` applying them to a step's samples."""

from __future__ import annotations

import re
import threading
from types import SimpleNamespace

import pytest

from megarl.config.errors import ConfigError
from megarl.data.dataset import PromptRecord
from megarl.rewards import RewardError, check_failures, score_responses


def _recs(n):
    return [PromptRecord(100 + i, f"p{i}", None, {}) for i in range(n)]


def flaky(text, answer, record):
    """Raises on 'bad', returns nan on 'nan', None on 'none', else the text's length."""
    if text == "bad":
        raise KeyError("missing field")
    if text == "nan":
        return float("nan")
    if text == "none":
        return None
    return float(len(text))


def test_raise_names_the_response_and_record():
    with pytest.raises(RewardError, match=re.escape(
            "reward function 'flaky' raised on response 2 (dataset record 102): KeyError: 'missing field' "
            "(reward.on_error=zero")):
        score_responses(flaky, ["a", "bb", "bad"], _recs(3))


def test_zero_scores_failures_0_and_counts_them():
    out = score_responses(flaky, ["a", "bad", "nan", "ccc", "none"], _recs(5), on_error="zero")
    assert out.scores == [1.0, 0.0, 0.0, 3.0, 0.0]
    assert [(f.index, f.kind) for f in out.failures] == [(1, "error"), (2, "invalid"), (4, "invalid")]
    assert out.failures[0].where == "response 1 (dataset record 101)"
    assert out.failures[1].message == "returned nan; expected a finite float"
    assert out.metrics() == {"reward/errors": 3.0, "reward/timeouts": 0.0, "reward/error_frac": 0.6}


def test_max_error_fraction_is_a_strict_bound():
    out = score_responses(flaky, ["a", "bad", "b", "c"], _recs(4), on_error="zero")  # 1 of 4 = 25 %
    check_failures(out, 0.25, "step 7")  # not more than 25 %: goes on
    with pytest.raises(RewardError, match=re.escape(
            "1 of 4 reward calls failed in step 7 (25.0% > reward.max_error_fraction=0.2): "
            "response 1 (dataset record 101): error: KeyError: 'missing field'")):
        check_failures(out, 0.2, "step 7")
    check_failures(score_responses(flaky, ["a"], _recs(1), on_error="zero"), 0.0)  # no failure, bound 0: fine


def test_timeout_abandons_a_slow_call_and_goes_on():
    release = threading.Event()
    calls, finished = [], []

    def slow_on_x(text, answer, record):
        calls.append(text)
        if text == "x":
            release.wait(30.0)  # blocks until the test releases it: only the deadline can end the wait for it
            finished.append(text)
            return 99.0
        return 1.0

    out = score_responses(slow_on_x, ["a", "x", "b"], _recs(3), on_error="zero", timeout_s=0.2)
    # scoring returned while the slow call was still blocked: it was abandoned, not waited for (no clock involved)
    still_running = not finished
    release.set()
    assert still_running
    assert out.scores == [1.0, 0.0, 1.0]  # the late 99.0 is dropped; 'b' ran on a fresh worker thread
    assert [(f.index, f.kind) for f in out.failures] == [(1, "timeout")]
    assert out.failures[0].message == "did not return within reward.timeout_s=0.2 s"
    assert out.metrics()["reward/timeouts"] == 1.0
    assert calls == ["a", "x", "b"]
    with pytest.raises(RewardError, match=re.escape(
            "reward function 'slow_on_x' timed out on response 0 (dataset record 100): did not return within "
            "reward.timeout_s=0.05 s")):
        release.clear()
        score_responses(slow_on_x, ["x"], _recs(1), timeout_s=0.05)
    release.set()


def test_timeout_passes_results_and_exceptions_through():
    out = score_responses(flaky, ["ab", "bad"], _recs(2), on_error="zero", timeout_s=5.0)
    assert out.scores == [2.0, 0.0] and out.failures[0].message == "KeyError: 'missing field'"
    with pytest.raises(ValueError, match=re.escape("timeout_s must be > 0 seconds, got 0")):
        score_responses(flaky, ["a"], _recs(1), timeout_s=0)
    with pytest.raises(ValueError, match=re.escape("reward.on_error must be one of ('raise', 'zero'), got 'skip'")):
        score_responses(flaky, ["a"], _recs(1), on_error="skip")


def test_trainer_scores_apply_the_config():
    import torch

    from megarl.config.schema import RewardConfig
    from megarl.trainer.producer import BatchProducer

    samples = [SimpleNamespace(prompt_index=p, response_ids=ids) for p, ids in ((0, [1]), (0, [2]), (1, [3]), (1, [1]))]
    words = {1: "a", 2: "bad", 3: "ccc"}
    host = SimpleNamespace(encoder=SimpleNamespace(decode=lambda ids: words[ids[0]]), reward_fn=flaky,
                           cfg=SimpleNamespace(reward=RewardConfig(on_error="zero", max_error_fraction=0.25)))
    scores, metrics = BatchProducer.scores(host, samples, _recs(2), "step 3")
    assert torch.equal(scores, torch.tensor([1.0, 0.0, 3.0, 1.0]))
    assert metrics == {"reward/errors": 1.0, "reward/timeouts": 0.0, "reward/error_frac": 0.25}
    host.cfg = SimpleNamespace(reward=RewardConfig(on_error="zero", max_error_fraction=0.2))
    with pytest.raises(RewardError, match=re.escape("1 of 4 reward calls failed in step 3 (25.0% > ")):
        BatchProducer.scores(host, samples, _recs(2), "step 3")
    host.cfg = SimpleNamespace(reward=RewardConfig())  # default: raise
    with pytest.raises(RewardError, match=re.escape("raised on response 1 (dataset record 100)")):
        BatchProducer.scores(host, samples, _recs(2), "step 3")


@pytest.mark.parametrize("override, message", [
    ("reward.max_error_fraction=1.5", "reward.max_error_fraction: a fraction in [0, 1], got 1.5"),
    ("reward.timeout_s=0", "reward.timeout_s: must be > 0 seconds (null = no deadline), got 0"),
    ("reward.on_error=skip", "reward.on_error"),
])
def test_config_rules(override, message):
    from megarl.config import load_config
    from megarl.config.validate import validate

    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(load_config("yaml_configs/cpu_quickstart.yaml", [override]))
