"""The TensorBoard metric sink: what a step logs is what TensorBoard reads back (its own event reader, not ours),
and the config refuses the backend by key when the package is missing."""

from __future__ import annotations

import pytest

from megarl.trainer.tracking import TensorBoardSink, build_sinks
from tests.unit.test_config import base, error, load


def _scalars(log_dir: str) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_every_numeric_metric_of_every_step_reads_back(tmp_path):
    sink = TensorBoardSink(str(tmp_path / "tb"))
    sink.log(1, {"reward/mean": 0.25, "time/step_s": 1.5, "samples": 32})
    sink.log(2, {"reward/mean": 0.75, "time/step_s": 1.25, "samples": 32, "note": "skipped", "nan": float("nan")})
    sink.close()
    got = _scalars(str(tmp_path / "tb"))
    assert got == {"reward/mean": [(1, 0.25), (2, 0.75)], "time/step_s": [(1, 1.5), (2, 1.25)],
                   "samples": [(1, 32.0), (2, 32.0)]}  # strings and non-finite values are not scalars


def test_backend_accepted_and_built_under_the_run_directory(tmp_path):
    cfg = load(tmp_path, base(), ["logging.backends=[console,jsonl,tensorboard]"])
    sinks = build_sinks(cfg.logging.backends, str(tmp_path / "run"))
    assert [type(s).__name__ for s in sinks] == ["TensorBoardSink"]
    assert sinks[0].log_dir == str(tmp_path / "run" / "tensorboard")
    sinks[0].close()
    assert build_sinks(("console", "jsonl"), str(tmp_path / "run2")) == []


def test_missing_package_is_refused_by_key(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    assert error(tmp_path, base(), ["logging.backends=[tensorboard]"]) == (
        "logging.backends: 'tensorboard' needs the tensorboard package: pip install 'megarl[logging]' (or drop it: "
        "metrics.jsonl holds every metric of every step)")


def test_wandb_is_still_refused(tmp_path):
    with pytest.raises(Exception, match="logging.backends: \\['wandb'\\] not supported"):
        load(tmp_path, base(), ["logging.backends=[wandb]"])
