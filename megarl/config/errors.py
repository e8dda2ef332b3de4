"""The one exception type of the config system."""

from __future__ import annotations

from megarl.registry import did_you_mean as did_you_mean  # re-exported: config's messages suggest with it


class ConfigError(ValueError):
    """An invalid job configuration. The message names the key path and, for cross-field rules, the numbers."""
