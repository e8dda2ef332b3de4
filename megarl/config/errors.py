"""The one exception type of the config system."""

from __future__ import annotations

import difflib
from typing import Iterable


class ConfigError(ValueError):
    """An invalid job configuration. The message names the key path and, for cross-field rules, the numbers."""


def did_you_mean(name: str, candidates: Iterable[str], prefix: str = "") -> str:
    """" (did you mean '<prefix><x>'?)" for the candidate closest to `name`, or '' when none is close."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean '{prefix}{close[0]}'?)" if close else ""
