"""`algorithm.rollout_correction`: defaults, overrides, the rules of `megarl.config.validate` (each message), and
what the actor's loss settings receive."""

from __future__ import annotations

import os

import pytest

from megarl.config import ConfigError, load_config
from megarl.roles.actor import PolicyLossSettings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICKSTART = os.path.join(ROOT, "yaml_configs", "cpu_quickstart.yaml")
KEY = "algorithm.rollout_correction"


def load(*overrides):
    return load_config(QUICKSTART, list(overrides))


def test_off_by_default_for_the_synchronous_trainer():
    rc = load().algorithm.rollout_correction
    assert (rc.tis, rc.c, rc.mask, rc.mask_c) == ("off", 2.0, "off", None)
    loss = PolicyLossSettings.from_config(load().algorithm)
    assert not loss.corrects_rollout


def test_overrides_reach_the_actor_loss_settings():
    cfg = load(f"{KEY}.tis=sequence", f"{KEY}.c=3", f"{KEY}.mask=token", f"{KEY}.mask_c=5")
    loss = PolicyLossSettings.from_config(cfg.algorithm)
    assert (loss.rollout_tis, loss.rollout_c, loss.rollout_mask, loss.rollout_mask_c) == ("sequence", 3.0, "token", 5.0)
    assert loss.corrects_rollout
    assert PolicyLossSettings.from_config(load(f"{KEY}.mask=sequence").algorithm).corrects_rollout


@pytest.mark.parametrize("overrides, message", [
    ([f"{KEY}.c=1"], f"{KEY}.c: the ratio bound must be > 1 (band [1/c, c]), got 1.0"),
    ([f"{KEY}.c=0.5", f"{KEY}.tis=token"], f"{KEY}.c: the ratio bound must be > 1"),
    ([f"{KEY}.mask_c=3"], f"{KEY}.mask_c=3.0 has no effect with mask=off"),
    ([f"{KEY}.mask=token", f"{KEY}.mask_c=1"], f"{KEY}.mask_c: the mask band [1/mask_c, mask_c] needs mask_c > 1"),
])
def test_rules_name_the_key_and_the_value(overrides, message):
    with pytest.raises(ConfigError) as e:
        load(*overrides)
    assert message in str(e.value)


def test_unknown_modes_are_refused_with_the_valid_ones():
    with pytest.raises(ConfigError) as e:
        load(f"{KEY}.tis=tokens")
    assert f"{KEY}.tis" in str(e.value) and "token" in str(e.value) and "sequence" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load(f"{KEY}.truncate=2")
    assert "truncate" in str(e.value)
