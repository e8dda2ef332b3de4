"""The rollout schedules of `trainer.mode` (`megarl.trainer.schedule`) against a scripted rollout service.

The service is a stand-in for the `RolloutService` protocol (not for vLLM: the end-to-end runs with real engines are
`tests/e2e/test_async_modes.py`); it writes the weights version it holds into every token it samples (token id
100 + version, log-prob -(version + 1) / 10), so a test reads off each token which weights sampled it and checks the
schedules' bookkeeping against that, not against the schedules' own figures. While serving (the async schedule) it
answers requests through a client as the rollout pool's router does, sampling a request's tokens one at a time and
reading the held version at each, so a push that lands mid-request shows in the tokens themselves.

No test depends on timing: where the order of the driver thread and the trainer matters, the test fixes it with
events (a generate call held until released, the trainer waiting for what the driver must have buffered, a push
requested while a call is held), so every figure asserted is exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
import types

import pytest
import torch

from megarl.config.schema import RewardConfig
from megarl.data.dataset import PromptRecord
from megarl.envs.episode import EpisodeRunner
from megarl.rollout.engine import (
    Completion,
    GenerationOutput,
    GenerationRequest,
    RolloutSample,
    SamplingSettings,
)
from megarl.trainer.producer import BatchProducer
from megarl.trainer.schedule import AsyncSchedule, OneStepOffSchedule, RolloutBatch, Schedule
from tests.unit import test_envs_episode as episode_tests


def through_checkpoint(state: dict, tmp_path) -> dict:
    """`state` written with torch.save and read back with weights_only=True, as the checkpoint manager does."""
    file = tmp_path / "state.pt"
    torch.save(state, file)
    return torch.load(file, weights_only=True)


RESPONSE = 5  # every response stops (EOS) after this many sampled tokens
BOUND_S = 30.0  # bound on every wait of a test for the driver thread (never reached when the schedule works)


class ScriptedRollout:
    """`push_weights` / `weight_version` over no engine, and serving
    (`start_serving` -> a client, `stop_serving`): the response of a prompt is RESPONSE tokens, each 100 + the held
    version; `gen_s` seconds per call or request; `fail_at`: the call (request, while serving) number that raises.

    `policy`: a `tests.episode_helpers.ScriptedClient` whose `sample(prompt ids)` writes the responses instead
    (multi-turn episodes), cut at max_new_tokens, their log-probs -(version + 1) / 10. `hold`: call/request numbers
    (1-based) that wait at entry until `release(n)` (`entered[n]` is set when n waits there); `hold_at`: {request
    number: token index} -- the request waits before sampling that token of its completions (a push can land
    there). A push while a batch call or a request is in flight asserts unless `pushes_in_flight`
    (partial=continue: the servers take it mid-request)."""

    def __init__(self, gen_s: float = 0.0, fail_at: int | None = None, policy=None, hold=(), hold_at=None,
                 pushes_in_flight: bool = False) -> None:
        self.weight_version = None
        self.gen_s, self.fail_at, self.policy = gen_s, fail_at, policy
        self.calls: list[tuple[str, int]] = []  # ("generate", version) / ("push", version), in order
        self.lock = threading.Lock()
        self.in_flight = 0  # requests being answered
        self.hold_at = {n: 0 for n in hold} | dict(hold_at or {})
        self.entered = {n: threading.Event() for n in self.hold_at}
        self.released = {n: threading.Event() for n in self.hold_at}
        self.pushes_in_flight = pushes_in_flight
        self.client = None
        self.requests = 0

    def _policy_ids(self, prompt_ids, sampling: SamplingSettings) -> list[int]:
        return self.policy.sample(list(prompt_ids))[:sampling.max_new_tokens]

    def release(self, n: int) -> None:
        self.released[n].set()

    def _wait_if_held(self, n: int) -> None:
        if n in self.released:
            self.entered[n].set()
            assert self.released[n].wait(BOUND_S), f"call {n} was never released"

    def start_serving(self):
        assert self.client is None, "start_serving twice"
        self.client = ScriptedClient(self)
        return self.client

    def serving(self):
        """`RolloutService.serving`: the running client while serving (async), else a phase of its own."""
        if self.client is not None:
            return contextlib.nullcontext(self.client)

        @contextlib.contextmanager
        def phase():
            client = self.start_serving()
            try:
                yield client
            finally:
                self.stop_serving()
        return phase()

    def stop_serving(self):
        self.client = None
        for event in self.released.values():  # nothing is answered after the stop: let held requests end
            event.set()
        return []

    def answer(self, request) -> GenerationOutput:
        """A request while serving (on a thread of the client): its completions' tokens sampled one at a time."""
        with self.lock:
            self.requests += 1
            self.in_flight += 1
            n = self.requests
        try:
            if self.hold_at.get(n) == 0:
                self._wait_if_held(n)
            with self.lock:
                self.calls.append(("generate", self.weight_version))
            if self.fail_at == n:
                raise RuntimeError("engine rank 1 died")
            time.sleep(self.gen_s)
            k = request.sampling.samples_per_prompt
            if self.policy is not None:
                ids = [self._policy_ids(request.prompt_ids, request.sampling)] * k
            else:
                ids = [[None] * min(RESPONSE, request.sampling.max_new_tokens)] * k
            versions: list[list[int]] = [[] for _ in range(k)]
            for t in range(max(len(x) for x in ids)):
                if t and self.hold_at.get(n) == t:
                    self._wait_if_held(n)
                v = self.weight_version
                for j in range(k):
                    if t < len(ids[j]):
                        versions[j].append(v)
            completions = []
            for j in range(k):
                toks = [100 + v if x is None else x for x, v in zip(ids[j], versions[j])]
                reason = "stop" if self.policy is not None or len(toks) == RESPONSE else "length"
                completions.append(Completion(j, toks, [-(v + 1) / 10 for v in versions[j]], reason, versions[j]))
            return GenerationOutput(request.request_id, list(request.prompt_ids), completions, True)
        finally:
            with self.lock:
                self.in_flight -= 1

    def push_weights(self, version: int):
        with self.lock:
            assert self.pushes_in_flight or not self.in_flight, "a push while requests are in flight (finish)"
            crossed = self.in_flight
            self.calls.append(("push", version))
        self.weight_version = version
        return [{"reshard/time_s": 0.0, "reshard/pool/continued_requests": float(crossed)}]


class ScriptedClient:
    """The `RolloutClient` of a serving `ScriptedRollout` (each request answered on a thread of its own)."""

    def __init__(self, rollout: ScriptedRollout) -> None:
        self.rollout = rollout

    @property
    def weight_version(self):
        return self.rollout.weight_version

    async def generate(self, request, *, session_id=None, priority=0, timeout_s=None):
        return await asyncio.to_thread(self.rollout.answer, request)


class RecordingProducer(BatchProducer):
    """The real `BatchProducer`, recording the batch index of every draw."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.drawn: list[int] = []

    def draw(self, index, k=0, extra=0):
        self.drawn.append(index)
        return super().draw(index, k, extra)


class OnePromptLoader:
    """A loader of one record per step (prompt ids [1, 2, 3] through `FakeEncoder`)."""

    def next_batch(self, size=None):
        return [PromptRecord(0, "p", "a", {})] * (size or 1)


class FakeEncoder:
    pad_token_id = 0

    def encode(self, prompt):
        return [1, 2, 3]

    def decode(self, ids):
        return " ".join(map(str, ids))


class FakeTrainer:
    """What the loop hands a schedule: cfg, the rollout service and the real `BatchProducer` (`parts`), here over a
    one-prompt loader, 2 samples of at most 8 tokens per prompt, sampling seed = the batch index, every score 0."""

    def __init__(self, rollout, mode="sync", total=10, max_staleness=1, stale_policy="wait", sync_every=1,
                 partial="finish") -> None:
        self.cfg = types.SimpleNamespace(
            trainer=types.SimpleNamespace(mode=mode, total_steps=total, max_staleness=max_staleness,
                                          stale_policy=stale_policy, sync_every=sync_every),
            rollout=types.SimpleNamespace(partial=partial, oversample=0, samples_per_prompt=2, max_prompt_tokens=8,
                                          overlong_prompt="error", max_new_tokens=8),
            data=types.SimpleNamespace(prompts_per_step=1),
            algorithm=types.SimpleNamespace(dynamic_sampling=types.SimpleNamespace(enabled=False)),
            reward=RewardConfig())
        self.rollout = rollout
        self.producer = RecordingProducer(self.cfg, OnePromptLoader(), FakeEncoder(), lambda text, answer, record: 0.0,
                                          None, SamplingSettings(samples_per_prompt=2, max_new_tokens=8, seed=0))

    @property
    def parts(self) -> tuple:
        return self.cfg, self.rollout, self.producer

    @property
    def drawn(self) -> list[int]:
        return self.producer.drawn


def wait_until(schedule: AsyncSchedule, ready, what: str) -> None:
    """Wait (test side, bounded) until `ready()` holds under the schedule's lock."""
    deadline = time.monotonic() + BOUND_S
    with schedule.cond:
        while not ready():
            assert time.monotonic() < deadline, f"waited {BOUND_S:.0f} s for {what}"
            schedule.cond.wait(0.01)


def push_during_call(schedule: AsyncSchedule, step: int, rollout: ScriptedRollout, calls) -> None:
    """`after_update(step)` requested while the requests (or batch calls) `calls` are held. partial=finish: the push
    waits for the engines, so it is requested first and lands once they are released; continue: it must land while
    they are still held (the servers take it mid-request), then they are released."""
    calls = [calls] if isinstance(calls, int) else list(calls)
    for call in calls:
        assert rollout.entered[call].wait(BOUND_S), f"call {call} never started"
    pusher = threading.Thread(target=schedule.after_update, args=(step,))
    pusher.start()
    if schedule.partial == "continue":
        pusher.join(BOUND_S)
        assert not pusher.is_alive(), f"the push of step {step} waited for the requests in flight"
    else:
        wait_until(schedule, lambda: schedule.push_wanted, f"the push of step {step} to wait for the engines")
    for call in calls:
        rollout.release(call)
    pusher.join(BOUND_S)
    assert not pusher.is_alive(), f"the push of step {step} never landed"


def run(schedule: Schedule, trainer: FakeTrainer, steps, before_update=None, push_during=None):
    """The trainer loop's calls: initial push, then take / (train) / after_update per step; the batches taken.
    `before_update(schedule, step)`: what 'training' waits for (the order of events a test needs);
    `push_during`: {step: the held request(s) that step's push comes during (`push_during_call`)}."""
    first = steps[0]
    trainer.rollout.push_weights(first - 1)
    schedule.start(first)
    taken = []
    try:
        for step in steps:
            batch = schedule.take(step, {})
            if before_update is not None:
                before_update(schedule, step)
            if push_during and step in push_during:
                push_during_call(schedule, step, trainer.rollout, push_during[step])
            else:
                schedule.after_update(step)
            taken.append((step, batch, schedule.step_metrics(batch, step)))
    finally:
        schedule.close()
    return taken


def versions_of(batch: RolloutBatch) -> set[int]:
    """The versions that sampled the batch's tokens, read off the tokens themselves."""
    return {t - 100 for s in batch.samples for t in s.response_ids}


def test_sync_generates_each_batch_on_the_weights_it_trains():
    trainer = FakeTrainer(ScriptedRollout(), "sync")
    taken = run(Schedule(*trainer.parts), trainer, range(1, 5))
    assert [versions_of(b) for _, b, _ in taken] == [{0}, {1}, {2}, {3}]
    assert trainer.rollout.calls == [("push", 0)] + [c for k in range(4) for c in (("generate", k), ("push", k + 1))]
    assert all(m == {} for _, _, m in taken)  # sync adds no metric: its step is today's


def test_one_step_off_samples_step_k_plus_1_with_the_weights_before_update_k():
    trainer = FakeTrainer(ScriptedRollout(), "one_step_off", total=5)
    taken = run(OneStepOffSchedule(*trainer.parts), trainer, range(1, 6))
    # step 1: version 0 (nothing ran ahead); step k >= 2: generated while step k-1 trained, on version k-2
    assert [versions_of(b) for _, b, _ in taken] == [{0}, {0}, {1}, {2}, {3}]
    assert [b.version for _, b, _ in taken] == [0, 0, 1, 2, 3]
    assert [m["async/staleness_max"] for _, _, m in taken] == [0, 1, 1, 1, 1]
    assert [m["async/lag_frac/1"] for _, _, m in taken[1:]] == [1.0] * 4
    # each push comes after the generation that had to see the older weights; no batch is drawn past the last step
    assert trainer.rollout.calls == [("push", 0), ("generate", 0), ("generate", 0), ("push", 1), ("generate", 1),
                                     ("push", 2), ("generate", 2), ("push", 3), ("generate", 3), ("push", 4),
                                     ("push", 5)]
    assert trainer.drawn == [1, 2, 3, 4, 5]


def test_one_step_off_checkpoint_holds_the_next_batch_and_resume_repeats_the_run(tmp_path):
    full = FakeTrainer(ScriptedRollout(), "one_step_off", total=6)
    uninterrupted = run(OneStepOffSchedule(*full.parts), full, range(1, 7))
    first = FakeTrainer(ScriptedRollout(), "one_step_off", total=6)
    schedule = OneStepOffSchedule(*first.parts)
    run(schedule, first, range(1, 4))
    state = through_checkpoint(schedule.state_dict(), tmp_path)
    second = FakeTrainer(ScriptedRollout(), "one_step_off", total=6)
    resumed_schedule = OneStepOffSchedule(*second.parts)
    resumed_schedule.load_state_dict(state)
    resumed = run(resumed_schedule, second, range(4, 7))
    assert [(b.index, b.version, [s.response_ids for s in b.samples]) for _, b, _ in resumed] == \
        [(b.index, b.version, [s.response_ids for s in b.samples]) for _, b, _ in uninterrupted[3:]]
    assert second.drawn == [5, 6]  # batch 4 came from the checkpoint, not drawn again
    assert resumed[0][2]["async/restored_batches"] == 1.0


def ran_ahead(schedule: AsyncSchedule, step: int) -> None:
    """'Training' step `step` lasts until the driver has buffered everything the wait policy lets it run ahead:
    batch step + max_staleness (it starts on version step - 1 and is trained at step + max_staleness)."""
    last = step + schedule.max_staleness
    wait_until(schedule, lambda: any(b.index == last for b in schedule.buffer), f"batch {last} to be buffered")


@pytest.mark.parametrize("max_staleness", [1, 3])
def test_async_wait_never_trains_beyond_the_bound_and_runs_ahead_up_to_it(max_staleness):
    trainer = FakeTrainer(ScriptedRollout(), "async", total=12, max_staleness=max_staleness)
    taken = run(AsyncSchedule(*trainer.parts), trainer, range(1, 13), before_update=ran_ahead)
    # batch k <= 1 + max_staleness: generated on version 0 before any push; later ones on version k - 1 - bound
    assert [versions_of(b) for _, b, _ in taken] == [{max(0, k - 1 - max_staleness)} for k in range(1, 13)]
    assert [max(b.lags(step - 1)) for step, b, _ in taken] == [min(k - 1, max_staleness) for k in range(1, 13)]
    assert [b.index for _, b, _ in taken] == list(range(1, 13))
    assert all(m["async/dropped_batches"] == 0 for _, _, m in taken)
    for step, b, m in taken:  # the figures logged are those of the tokens
        assert {step - 1 - v for v in versions_of(b)} == {int(k.rsplit("/", 1)[1]) for k in m if "lag_frac" in k}
        assert m["async/staleness_max"] == min(step - 1, max_staleness)


def one_buffered(schedule: AsyncSchedule, step: int) -> None:
    """'Training' lasts until the driver has filled the buffer (capacity 1 at max_staleness 0) on the old weights."""
    wait_until(schedule, lambda: len(schedule.buffer) == 1, f"a batch to be buffered during step {step}")


def test_async_drop_drops_and_counts_what_became_too_stale():
    trainer = FakeTrainer(ScriptedRollout(), "async", total=8, max_staleness=0, stale_policy="drop")
    taken = run(AsyncSchedule(*trainer.parts), trainer, range(1, 9), before_update=one_buffered)
    assert all(max(b.lags(step - 1)) == 0 for step, b, _ in taken)  # never trained on a stale batch
    assert all(versions_of(b) == {step - 1} for step, b, _ in taken)
    # during step k the driver generated batch 2k on version k - 1: too stale for step k + 1, dropped
    assert [b.index for _, b, _ in taken] == [2 * k - 1 for k in range(1, 9)]
    assert [m["async/dropped_batches"] for _, _, m in taken] == [float(k - 1) for k in range(1, 9)]
    assert taken[-1][2]["async/dropped_samples"] == 2 * 7  # 2 samples per batch


def test_async_partial_continue_lands_a_push_mid_request_keeping_every_token():
    """Request 2 (batch 2, one prompt x 2 completions) is held before its third token; step 1's push lands while it is
    held (it does not wait for it) and the request then continues: its first two tokens were sampled by version 0,
    the other three by version 1, none lost, each part with the log-probs of the weights that sampled it."""
    rollout = ScriptedRollout(hold_at={2: 2}, pushes_in_flight=True)
    trainer = FakeTrainer(rollout, "async", total=6, max_staleness=2, partial="continue")
    taken = run(AsyncSchedule(*trainer.parts), trainer, range(1, 7), push_during={1: 2})
    for step, b, _ in taken:
        for s, vs in zip(b.samples, b.token_versions, strict=True):
            assert len(s.response_ids) == RESPONSE and s.finish_reason == "stop"  # nothing decoded is lost
            assert vs == [t - 100 for t in s.response_ids]  # the recorded version is the one that sampled it
            assert s.response_log_probs == [-(v + 1) / 10 for v in vs]  # each part's log-probs: its engine's
        assert b.version == min(min(vs) for vs in b.token_versions)
        assert max(b.lags(step - 1)) <= 2
    second = taken[1][1]
    assert second.index == 2 and second.token_versions == [[0, 0, 1, 1, 1]] * 2
    assert second.lags(1) == [1, 1] and taken[1][2]["async/lag_frac/1"] == pytest.approx(2 / 5)
    assert taken[0][2]["async/continued_requests"] == 1.0  # request 2 alone was in flight across step 1's push


def test_async_partial_finish_push_waits_for_the_request_in_flight():
    """The same held request with partial=finish: the push waits until it finished, so batch 2 is all version 0."""
    trainer = FakeTrainer(ScriptedRollout(hold_at={2: 2}), "async", total=4, max_staleness=2)
    taken = run(AsyncSchedule(*trainer.parts), trainer, range(1, 5), push_during={1: 2})
    assert taken[1][1].index == 2 and taken[1][1].token_versions == [[0] * RESPONSE] * 2
    assert taken[0][2]["async/continued_requests"] == 0.0


def full(schedule: AsyncSchedule) -> bool:
    return len(schedule.buffer) == schedule.capacity


def test_async_checkpoint_keeps_finished_batches_and_resume_trains_them_first(tmp_path):
    trainer = FakeTrainer(ScriptedRollout(), "async", total=10, max_staleness=2)
    schedule = AsyncSchedule(*trainer.parts)
    trainer.rollout.push_weights(0)
    schedule.start(1)
    for step in (1, 2):
        schedule.take(step, {})
        schedule.after_update(step)
    wait_until(schedule, lambda: full(schedule), "the driver to fill the buffer")
    with schedule.pause():
        buffered = [b.index for b in schedule.buffer]
        state = through_checkpoint(schedule.state_dict(), tmp_path)
    schedule.close()
    assert buffered == [3, 4, 5]  # capacity max_staleness + 1
    again = FakeTrainer(ScriptedRollout(), "async", total=10, max_staleness=2)
    resumed = AsyncSchedule(*again.parts)
    resumed.load_state_dict(state)
    taken = run(resumed, again, range(3, 7))
    assert [b.index for _, b, _ in taken] == [3, 4, 5, 6]
    assert again.drawn[0] == 6  # the driver continued after the restored batches
    assert taken[0][2]["async/restored_batches"] == 3.0
    assert all(max(b.lags(step - 1)) <= 2 for step, b, _ in taken)


class WatchedCondition(threading.Condition):
    """A `threading.Condition` that calls `on_wait()` each time a thread starts waiting on it."""

    def __init__(self, on_wait) -> None:
        super().__init__()
        self.on_wait = on_wait

    def wait(self, timeout=None):
        self.on_wait()
        return super().wait(timeout)


def test_a_checkpoint_taken_while_a_batch_is_in_flight_waits_for_it_and_holds_it(tmp_path):
    """pause() called while batch 1 is being generated: the checkpoint holds batch 1, finished. The generation is
    released only once the trainer waits inside pause(), so a pause that did not wait would save an empty buffer."""
    rollout = ScriptedRollout(hold=(1,))
    trainer = FakeTrainer(rollout, "async", total=10, max_staleness=0)
    schedule = AsyncSchedule(*trainer.parts)
    trainer_thread = threading.current_thread()
    order: list[str] = []

    def on_wait():  # the trainer is blocked in pause(): let the batch in flight finish
        if threading.current_thread() is trainer_thread and schedule.paused and not rollout.released[1].is_set():
            order.append("pause waits")
            rollout.release(1)

    schedule.cond = WatchedCondition(on_wait)
    rollout.push_weights(0)
    schedule.start(1)
    try:
        assert rollout.entered[1].wait(BOUND_S), "batch 1 never started"
        with schedule.pause():
            order.append("paused")
            buffered = [(b.index, versions_of(b)) for b in schedule.buffer]
            state = through_checkpoint(schedule.state_dict(), tmp_path)
    finally:
        rollout.release(1)
        schedule.close()
    assert order == ["pause waits", "paused"]
    assert buffered == [(1, {0})]
    again = FakeTrainer(ScriptedRollout(), "async", total=10, max_staleness=0)
    resumed = AsyncSchedule(*again.parts)
    resumed.load_state_dict(state)
    (_, batch, metrics), = run(resumed, again, [1])
    assert batch.index == 1 and versions_of(batch) == {0} and metrics["async/restored_batches"] == 1.0
    assert 1 not in again.drawn  # trained from the checkpoint, not generated again


def test_take_dropping_only_too_stale_batches_is_bounded_and_names_them():
    """Weights that never reach the engines (no push lands): every batch the driver makes is too stale, and take's
    drop loop stops at its bound naming what it dropped. Without the bound it spins until generate call 3000 fails
    (3 s at least, 10 times the bound)."""
    rollout = ScriptedRollout(gen_s=0.001, fail_at=3000)
    trainer = FakeTrainer(rollout, "async", total=10, max_staleness=0, stale_policy="drop")
    schedule = AsyncSchedule(*trainer.parts, wait_timeout_s=0.3)
    rollout.push_weights(0)
    schedule.start(1)
    try:
        with pytest.raises(TimeoutError, match=r"a rollout batch for step 5 at most 0 version\(s\) behind version 4 "
                                               r"\(dropped \d+ too-stale batch"):
            schedule.take(5, {})  # the trainer expects version 4; the engines hold 0
    finally:
        schedule.close()
    assert schedule.counts["dropped_batches"] >= 1


def test_a_failing_engine_stops_the_trainer_naming_it():
    trainer = FakeTrainer(ScriptedRollout(fail_at=3), "async", total=10, max_staleness=1)
    with pytest.raises(RuntimeError, match="rollout driver thread failed.*engine rank 1 died"):
        run(AsyncSchedule(*trainer.parts), trainer, range(1, 11))


def test_every_wait_is_bounded_and_named():
    rollout = ScriptedRollout(hold=(1,))  # batch 1 never finishes while the trainer waits
    trainer = FakeTrainer(rollout, "async", total=10)
    schedule = AsyncSchedule(*trainer.parts, wait_timeout_s=0.3)
    rollout.push_weights(0)
    schedule.start(1)
    try:
        assert rollout.entered[1].wait(BOUND_S)
        with pytest.raises(TimeoutError, match="a rollout batch for step 1"):
            schedule.take(1, {})
        with pytest.raises(TimeoutError, match="the engines to finish the rollout in flight"):
            with schedule.exclusive():
                pass
        with pytest.raises(TimeoutError, match="the rollout in flight to finish before the checkpoint"):
            with schedule.pause():
                pass
        rollout.release(1)  # the timed-out pause (no checkpoint) left the driver free to go on
        schedule.wait_timeout_s = BOUND_S
        assert schedule.take(1, {}).index == 1
        schedule.after_update(1)
        assert schedule.take(2, {}).index == 2
    finally:
        rollout.release(1)
        schedule.wait_timeout_s = BOUND_S
        schedule.close()


def test_validation_and_pushes_take_turns_with_the_driver():
    rollout = ScriptedRollout(gen_s=0.005)  # asserts that no two callers ever overlap on the engines
    trainer = FakeTrainer(rollout, "async", total=8, max_staleness=1)
    schedule = AsyncSchedule(*trainer.parts)
    rollout.push_weights(0)
    schedule.start(1)
    for step in range(1, 9):
        schedule.take(step, {})
        with schedule.exclusive(), rollout.serving() as client:  # what RLLoop.validate does
            assert rollout.in_flight == 0, "validation got the engines while the driver's requests were in flight"
            out = asyncio.run(client.generate(GenerationRequest("val", [1, 2, 3], SamplingSettings(max_new_tokens=3))))
            assert out.finished
        schedule.after_update(step)
    schedule.close()
    assert ("push", 8) in rollout.calls


def test_rollout_batch_lags_are_per_sample_oldest_token():
    s = RolloutSample(0, 0, [1], [7, 8, 9], [0.0] * 3, "stop")
    b = RolloutBatch(1, [], [s, dataclasses.replace(s, sample_index=1)], [], torch.zeros(2), {}, version=3,
                     token_versions=[[3, 4, 5], [5, 5, 5]])
    assert b.lags(5) == [2, 0]
    assert b.token_lags(5) == {2: 1, 1: 1, 0: 4}


class EpisodeTrainer(FakeTrainer):
    """A trainer with multi-turn episodes: the real `EpisodeRunner` (transformers' chat template and tokenizer, the
    calculator environment and scripted policy of test_envs_episode.py: a tool call, then the answer: two turns)
    and the real `BatchProducer`; 2 records x 2 episodes = 4 episodes per batch."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cfg.rollout.samples_per_prompt = 2
        episodes = EpisodeRunner(episode_tests.TOK, episode_tests.CalcEnv, episode_tests.parse, episode_tests.LIMITS)
        loader = types.SimpleNamespace(next_batch=lambda: list(episode_tests.RECORDS))
        self.producer = RecordingProducer(self.cfg, loader, None, None, episodes, SamplingSettings(seed=0))


def token_versions_read_off(t) -> list[int]:
    """The version that sampled each of a trajectory's sampled tokens, read off its log-prob (-(v + 1) / 10)."""
    return [round(-lp * 10) - 1 for lp, m in zip(t.log_probs, t.loss_mask) if m]


def episode_rollout(**kw) -> ScriptedRollout:
    return ScriptedRollout(policy=episode_tests.ScriptedPolicy(), **kw)


@pytest.mark.parametrize("partial", ["finish", "continue"])
def test_async_episodes_take_pushes_mid_request_only_with_partial_continue(partial):
    """Batch 1 = requests 1-8 (4 episodes x 2 turns); requests 9-12 (batch 2's first turns) are held after their
    first token while step 1's push comes. With partial=continue it lands there: each first turn's first token is
    version 0's, the rest of the turn and the second turn version 1's; with finish it waits for the whole batch.
    Every token's recorded version must be the one that sampled it (read off its log-prob), and the lags the oldest
    token's."""
    batch2 = (9, 10, 11, 12)
    rollout = episode_rollout(hold_at={n: 1 for n in batch2}, pushes_in_flight=partial == "continue")
    trainer = EpisodeTrainer(rollout, "async", total=4, max_staleness=2, partial=partial)
    taken = run(AsyncSchedule(*trainer.parts), trainer, range(1, 5), push_during={1: batch2})
    for step, b, m in taken:
        assert len(b.trajectories) == 4 and b.samples == []
        for t in b.trajectories:
            sampled = [v for v, mask in zip(t.policy_version, t.loss_mask) if mask]
            assert sampled == token_versions_read_off(t)
        oldest = [min(token_versions_read_off(t)) for t in b.trajectories]
        assert b.lags(step - 1) == [step - 1 - v for v in oldest]
        assert m["async/staleness_max"] == max(step - 1 - v for v in oldest)
        assert b.version == min(oldest)
    second = taken[1][1]
    per_episode = [token_versions_read_off(t) for t in second.trajectories]
    if partial == "continue":
        assert all(vs[0] == 0 and set(vs[1:]) == {1} for vs in per_episode), per_episode
        assert second.lags(1) == [1] * 4  # from the oldest token (version 0), not the newest
        assert taken[1][2]["async/staleness_max"] == 1.0
        assert taken[0][2]["async/continued_requests"] == 4.0  # the 4 held requests crossed step 1's push
    else:
        assert all(set(vs) == {0} for vs in per_episode), per_episode
        assert taken[0][2]["async/continued_requests"] == 0.0
    turn2 = [("generate", 1)] * 4 if partial == "continue" else [("generate", 0)] * 4
    assert rollout.calls[:1 + 12] == [("push", 0)] + [("generate", 0)] * 12
    assert rollout.calls[13:18] == ([("push", 1)] + turn2 if partial == "continue" else turn2 + [("push", 1)])


def test_async_episodes_dropped_as_too_stale_are_counted_as_episodes():
    """stale_policy=drop with episode batches: each dropped batch counts its 4 episodes in async/dropped_samples."""
    trainer = EpisodeTrainer(episode_rollout(), "async", total=4, max_staleness=0, stale_policy="drop")
    taken = run(AsyncSchedule(*trainer.parts), trainer, range(1, 5), before_update=one_buffered)
    assert [b.index for _, b, _ in taken] == [1, 3, 5, 7]
    assert all({v for t in b.trajectories for v in token_versions_read_off(t)} == {step - 1} for step, b, _ in taken)
    assert taken[-1][2]["async/dropped_batches"] == 3.0
    assert taken[-1][2]["async/dropped_samples"] == 3.0 * 4


def trajectory_fields(batch: RolloutBatch) -> list[tuple]:
    """Every field of a batch's trajectories (routing records none here), in order."""
    return [tuple(getattr(t, f.name) for f in dataclasses.fields(t)) for t in batch.trajectories]


def test_one_step_off_episodes_sample_the_next_batch_on_the_weights_before_the_update(tmp_path):
    """one_step_off with multi-turn episodes (4 episodes x 2 turns per batch, through the serving client on the
    background thread): batch k >= 2 is sampled entirely on version k - 2 while step k - 1 trains, every token's
    recorded version is the one that sampled it (read off its log-prob), the push of step k comes after the next
    batch's 8 requests; and a checkpoint taken after step 2 (the next batch, episodes, in it) loads with
    weights_only=True and resumes into the uninterrupted run's batches, trajectory field by trajectory field."""
    full = EpisodeTrainer(episode_rollout(), "one_step_off", total=4)
    taken = run(OneStepOffSchedule(*full.parts), full, range(1, 5))
    for step, b, m in taken:
        assert len(b.trajectories) == 4 and b.samples == []
        want = max(step - 2, 0)
        for t in b.trajectories:
            sampled = [v for v, mask in zip(t.policy_version, t.loss_mask) if mask]
            assert sampled and sampled == token_versions_read_off(t) == [want] * len(sampled)
        assert b.version == want and b.lags(step - 1) == [step - 1 - want] * 4
        assert m["async/staleness_max"] == float(step - 1 - want)
    assert full.rollout.calls == ([("push", 0)] + [("generate", 0)] * 16 + [("push", 1)] + [("generate", 1)] * 8
                                  + [("push", 2)] + [("generate", 2)] * 8 + [("push", 3), ("push", 4)])
    assert full.drawn == [1, 2, 3, 4]

    first = EpisodeTrainer(episode_rollout(), "one_step_off", total=4)
    schedule = OneStepOffSchedule(*first.parts)
    run(schedule, first, range(1, 3))
    state = through_checkpoint(schedule.state_dict(), tmp_path)  # raises on any pickled object
    assert [b["index"] for b in state["batches"]] == [3]
    second = EpisodeTrainer(episode_rollout(), "one_step_off", total=4)
    resumed_schedule = OneStepOffSchedule(*second.parts)
    resumed_schedule.load_state_dict(state)
    resumed = run(resumed_schedule, second, range(3, 5))
    assert second.drawn == [4]  # batch 3 came from the checkpoint
    assert [(b.index, b.version, trajectory_fields(b), b.scores.tolist()) for _, b, _ in resumed] == \
        [(b.index, b.version, trajectory_fields(b), b.scores.tolist()) for _, b, _ in taken[2:]]


def test_a_schedules_state_is_plain_data_that_loads_with_weights_only_and_round_trips(tmp_path):
    """Issue 30: a schedule's `state_dict` (what the checkpoint manager saves) loads with torch.load(weights_only=True)
    (a pickled object would make loading a checkpoint code execution): single-turn samples with numpy routing
    records, episodes' trajectories with torch ones, records with chat prompts; a fresh schedule's
    `load_state_dict` gets each batch back equal field by field, and the driver's counters."""
    import numpy as np

    from megarl.data.dataset import PromptRecord
    from megarl.data.trajectory import Trajectory

    routed = np.arange(2 * 3 * 2, dtype=np.int16).reshape(2, 3, 2)
    single = RolloutBatch(3, [PromptRecord(0, [{"role": "user", "content": "hi"}], "42", {"p": [1, 2]})],
                          [RolloutSample(0, 0, [5, 6], [7, 8], [-0.5, -0.25], "stop", routed)], [1],
                          torch.tensor([1.0]), {"reward/errors": np.float64(0.0)}, 2, token_versions=[[2, 3]],
                          metrics={"dynamic/kept": 4.0}, rollout_s=1.5, reward_s=0.5)
    episode = Trajectory([1, 2, 3, 4], 2, [0, 0, 1, 1], [0.0, 0.0, -0.1, -0.2], [-1, -1, 4, 4], "u/0", "u", "stop",
                         torch.zeros(3, 1, 2, dtype=torch.int16))
    episodes = RolloutBatch(4, [PromptRecord(1, "2*3=", "6", {})], [], [], torch.tensor([0.0]), {}, 4,
                            trajectories=[episode])
    saved = AsyncSchedule(*FakeTrainer(ScriptedRollout(), "async", total=10, max_staleness=2).parts)
    saved.buffer.extend([single, episodes])
    saved.next_index = 5
    saved.counts["dropped_batches"] = 2
    raw = through_checkpoint(saved.state_dict(), tmp_path)  # raises on any pickled object
    assert raw["mode"] == "async" and raw["next_index"] == 5 and len(raw["batches"]) == 2
    resumed = AsyncSchedule(*FakeTrainer(ScriptedRollout(), "async", total=10, max_staleness=2).parts)
    resumed.load_state_dict(raw)
    assert resumed.next_index == 5
    assert resumed.counts == {"dropped_batches": 2, "restored_batches": 2}
    for want, got in zip([single, episodes], list(resumed.buffer), strict=True):
        for f in dataclasses.fields(RolloutBatch):
            a, b = getattr(want, f.name), getattr(got, f.name)
            if f.name == "scores":
                assert torch.equal(a, b)
            elif f.name in ("samples", "trajectories") and a:
                for x, y in zip(a, b):
                    assert type(x) is type(y)
                    for g in dataclasses.fields(x):
                        u, v = getattr(x, g.name), getattr(y, g.name)
                        if g.name == "routed_experts":
                            assert type(u) is type(v) and (u == v).all(), g.name
                        else:
                            assert u == v, g.name
            else:
                assert a == b, f.name


def test_sync_and_one_step_off_states_round_trip(tmp_path):
    """sync holds nothing ahead; one_step_off's state is its finished next batch (or nothing), and a fresh schedule
    trains that very batch next without drawing it again."""
    sync = Schedule(*FakeTrainer(ScriptedRollout(), "sync", total=3).parts)
    assert through_checkpoint(sync.state_dict(), tmp_path) == {"mode": "sync", "batches": []}
    trainer = FakeTrainer(ScriptedRollout(), "one_step_off", total=4)
    fresh = OneStepOffSchedule(*trainer.parts)
    assert through_checkpoint(fresh.state_dict(), tmp_path) == {"mode": "one_step_off", "batches": []}
    run(fresh, trainer, [1])
    state = through_checkpoint(fresh.state_dict(), tmp_path)
    assert [b["index"] for b in state["batches"]] == [2]
    again = FakeTrainer(ScriptedRollout(), "one_step_off", total=4)
    resumed = OneStepOffSchedule(*again.parts)
    resumed.load_state_dict(state)
    assert resumed.ready.index == 2 and resumed.ready.samples == fresh.ready.samples
    assert torch.equal(resumed.ready.scores, fresh.ready.scores)
