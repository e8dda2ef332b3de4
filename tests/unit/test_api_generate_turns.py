"""`megarl.api.RLTrainer.generate` takes its turn on the engines in async mode.

The real `RLTrainer.generate` and the real `AsyncSchedule` (its driver thread generating batches) over the scripted
rollout service of `test_schedule.py` (a stand-in for the `RolloutService` protocol, not for vLLM): the driver's
generation is held open, a user's `generate` is called beside it, and the test checks that the user's call ran
only after the driver's had finished (engine call order), not during it. Order of events, no timing.
"""

from __future__ import annotations

import threading
import time
import types

from megarl.api import RLTrainer as ApiTrainer
from megarl.config.schema import RolloutConfig
from megarl.trainer.rl_trainer import RLLoop as LoopTrainer
from megarl.trainer.schedule import AsyncSchedule
from tests.unit.test_schedule import FakeTrainer, ScriptedRollout

BOUND_S = 30.0  # bound on every wait of the test (never reached when the code is right)


class HeldRollout(ScriptedRollout):
    """The driver's first request waits for `release`; every request's start and end are recorded in order, with
    whose it is ("driver": ids "<batch>/<prompt>/t0"; "user": the API's "<prompt>/t0"); a user request overlapping a
    driver request is counted instead of raised."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, str]] = []  # ("start" | "end", "driver" | "user")
        self.overlaps = 0
        self.driver_in = threading.Event()
        self.release = threading.Event()
        self.active = {"driver": 0, "user": 0}

    def answer(self, request):
        me = "user" if request.request_id.count("/") == 1 else "driver"
        other = "driver" if me == "user" else "user"
        with self.lock:
            self.overlaps += self.active[other] > 0
            self.active[me] += 1
            self.events.append(("start", me))
        try:
            if me == "driver" and not self.driver_in.is_set():
                self.driver_in.set()
                assert self.release.wait(BOUND_S), "the test never released the driver's request"
            return super().answer(request)
        finally:
            with self.lock:
                self.active[me] -= 1
                self.events.append(("end", me))


class Encoder:
    def encode(self, prompt):
        return [1, 2, 3]

    def decode(self, ids):
        return " ".join(str(i) for i in ids)


def wait_until(ready, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not ready():
        assert time.monotonic() < deadline, f"waited {BOUND_S:.0f} s for {what}"
        time.sleep(0.01)


def test_generate_waits_for_the_async_drivers_generation():
    rollout = HeldRollout()
    loop = FakeTrainer(rollout, "async", total=10, max_staleness=1)
    loop.encoder = Encoder()
    loop.sample = types.MethodType(LoopTrainer.sample, loop)  # the trainer's own engine call
    schedule = AsyncSchedule(*loop.parts)
    loop.schedule = schedule
    loop.start = lambda: None  # the session already started: push and driver below
    api = ApiTrainer.__new__(ApiTrainer)  # the public object without a session: no workers to start
    api.config = types.SimpleNamespace(rollout=RolloutConfig())
    api._session = types.SimpleNamespace(start=lambda: loop)

    rollout.push_weights(0)
    schedule.start(1)
    try:
        assert rollout.driver_in.wait(BOUND_S), "the driver never started a generation"
        answers: list = []
        user = threading.Thread(target=lambda: answers.append(api.generate(["q"], max_new_tokens=3)),
                                name="user-generate")
        user.start()
        # the user's call either waits its turn (the schedule has a turn wanted) or has entered the engines
        wait_until(lambda: schedule.push_wanted or any(who == "user" for _, who in rollout.events),
                   "the user's generate to ask for the engines or reach them")
        rollout.release.set()
        user.join(BOUND_S)
        assert not user.is_alive(), "the user's generate did not return"
    finally:
        rollout.release.set()
        schedule.close()
    assert answers == [["100 100 100"]], answers  # version 0 sampled 3 tokens (max_new_tokens)
    assert rollout.overlaps == 0, rollout.events
    first_user = rollout.events.index(("start", "user"))
    assert ("end", "driver") in rollout.events[:first_user], rollout.events
