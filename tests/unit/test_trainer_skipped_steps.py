"""`trainer.max_skipped_steps`: the trainer's streak of optimizer steps skipped in a row (non-finite loss or gradient
norm), continued across RL steps from the roles' `skipped_steps` / `skipped_trailing` / `optimizer_steps`."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from megarl.trainer.faults import RunAborted
from megarl.trainer.rl_trainer import RLLoop, StepResult


def _host(limit):
    return SimpleNamespace(skip_streak={}, cfg=SimpleNamespace(trainer=SimpleNamespace(max_skipped_steps=limit)))


def _m(steps, skipped, trailing, role="actor"):
    return {f"{role}/optimizer_steps": float(steps), f"{role}/skipped_steps": float(skipped),
            f"{role}/skipped_trailing": float(trailing), f"{role}/grad_norm": float("nan")}


def test_streak_adds_up_over_fully_skipped_updates_and_restarts_after_an_applied_step():
    host = _host(limit=4)
    # (optimizer steps, skipped, trailing) per RL step -> expected streak after it
    cases = [((2, 1, 1), 1),   # [ok, skip]: 1 in a row at the end
             ((2, 2, 2), 3),   # [skip, skip]: continues the previous 1
             ((2, 1, 0), 0),   # [skip, ok]: the ok step ends the streak
             ((1, 1, 1), 1)]
    for step, ((n, s, t), want) in enumerate(cases, 1):
        m = _m(n, s, t)
        RLLoop._count_skips(host, m)
        assert m["actor/skipped_streak"] == want, (step, m)
        RLLoop._check_skips(host, StepResult(step, m))  # below 4: goes on


def test_run_stops_at_the_limit_naming_role_and_key():
    host = _host(limit=2)
    m = _m(1, 1, 1, "critic")
    RLLoop._count_skips(host, m)
    RLLoop._check_skips(host, StepResult(1, m))
    m = _m(1, 1, 1, "critic")
    RLLoop._count_skips(host, m)
    with pytest.raises(RunAborted, match=re.escape(
            "step 2: 2 critic optimizer steps in a row were skipped for a non-finite loss or gradient norm (last "
            "grad_norm nan); stopping at trainer.max_skipped_steps=2")):
        RLLoop._check_skips(host, StepResult(2, m))


def test_roles_without_skip_metrics_are_ignored():
    host = _host(limit=1)
    m = {"actor/loss": 0.5}
    RLLoop._count_skips(host, m)
    RLLoop._check_skips(host, StepResult(1, m))
    assert host.skip_streak == {} and "actor/skipped_streak" not in m
