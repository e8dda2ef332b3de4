"""SIGTERM / SIGINT on the controller (`megarl.trainer.stop`): the first signal ends `RLLoop.fit` after the step in
flight with a checkpoint of it, a second one (or the first without checkpoint.dir) aborts at once. Real signals are
sent to this process; the loop is `RLLoop.fit` itself, around a stand-in for the worker calls (steps and saves
recorded). The real run, with Ray workers, is tests/e2e/test_stop_signal.py."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from megarl.cli import main
from megarl.trainer import stopped_message
from megarl.trainer.rl_trainer import RLLoop, StepResult
from megarl.trainer.stop import RunInterrupted, StopRequest


class _Loop:
    """`RLLoop.fit` with the worker-side parts replaced: `step` records the step and raises `signals[step]` (a
    list of signals sent during that step); `save` records the step saved; `_log` can send a signal too."""

    fit = RLLoop.fit
    start = RLLoop.start
    run_step = RLLoop.run_step
    _stop_requested = RLLoop._stop_requested
    _check_skips = RLLoop._check_skips

    def __init__(self, stop, total=5, save_every=0, ckpt="ckpt", during_step=None, during_log=None):
        self.cfg = SimpleNamespace(trainer=SimpleNamespace(total_steps=total, val_every=0, max_skipped_steps=3,
                                                           log_every=1),
                                   checkpoint=SimpleNamespace(dir=ckpt, save_every=save_every),
                                   logging=SimpleNamespace(progress="lines"))
        self.next_step, self.last_saved, self.metrics_path = 0, None, None
        self.stop, self.val_records, self.skip_streak = stop, [], {}
        self.rollout = SimpleNamespace(push_weights=lambda version: None)
        self.schedule = SimpleNamespace(start=lambda next_step: None)  # trainer.mode=sync: nothing beside the steps
        self.during_step, self.during_log = during_step or {}, during_log or {}
        self.ran, self.saved = [], []

    def _resume(self):
        return 0

    def step(self, step):
        self.ran.append(step)
        for s in self.during_step.get(step, ()):
            signal.raise_signal(s)
        return StepResult(step, {})

    def save(self, step):
        self.saved.append(step)

    def _log(self, result):
        for s in self.during_log.get(result.step, ()):
            signal.raise_signal(s)


def test_first_signal_finishes_the_step_saves_it_and_stops():
    with StopRequest(graceful=True) as stop:
        loop = _Loop(stop, during_step={2: [signal.SIGTERM]})
        results = loop.fit()
    assert [r.step for r in results] == loop.ran == [1, 2]
    assert loop.saved == [2] and "checkpoint/save_s" in results[-1].metrics
    assert stop.signal_name == "SIGTERM"


def test_a_step_saved_on_schedule_is_not_saved_twice():
    with StopRequest(graceful=True) as stop:
        loop = _Loop(stop, save_every=2, during_step={4: [signal.SIGINT]})
        loop.fit()
    assert loop.ran == [1, 2, 3, 4] and loop.saved == [2, 4]


def test_a_signal_after_the_save_decision_is_still_saved():
    with StopRequest(graceful=True) as stop:
        loop = _Loop(stop, during_log={3: [signal.SIGTERM]})
        loop.fit()
    assert loop.ran == [1, 2, 3] and loop.saved == [3]


def test_second_signal_aborts_at_once():
    with StopRequest(graceful=True) as stop:
        loop = _Loop(stop, during_step={2: [signal.SIGTERM, signal.SIGINT]})
        with pytest.raises(RunInterrupted, match="SIGINT received again: aborting at once") as e:
            loop.fit()
    assert e.value.exit_code == 130 and loop.saved == []


def test_without_checkpoint_dir_the_first_signal_aborts_naming_the_key():
    with StopRequest(graceful=False) as stop:
        loop = _Loop(stop, ckpt=None, during_step={1: [signal.SIGTERM]})
        with pytest.raises(RunInterrupted, match=r"nothing was saved \(checkpoint.dir is not set\)") as e:
            loop.fit()
    assert e.value.exit_code == 143 and loop.ran == [1]


def test_handlers_are_restored():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with StopRequest(graceful=True):
        assert signal.getsignal(signal.SIGTERM) != before[signal.SIGTERM]
    assert {s: signal.getsignal(s) for s in before} == before


def test_stopped_message_names_the_step_the_checkpoint_and_the_command(tmp_path):
    step = tmp_path / "step_000003"
    step.mkdir()
    (step / "trainer_state.json").write_text("{}")
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(dir=str(tmp_path)), trainer=SimpleNamespace(total_steps=20))
    msg = stopped_message(cfg, "SIGTERM", 3, "megarl train a.yaml checkpoint.resume=true")
    assert msg == (f"stopped by SIGTERM after step 3 of 20; checkpoint {step} holds step 3. "
                   "To resume: megarl train a.yaml checkpoint.resume=true")


def test_cli_passes_the_resume_command_and_maps_an_abort_to_128_plus_signal(monkeypatch, capsys):
    import megarl.api

    seen = {}

    class FakeTrainer:  # stands in for megarl.api.RLTrainer, which the CLI drives
        def __init__(self, cfg, resume_command=None):
            seen["command"] = resume_command

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            seen["closed"] = True

        def fit(self):
            raise RunInterrupted("SIGTERM received: stopping at once", signal.SIGTERM)

    monkeypatch.setattr(megarl.api, "RLTrainer", FakeTrainer)
    code = main(["train", "yaml_configs/cpu_quickstart.yaml", "checkpoint.resume=false", "trainer.total_steps=3",
                 "checkpoint.dir=/tmp/x y"])
    assert code == 143
    assert seen["command"] == ("megarl train yaml_configs/cpu_quickstart.yaml trainer.total_steps=3 "
                               "'checkpoint.dir=/tmp/x y' checkpoint.resume=true")
    assert "megarl: error: SIGTERM received: stopping at once" in capsys.readouterr().err
    assert seen["closed"]  # the workers are shut down on the way out
