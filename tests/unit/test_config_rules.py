"""Config rules of megarl/config/validate.py that had no test asserting their message. Each case breaks one rule of
the small valid job in test_config.base() and checks the exact error text (what is wrong, with the offending value,
and what to do). Expected strings are written here by hand from the rule, not read from the code."""

from __future__ import annotations

import pytest

from tests.unit.test_config import base, error, load

CASES = [
    (["actor.enabled=false"], "actor.enabled: the actor is the policy being trained and cannot be disabled"),
    (["rollout.top_p=0"], "rollout.top_p: must be in (0, 1], got 0.0"),  # coerced to float by the loader
    (["rollout.top_p=1.5"], "rollout.top_p: must be in (0, 1], got 1.5"),
    (["rollout.top_k=0"], "rollout.top_k: must be -1 (disabled) or >= 1, got 0"),
    (["algorithm.clip_low=1.0"], "algorithm.clip_low: must be < 1 (ratio >= 1 - clip_low), got 1.0"),
    (["algorithm.gamma=1.5"], "algorithm.gamma: must be in [0, 1], got 1.5"),
    (["algorithm.lam=2.0"], "algorithm.lam: must be in [0, 1], got 2.0"),
    (["actor.optimizer.lr=1e-6", "actor.optimizer.min_lr=1e-5"],
     "actor.optimizer.min_lr=1e-05 is larger than lr=1e-06"),
    (["actor.optimizer.betas=[0.9,1.0]"], "actor.optimizer.betas: each beta must be in [0, 1), got [0.9, 1.0]"),
    (["trainer.val_every=2"], "trainer.val_every=2 needs data.val_path (or set val_every=0)"),
    (["checkpoint.save_every=5"], "checkpoint.save_every=5 needs checkpoint.dir"),
]


def test_base_is_valid(tmp_path):
    load(tmp_path, base())  # every failure below comes from its one override


@pytest.mark.parametrize("overrides,message", CASES, ids=[c[0][-1] for c in CASES])
def test_rule_message(tmp_path, overrides, message):
    assert error(tmp_path, base(), overrides) == message


def test_no_pools(tmp_path):
    data = base()
    data["resources"]["pools"] = {}
    assert error(tmp_path, data) == "resources.pools: at least one pool is needed"
