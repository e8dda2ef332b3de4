"""`megarl.controller.group_start.start_groups`: the session's worker groups start side by side, and however a start
ends every group that did start is handed back for shutdown. Plain callables stand in for the `WorkerGroup`
constructors: what is checked is the waiting and the bookkeeping, which does not depend on what a start builds."""

from __future__ import annotations

import threading

import pytest

from megarl.controller.group_start import GroupStartError, start_groups


def test_every_start_runs_at_the_same_time_and_groups_come_back_in_order():
    # each start waits until all three are running: one after another, the first would wait alone and time out
    together = threading.Barrier(3, timeout=10)

    def start(name):
        def run():
            together.wait()
            return f"group {name}"
        return run

    kept = []
    groups = start_groups({n: start(n) for n in ("actor", "rollout", "judge")}, lambda n, g: kept.append((n, g)))
    assert list(groups.items()) == [("actor", "group actor"), ("rollout", "group rollout"), ("judge", "group judge")]
    assert kept == list(groups.items())


def test_a_failed_start_raises_its_own_error_after_the_others_started_and_were_kept():
    finished = threading.Event()
    error = TimeoutError("rank 0 of the judge's pool did not start within 600 s")

    def judge():
        raise error

    def slow_actor():
        finished.wait(0.2)  # still starting when the judge's start has failed
        finished.set()
        return "actor group"

    kept = []
    with pytest.raises(TimeoutError) as raised:
        start_groups({"actor": slow_actor, "judge": judge}, lambda n, g: kept.append((n, g)))
    assert raised.value is error
    assert finished.is_set() and kept == [("actor", "actor group")]  # waited for, then handed back to be shut down


def test_several_failed_starts_are_each_named():
    def fails(message):
        def run():
            raise RuntimeError(message)
        return run

    kept = []
    with pytest.raises(GroupStartError) as raised:
        start_groups({"actor": fails("no actor"), "rollout": lambda: "rollout group", "judge": fails("no judge")},
                     lambda n, g: kept.append(n))
    assert sorted(raised.value.failed) == ["actor", "judge"]
    assert "actor: RuntimeError: no actor" in str(raised.value) and "judge: RuntimeError: no judge" in str(raised.value)
    assert raised.value.__cause__ is raised.value.failed["actor"]
    assert kept == ["rollout"]


def test_one_start_runs_on_the_calling_thread():
    groups = start_groups({"actor": lambda: threading.current_thread()}, lambda n, g: None)
    assert groups["actor"] is threading.current_thread()
    assert start_groups({}, lambda n, g: None) == {}


def test_the_wait_names_the_groups_still_starting(monkeypatch, caplog):
    import logging

    import megarl.controller.group_start as group_start

    monkeypatch.setattr(group_start, "PROGRESS_EVERY_S", 0.05)
    slow_done = threading.Event()
    with caplog.at_level(logging.INFO, logger="megarl.controller"):
        start_groups({"actor": lambda: "actor group", "judge": lambda: slow_done.wait(0.5) or "judge group"},
                     lambda n, g: None)
    lines = [r.getMessage() for r in caplog.records if "waiting for worker groups to start" in r.getMessage()]
    assert lines and all(line.endswith(": judge") for line in lines), lines  # the finished actor is not named
