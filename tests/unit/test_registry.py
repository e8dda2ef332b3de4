"""megarl.registry.Registry: the one name registry behind the algorithms, rewards, environments and tool-call
parsers."""

from __future__ import annotations

import re

import pytest

from megarl.config.errors import ConfigError
from megarl.registry import Registry


def test_lookup_error_names_the_name_the_closest_match_and_every_name():
    reg = Registry("widget", error=ConfigError, where="job.widget", also="or a file")
    reg.register("sprocket")(len)
    reg.register("gear")(len)
    with pytest.raises(ConfigError, match=re.escape(
            "job.widget: unknown widget 'sprockte' (did you mean 'sprocket'?); valid: gear, sprocket; or a file")):
        reg.get("sprockte")
    assert reg.get("gear") is len and "gear" in reg and list(reg) == ["gear", "sprocket"]


def test_registration_rules():
    reg = Registry("widget function", short="widget")
    reg.register("a")(len)
    reg.register("a")(len)  # the same object again is fine
    reg.register("b", "b2")(len)  # one object, several names (aliases)
    with pytest.raises(ValueError, match=re.escape("widget 'a' is already registered (pass override=True to replace "
                                                   "len)")):
        reg.register("a")(abs)
    assert reg.register("a", override=True)(abs) is abs and reg.get("a") is abs
    with pytest.raises(TypeError, match=re.escape("widget 'c': 3 is not callable")):
        reg.register("c")(3)
    reg.unregister("a")
    reg.unregister("a")
    with pytest.raises(KeyError, match=re.escape("unknown widget function 'a'; valid: b, b2")):
        reg.get("a")
