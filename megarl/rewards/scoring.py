"""Scoring a batch of responses with one reward function, and picking the function from the config."""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence, Union

from megarl.data.dataset import PromptRecord
from megarl.rewards.registry import RewardFn, get_reward
from megarl.rewards.user import load_reward_file


class RewardError(RuntimeError):
    """A reward function raised or returned a non-number; the message names the record index."""


def score_batch(
    fn: RewardFn,
    responses: Sequence[str],
    records: Sequence[Union[PromptRecord, Mapping[str, Any]]],
    answer_key: str = "answer",
) -> list[float]:
    """[len(responses)] rewards, `fn(responses[i], answer_i, record_i)` as floats.

    records[i] is the `PromptRecord` of response i (its `.answer` and `.record` are passed), or a plain record
    dict (answer = `record.get(answer_key)`). An exception in `fn`, or a result that is not a finite number, raises
    `RewardError` naming the index i (and the dataset index of the record) — never a silent 0.
    """
    if len(responses) != len(records):
        raise ValueError(f"score_batch: {len(responses)} responses but {len(records)} records")
    name = getattr(fn, "__name__", repr(fn))
    out: list[float] = []
    for i, (text, rec) in enumerate(zip(responses, records)):
        if isinstance(rec, PromptRecord):
            answer, raw, where = rec.answer, rec.record, f"response {i} (dataset record {rec.index})"
        else:
            answer, raw, where = rec.get(answer_key), dict(rec), f"response {i}"
        try:
            value = fn(text, answer, raw)
        except Exception as e:
            raise RewardError(f"reward function {name!r} raised on {where}: {type(e).__name__}: {e}") from e
        if not isinstance(value, (int, float)) or not math.isfinite(value):  # bool is an int: True -> 1.0
            raise RewardError(f"reward function {name!r} returned {value!r} on {where}; expected a finite float")
        out.append(float(value))
    return out


def build_reward_fn(reward: Any) -> RewardFn:
    """The function a `RewardConfig` names: from `reward.file` when set, else the built-in registry."""
    if reward.file:
        return load_reward_file(reward.file, reward.function)
    return get_reward(reward.function)
