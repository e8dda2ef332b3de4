"""Start several worker groups side by side.

A `WorkerGroup` constructor waits for its processes to import torch, megatron-core and vLLM, form their world and
build their workers (a vLLM engine, a Megatron model): ~10 s of one core a process on CPU, mostly imports. A job with
a rollout pool, a teacher, a judge or a role on a pool of its own has several groups, and nothing in one group's
start waits for another's (the bridge between the actor's and the rollout's pool is joined after both started), so
the session starts them all at once, one thread each waiting on its group: the groups' processes then import and
build side by side instead of one group after another (the tool task's session of 5 groups, 7 processes, on a 2-core
host: `tests/e2e/multi_turn_runs.py`'s "start" phase in runs.json).

Every start is bounded by its own group's timeouts (`WorkerGroup(init_timeout_s=...)`, heartbeats, the call bound),
so waiting for all of them is bounded too.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Any, Callable, Mapping

logger = logging.getLogger("megarl.controller")

PROGRESS_EVERY_S = 60.0  # a line naming the groups still starting, this often


class GroupStartError(RuntimeError):
    """One or more worker groups failed to start; `failed` maps each one's name to its exception (the first one is
    also this error's cause). The groups that did start were handed to `keep` before this was raised."""

    def __init__(self, failed: Mapping[str, BaseException]) -> None:
        self.failed = dict(failed)
        lines = "; ".join(f"{name}: {type(e).__name__}: {e}" for name, e in self.failed.items())
        super().__init__(f"{len(self.failed)} worker group(s) failed to start: {lines}")


def start_groups(starts: Mapping[str, Callable[[], Any]], keep: Callable[[str, Any], None]) -> dict[str, Any]:
    """Run every `starts[name]()` (each builds and returns one worker group) at the same time, one thread each, and
    wait for all of them. Returns {name: group} in `starts`' order.

    `keep(name, group)` is called for every group that started, in `starts`' order, after all starts ended and before
    this returns or raises -- the caller records them there so that it can shut them down however the start ends.
    When a start fails, the others still run to their end (each is bounded by its group's own timeouts) and then its
    exception is raised (`GroupStartError` naming each one when several failed). An interrupt (Ctrl-C) while waiting
    also waits for the starts in flight to end, keeps those that started, and is raised again. A single start runs on
    the calling thread."""
    if not starts:
        return {}
    if len(starts) == 1:
        (name, start), = starts.items()
        group = start()
        keep(name, group)
        return {name: group}
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(starts), thread_name_prefix="megarl-group-start")
    futures = {name: pool.submit(start) for name, start in starts.items()}
    failed: dict[str, BaseException] = {}
    try:
        try:
            _wait_for(futures)
        except BaseException:
            logger.warning("interrupted while starting worker groups: waiting for the starts in flight to end (each "
                           "bounded by its group's start timeout) to shut them down")
            _wait_for(futures)
            raise
    finally:
        pool.shutdown(wait=False)
        for name, future in futures.items():
            if not future.done():  # a second interrupt: this start's group is not known here
                continue
            if future.exception() is None:
                keep(name, future.result())
            else:
                failed[name] = future.exception()
    if len(failed) == 1:
        raise next(iter(failed.values()))
    if failed:
        raise GroupStartError(failed) from next(iter(failed.values()))
    return {name: future.result() for name, future in futures.items()}


def _wait_for(futures: Mapping[str, concurrent.futures.Future]) -> None:
    """Until every start ended. Not a bound of its own: each start is bounded by its group's timeouts (the module
    docstring), so this ends when the last of them does; meanwhile a line every PROGRESS_EVERY_S names the groups
    still starting and for how long."""
    started = time.monotonic()
    pending = {f for f in futures.values() if not f.done()}
    while pending:
        _, pending = concurrent.futures.wait(pending, timeout=PROGRESS_EVERY_S)
        if pending:
            logger.info("waiting for worker groups to start (%.0f s so far): %s", time.monotonic() - started,
                        ", ".join(name for name, f in futures.items() if f in pending))
