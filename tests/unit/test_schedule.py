"""The rollout schedules of `trainer.mode` (`megarl.trainer.schedule`) against a scripted rollout service.

The service is a stand-in for the `RolloutService` protocol (not for vLLM: the end-to-end runs with real engines are
`tests/e2e/test_async_modes.py`); it writes the weights version it holds into every token it samples (token id
100 + version, log-prob -(version + 1) / 10), so a test reads off each token which weights sampled it and checks the
schedules' bookkeeping against that, not against the schedules' own figures.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import types

import pytest
import torch

from megarl.rollout.engine import RolloutSample, RolloutSamples, SamplingSettings
from megarl.trainer.schedule import AsyncSchedule, OneStepOffSchedule, RolloutBatch, Schedule

RESPONSE = 5  # every response stops (EOS) after this many sampled tokens


class ScriptedRollout:
    """`generate` / `submit_generate` / `push_weights` / `weight_version` over no engine: the response of a prompt is
    RESPONSE tokens (counting the sampled tokens already in the prompt, as a partial rollout's continuation holds
    them), each 100 + the held version; `gen_s` seconds per call; `fail_at`: the call number that raises."""

    def __init__(self, gen_s: float = 0.0, fail_at: int | None = None) -> None:
        self.weight_version = None
        self.gen_s, self.fail_at = gen_s, fail_at
        self.calls: list[tuple[str, int]] = []  # ("generate", version) / ("push", version), in order
        self.lock = threading.Lock()
        self.busy = False

    def generate(self, prompts, sampling: SamplingSettings) -> RolloutSamples:
        with self.lock:
            assert not self.busy, "two callers used the engines at once"
            self.busy = True
            self.calls.append(("generate", self.weight_version))
            n = len([c for c in self.calls if c[0] == "generate"])
        try:
            if self.fail_at == n:
                raise RuntimeError("engine rank 1 died")
            time.sleep(self.gen_s)
            v = self.weight_version
            samples = []
            for i, p in enumerate(prompts):
                have = sum(1 for t in p if t >= 100)
                for j in range(sampling.samples_per_prompt):
                    k = min(RESPONSE - have, sampling.max_new_tokens)
                    reason = "stop" if have + k == RESPONSE else "length"
                    samples.append(RolloutSample(i, j, list(p), [100 + v] * k, [-(v + 1) / 10] * k, reason))
            out = RolloutSamples(samples)
            out.generate_s = self.gen_s
            return out
        finally:
            self.busy = False

    def submit_generate(self, prompts, sampling):
        result = self.generate(prompts, sampling)  # runs now; the schedule only needs the protocol
        return types.SimpleNamespace(result=lambda: result, done=lambda: True, generate_s=self.gen_s)

    def push_weights(self, version: int):
        with self.lock:
            assert not self.busy, "a push while the engines generate"
            self.calls.append(("push", version))
        self.weight_version = version
        return [{"reshard/time_s": 0.0}]


class FakeTrainer:
    """What a schedule uses of `RLLoop`: cfg, rollout, episodes, `_draw`, `_scored_batch`, `_sync_batch`."""

    def __init__(self, rollout, mode="sync", total=10, max_staleness=1, stale_policy="wait", sync_every=1,
                 partial="finish", chunk=2) -> None:
        self.cfg = types.SimpleNamespace(
            trainer=types.SimpleNamespace(mode=mode, total_steps=total, max_staleness=max_staleness,
                                          stale_policy=stale_policy, sync_every=sync_every),
            rollout=types.SimpleNamespace(partial=partial, partial_chunk_tokens=chunk))
        self.rollout = rollout
        self.episodes = None  # single-turn
        self.drawn: list[int] = []

    def _draw(self, index, k=0):
        self.drawn.append(index)
        return [f"record{index}"], [[1, 2, 3]], SamplingSettings(samples_per_prompt=2, max_new_tokens=8, seed=index)

    def _scored_batch(self, index, records, out, version, token_versions=None, rollout_s=0.0):
        return RolloutBatch(index, records, list(out), [], torch.zeros(len(out)), {}, version=version,
                            token_versions=token_versions, rollout_s=rollout_s)

    def _sync_batch(self, step, t):
        records, prompts, sampling = self._draw(step)
        out = self.rollout.generate(prompts, sampling)
        return self._scored_batch(step, records, out, step - 1)


def run(schedule: Schedule, trainer: FakeTrainer, steps, train_s: float = 0.0):
    """The trainer loop's calls: initial push, then take / (train) / after_update per step; the batches taken."""
    first = steps[0]
    trainer.rollout.push_weights(first - 1)
    schedule.start(first)
    taken = []
    try:
        for step in steps:
            batch = schedule.take(step, {})
            time.sleep(train_s)
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
    taken = run(Schedule(trainer), trainer, range(1, 5))
    assert [versions_of(b) for _, b, _ in taken] == [{0}, {1}, {2}, {3}]
    assert trainer.rollout.calls == [("push", 0)] + [c for k in range(4) for c in (("generate", k), ("push", k + 1))]
    assert all(m == {} for _, _, m in taken)  # sync adds no metric: its step is today's


def test_one_step_off_samples_step_k_plus_1_with_the_weights_before_update_k():
    trainer = FakeTrainer(ScriptedRollout(), "one_step_off", total=5)
    taken = run(OneStepOffSchedule(trainer), trainer, range(1, 6))
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
    uninterrupted = run(OneStepOffSchedule(full), full, range(1, 7))
    first = FakeTrainer(ScriptedRollout(), "one_step_off", total=6)
    schedule = OneStepOffSchedule(first)
    run(schedule, first, range(1, 4))
    schedule.save_buffer(str(tmp_path))
    second = FakeTrainer(ScriptedRollout(), "one_step_off", total=6)
    resumed_schedule = OneStepOffSchedule(second)
    resumed_schedule.load_buffer(str(tmp_path))
    resumed = run(resumed_schedule, second, range(4, 7))
    assert [(b.index, b.version, [s.response_ids for s in b.samples]) for _, b, _ in resumed] == \
        [(b.index, b.version, [s.response_ids for s in b.samples]) for _, b, _ in uninterrupted[3:]]
    assert second.drawn == [5, 6]  # batch 4 came from the checkpoint, not drawn again
    assert resumed[0][2]["async/restored_batches"] == 1.0


@pytest.mark.parametrize("max_staleness", [1, 3])
def test_async_wait_never_trains_beyond_the_bound_and_runs_ahead_up_to_it(max_staleness):
    trainer = FakeTrainer(ScriptedRollout(gen_s=0.002), "async", total=12, max_staleness=max_staleness)
    taken = run(AsyncSchedule(trainer), trainer, range(1, 13), train_s=0.03)
    lags = [max(b.lags(step - 1)) for step, b, _ in taken]
    assert max(lags) <= max_staleness
    assert max(lags[3:]) == max_staleness  # a slow trainer: rollout runs as far ahead as allowed, no further
    assert all(m["async/dropped_batches"] == 0 for _, _, m in taken)
    for step, b, m in taken:  # the figures logged are those of the tokens
        assert {step - 1 - v for v in versions_of(b)} == {int(k.rsplit("/", 1)[1]) for k in m if "lag_frac" in k}


def test_async_drop_drops_and_counts_what_became_too_stale():
    trainer = FakeTrainer(ScriptedRollout(gen_s=0.001), "async", total=8, max_staleness=0, stale_policy="drop")
    taken = run(AsyncSchedule(trainer), trainer, range(1, 9), train_s=0.03)
    assert all(max(b.lags(step - 1)) == 0 for step, b, _ in taken)  # never trained on a stale batch
    assert all(versions_of(b) == {step - 1} for step, b, _ in taken)
    dropped = taken[-1][2]["async/dropped_batches"]
    assert dropped >= 1  # the driver ran ahead (capacity 1) while the trainer trained, so some batches went stale
    assert taken[-1][2]["async/dropped_samples"] == 2 * dropped
    used = [b.index for _, b, _ in taken]
    assert len(set(used)) == 8 and max(used) >= 8 + dropped  # the dropped indices were skipped, not retrained


def test_async_partial_continue_records_both_versions_and_each_part_keeps_its_engine_log_probs():
    trainer = FakeTrainer(ScriptedRollout(gen_s=0.02), "async", total=6, max_staleness=2, partial="continue", chunk=2)
    taken = run(AsyncSchedule(trainer), trainer, range(1, 7), train_s=0.03)
    mixed = 0
    for step, b, _ in taken:
        for s, vs in zip(b.samples, b.token_versions):
            assert len(s.response_ids) == RESPONSE and s.finish_reason == "stop"
            assert vs == [t - 100 for t in s.response_ids]  # the recorded version is the one that sampled it
            assert s.response_log_probs == [-(v + 1) / 10 for v in vs]  # each part's log-probs: its engine's
            mixed += len(set(vs)) > 1
        assert b.version == min(min(vs) for vs in b.token_versions)
        assert max(b.lags(step - 1)) <= 2
    assert mixed > 0  # pushes landed between pieces
    assert taken[-1][2]["async/continued_samples"] > 0


def test_async_checkpoint_keeps_finished_batches_and_resume_trains_them_first(tmp_path):
    trainer = FakeTrainer(ScriptedRollout(gen_s=0.001), "async", total=10, max_staleness=2)
    schedule = AsyncSchedule(trainer)
    trainer.rollout.push_weights(0)
    schedule.start(1)
    for step in (1, 2):
        schedule.take(step, {})
        schedule.after_update(step)
    time.sleep(0.1)  # the driver fills the buffer up to the bound
    with schedule.pause():
        buffered = [b.index for b in schedule.buffer]
        schedule.save_buffer(str(tmp_path))
    schedule.close()
    assert buffered == [3, 4, 5]  # capacity max_staleness + 1, nothing in flight at the save
    again = FakeTrainer(ScriptedRollout(gen_s=0.001), "async", total=10, max_staleness=2)
    resumed = AsyncSchedule(again)
    resumed.load_buffer(str(tmp_path))
    taken = run(resumed, again, range(3, 7))
    assert [b.index for _, b, _ in taken] == [3, 4, 5, 6]
    assert again.drawn[0] == 6  # the driver continued after the restored batches
    assert taken[0][2]["async/restored_batches"] == 3.0
    assert all(max(b.lags(step - 1)) <= 2 for step, b, _ in taken)


def test_a_failing_engine_stops_the_trainer_naming_it():
    trainer = FakeTrainer(ScriptedRollout(fail_at=3), "async", total=10, max_staleness=1)
    with pytest.raises(RuntimeError, match="rollout driver thread failed.*engine rank 1 died"):
        run(AsyncSchedule(trainer), trainer, range(1, 11))


def test_every_wait_is_bounded_and_named():
    trainer = FakeTrainer(ScriptedRollout(gen_s=1.0), "async", total=10)
    schedule = AsyncSchedule(trainer, wait_timeout_s=0.3)
    trainer.rollout.push_weights(0)
    schedule.start(1)
    with pytest.raises(TimeoutError, match="a rollout batch for step 1"):
        schedule.take(1, {})
    with pytest.raises(TimeoutError, match="the engines to finish the rollout in flight"):
        with schedule.exclusive():
            pass
    schedule.wait_timeout_s = 10
    schedule.close()


def test_validation_and_pushes_take_turns_with_the_driver():
    rollout = ScriptedRollout(gen_s=0.005)  # asserts that no two callers ever overlap on the engines
    trainer = FakeTrainer(rollout, "async", total=8, max_staleness=1)
    schedule = AsyncSchedule(trainer)
    rollout.push_weights(0)
    schedule.start(1)
    for step in range(1, 9):
        schedule.take(step, {})
        with schedule.exclusive():  # what RLLoop.validate does
            rollout.generate([[1, 2, 3]], SamplingSettings(max_new_tokens=3))
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
    """A trainer with multi-turn episodes: each batch is two turns of generation (what `RLLoop._episode_batch`
    does through `EpisodeRunner`), the version read after each turn."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.episodes = object()  # not None: the schedule asks for episode batches

    def _episode_batch(self, index, records, sampling, version, generate):
        turns = []
        for _ in range(2):
            out = generate([[1, 2, 3]], dataclasses.replace(sampling, max_new_tokens=2))
            turns.append((list(out), version() if callable(version) else version))
        samples = [RolloutSample(0, 0, [1, 2, 3], [t for out, _ in turns for t in out[0].response_ids],
                                 [lp for out, _ in turns for lp in out[0].response_log_probs], "stop")]
        versions = [[v] * len(out[0].response_ids) for out, v in turns]
        return RolloutBatch(index, records, samples, [], torch.zeros(1), {}, version=min(v for _, v in turns),
                            token_versions=[versions[0] + versions[1]])


@pytest.mark.parametrize("partial", ["finish", "continue"])
def test_async_episodes_take_pushes_between_turns_only_with_partial_continue(partial):
    rollout = ScriptedRollout(gen_s=0.05)  # asserts that a push never overlaps a generation
    trainer = EpisodeTrainer(rollout, "async", total=8, max_staleness=2, partial=partial)
    taken = run(AsyncSchedule(trainer), trainer, range(1, 9), train_s=0.03)
    mixed = 0
    for step, b, _ in taken:
        (s,), (vs,) = b.samples, b.token_versions
        assert vs == [t - 100 for t in s.response_ids]  # each turn's recorded version sampled it
        assert max(b.lags(step - 1)) <= 2
        mixed += len(set(vs)) > 1
    assert (mixed > 0) == (partial == "continue")
