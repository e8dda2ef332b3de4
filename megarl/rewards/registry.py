"""The reward-function registry: name -> `fn(response_text, answer, record) -> float`.

`reward.function` in the job config names a registered function (built-ins in `megarl.rewards.builtin`) unless
`reward.file` points at a user Python file (`megarl.rewards.user.load_reward_file`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

from megarl.config.errors import did_you_mean


class RewardFn(Protocol):
    def __call__(self, response_text: str, answer: Optional[Any], record: dict[str, Any]) -> float:
        """Score one decoded response (special tokens removed, stripped). `answer` is the record's answer key
        value or None; `record` is the whole dataset record."""


_REGISTRY: dict[str, RewardFn] = {}


def register_reward(name: str, *, override: bool = False) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register `fn` under `name`. Registering a taken name is an error unless `override=True`."""

    def deco(fn: RewardFn) -> RewardFn:
        if not callable(fn):
            raise TypeError(f"reward {name!r}: {fn!r} is not callable")
        if name in _REGISTRY and not override and _REGISTRY[name] is not fn:
            raise ValueError(f"reward {name!r} is already registered (pass override=True to replace it)")
        _REGISTRY[name] = fn
        return fn

    return deco


def get_reward(name: str) -> RewardFn:
    """The reward function registered as `name`; a KeyError lists the names and suggests the closest one."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(
            f"unknown reward function {name!r}{did_you_mean(name, _REGISTRY)}; registered: {sorted(_REGISTRY)}"
        ) from None


def list_rewards() -> list[str]:
    return sorted(_REGISTRY)
