"""The reward-function registry: name -> `fn(response_text, answer, record) -> float`.

`reward.function` in the job config names a registered function (built-ins in `megarl.rewards.builtin`) unless
`reward.file` points at a user Python file (`megarl.rewards.user.load_reward_file`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

from megarl.registry import Registry


class RewardFn(Protocol):
    def __call__(self, response_text: str, answer: Optional[Any], record: dict[str, Any]) -> float:
        """Score one decoded response (special tokens removed, stripped). `answer` is the record's answer key
        value or None; `record` is the whole dataset record."""


REWARDS: Registry[RewardFn] = Registry("reward function", short="reward")


def register_reward(name: str, *, override: bool = False) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register `fn` under `name`. Registering a taken name is an error unless `override=True`."""
    return REWARDS.register(name, override=override)


def get_reward(name: str) -> RewardFn:
    """The reward function registered as `name`; a KeyError lists the names and suggests the closest one."""
    return REWARDS.get(name)


def list_rewards() -> list[str]:
    return REWARDS.names()
