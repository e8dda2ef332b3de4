"""Scoring a batch of responses with one reward function, and picking the function from the config.

Failures: a call that raises, returns something that is not a finite number, or (with `timeout_s`) does not return
in time is a *failure* of that response. `on_error="raise"` (the default, `reward.on_error`) stops at the first one
with a `RewardError` naming the response and its dataset record; `on_error="zero"` scores it 0.0 and records it in
`ScoredBatch.failures`, and `check_failures` stops the run when more than `reward.max_error_fraction` of a step's
responses failed.

Timeouts (`timeout_s`): a Python callable cannot be interrupted safely from outside (an exception injected into a
running thread lands at an arbitrary bytecode, and C code — a regex, a tokenizer — is not interruptible at all;
`signal.alarm` only works on the main thread and has the same C-code limit). So each call runs on a daemon worker
thread and the caller waits at most `timeout_s` seconds for it. A call that misses its deadline is *abandoned*: it
keeps running in the background until it returns on its own (its result is dropped), and the next calls go to a
fresh worker thread. Limits: an abandoned call still holds the GIL for its Python bytecode and any memory it
allocates; a function that never returns leaks one daemon thread per timed-out call (they die with the process).
Reward code that can loop forever should time itself out (or run a subprocess); `timeout_s` keeps the *run* alive.
"""

from __future__ import annotations

import dataclasses
import math
import queue
import threading
from typing import Any, Callable, Literal, Mapping, Optional, Sequence, Union

from megarl.data.dataset import PromptRecord
from megarl.rewards.registry import RewardFn, get_reward
from megarl.rewards.user import load_reward_file

OnError = Literal["raise", "zero"]
ON_ERROR = ("raise", "zero")


class RewardError(RuntimeError):
    """A reward function raised, returned a non-number or timed out (naming the response and record index), or
    too many of a step's responses failed (`check_failures`)."""


class RewardTimeout(TimeoutError):
    """One reward call did not return within `timeout_s` seconds (it was abandoned; see the module docstring)."""


@dataclasses.dataclass(frozen=True)
class RewardFailure:
    """One response whose reward could not be computed.

    index: position of the response in the scored batch; where: human-readable location (response index and
    dataset record index); kind: 'error' (raised), 'invalid' (returned a non-finite / non-number), 'timeout';
    message: what happened (exception type and text, or the value returned).
    """

    index: int
    where: str
    kind: Literal["error", "invalid", "timeout"]
    message: str


@dataclasses.dataclass
class ScoredBatch:
    """scores: [len(responses)] floats (0.0 for failed responses); failures: one entry per failed response."""

    scores: list[float]
    failures: list[RewardFailure]

    def metrics(self, prefix: str = "reward/") -> dict[str, float]:
        """`<prefix>errors` (failed responses, count), `<prefix>timeouts` (of which timed out, count) and
        `<prefix>error_frac` (failed / scored, fraction)."""
        n = len(self.scores)
        errors = len(self.failures)
        return {f"{prefix}errors": float(errors),
                f"{prefix}timeouts": float(sum(f.kind == "timeout" for f in self.failures)),
                f"{prefix}error_frac": errors / n if n else 0.0}


class _DeadlineCaller:
    """Calls `fn(*args)` on a daemon worker thread and waits at most `timeout_s` seconds for the result.

    One worker thread serves consecutive calls; when a call misses its deadline the worker is abandoned (it finishes
    that call in the background, then exits) and the next call starts a new one. Not thread-safe: one caller.
    """

    def __init__(self, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
        self.timeout_s = timeout_s
        self._jobs: Optional[queue.SimpleQueue] = None

    def _start(self) -> queue.SimpleQueue:
        jobs: queue.SimpleQueue = queue.SimpleQueue()

        def serve() -> None:
            while True:
                job = jobs.get()
                if job is None:
                    return
                fn, args, done = job
                try:
                    done.put((True, fn(*args)))
                except BaseException as e:  # noqa: BLE001 - handed to the caller, which re-raises it
                    done.put((False, e))

        threading.Thread(target=serve, name="megarl-reward", daemon=True).start()
        return jobs

    def __call__(self, fn: Callable, *args: Any) -> Any:
        if self._jobs is None:
            self._jobs = self._start()
        done: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs.put((fn, args, done))
        try:
            ok, value = done.get(timeout=self.timeout_s)
        except queue.Empty:
            self._jobs.put(None)  # the stuck worker exits after its current call; the next call gets a new one
            self._jobs = None
            raise RewardTimeout(f"did not return within reward.timeout_s={self.timeout_s:g} s") from None
        if not ok:
            raise value
        return value

    def close(self) -> None:
        if self._jobs is not None:
            self._jobs.put(None)
            self._jobs = None


def score_responses(
    fn: RewardFn,
    responses: Sequence[str],
    records: Sequence[Union[PromptRecord, Mapping[str, Any]]],
    answer_key: str = "answer",
    *,
    on_error: OnError = "raise",
    timeout_s: Optional[float] = None,
) -> ScoredBatch:
    """Score `responses[i]` with `fn(responses[i], answer_i, record_i)`; see the module docstring for failures.

    records[i] is the `PromptRecord` of response i (its `.answer` and `.record` are passed), or a plain record dict
    (answer = `record.get(answer_key)`). `timeout_s`: seconds one call may take (None = no limit; the call then runs
    on the caller's thread). With `on_error="raise"` the first failure raises `RewardError` naming index i and the
    dataset index of its record; with `"zero"` failures score 0.0 and are listed in the result.
    """
    if len(responses) != len(records):
        raise ValueError(f"score_batch: {len(responses)} responses but {len(records)} records")
    if on_error not in ON_ERROR:
        raise ValueError(f"reward.on_error must be one of {ON_ERROR}, got {on_error!r}")
    name = getattr(fn, "__name__", repr(fn))
    caller = _DeadlineCaller(timeout_s) if timeout_s is not None else None
    scores: list[float] = []
    failures: list[RewardFailure] = []
    try:
        for i, (text, rec) in enumerate(zip(responses, records)):
            if isinstance(rec, PromptRecord):
                answer, raw, where = rec.answer, rec.record, f"response {i} (dataset record {rec.index})"
            else:
                answer, raw, where = rec.get(answer_key), dict(rec), f"response {i}"
            failure = None
            try:
                value = caller(fn, text, answer, raw) if caller is not None else fn(text, answer, raw)
            except RewardTimeout as e:
                failure = RewardFailure(i, where, "timeout", str(e))
                said = f"timed out on {where}: {e}"
            except Exception as e:
                failure = RewardFailure(i, where, "error", f"{type(e).__name__}: {e}")
                said = f"raised on {where}: {failure.message}"
            else:
                if not isinstance(value, (int, float)) or not math.isfinite(value):  # bool is an int: True -> 1.0
                    failure = RewardFailure(i, where, "invalid", f"returned {value!r}; expected a finite float")
                    said = f"returned {value!r} on {where}; expected a finite float"
            if failure is None:
                scores.append(float(value))
                continue
            if on_error == "raise":
                raise RewardError(f"reward function {name!r} {said} "
                                  "(reward.on_error=zero scores such responses 0 and counts them)")
            failures.append(failure)
            scores.append(0.0)
    finally:
        if caller is not None:
            caller.close()
    return ScoredBatch(scores, failures)


def score_batch(
    fn: RewardFn,
    responses: Sequence[str],
    records: Sequence[Union[PromptRecord, Mapping[str, Any]]],
    answer_key: str = "answer",
) -> list[float]:
    """[len(responses)] rewards, `fn(responses[i], answer_i, record_i)` as floats; the first failure raises
    `RewardError` naming the index i (and the dataset index of the record) — never a silent 0. (`score_responses`
    with `on_error="raise"` and no timeout.)"""
    return score_responses(fn, responses, records, answer_key).scores


def check_failures(scored: ScoredBatch, max_error_fraction: float, what: str = "this step") -> None:
    """Raise `RewardError` when more than `max_error_fraction` (a fraction in [0, 1]) of `scored`'s responses
    failed; the message gives the count, the config key and the first three failures."""
    n = len(scored.scores)
    if not scored.failures or not n or len(scored.failures) / n <= max_error_fraction:
        return
    shown = "; ".join(f"{f.where}: {f.kind}: {f.message}" for f in scored.failures[:3])
    more = f" (and {len(scored.failures) - 3} more)" if len(scored.failures) > 3 else ""
    raise RewardError(
        f"{len(scored.failures)} of {n} reward calls failed in {what} ({len(scored.failures) / n:.1%} > "
        f"reward.max_error_fraction={max_error_fraction:g}): {shown}{more}"
    )


def build_reward_fn(reward: Any) -> RewardFn:
    """The function a `RewardConfig` names: from `reward.file` when set, else the built-in registry."""
    if reward.file:
        return load_reward_file(reward.file, reward.function)
    return get_reward(reward.function)
