"""The metric sinks: what a step logs is what TensorBoard reads back (its own event reader, not ours) and what a W&B
offline run records (its transaction log read with wandb's protobuf schema); the config refuses a backend by key,
naming the extra to install, when its package is missing."""

from __future__ import annotations

from typing import Optional

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


def _wandb_records(path: str, data: Optional[bytes] = None) -> list:
    """Every record of a W&B transaction log (`run-<id>.wandb`), decoded with wandb's own protobuf schema.

    The file is a LevelDB-style log (wandb's `sdk/internal/datastore` format): a 7-byte header (':W&B', magic
    0xBEE1, version 0), then 32 KiB blocks of chunks, each a 7-byte header (crc32 uint32, length uint16, type uint8:
    1 full, 2 first, 3 middle, 4 last) and its payload; a record is one full chunk or first..last joined."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read() if data is None else data
    assert data[:4] == b":W&B", data[:7]
    pos, block, pending, records = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:  # zero padding up to the block's end (a tail of exactly 7 bytes included)
            pos += block - pos % block
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _history(records: list) -> list[dict]:
    import json

    names = [[(i.key or "/".join(i.nested_key), i.value_json) for i in r.history.item]
             for r in records if r.WhichOneof("record_type") == "history"]
    return [{k: json.loads(v) for k, v in items if not k.startswith("_")} for items in names]


def test_wandb_offline_run_directory_holds_every_step(tmp_path, monkeypatch):
    """megarl's run log is complete when `close()` returns, and a user's own run opened before the sink (as in a
    notebook around `megarl.RLTrainer`) still logs and finishes afterwards, its data in its own file."""
    import glob

    import wandb

    from megarl.trainer.tracking import wandb_log_has_exit

    monkeypatch.setenv("WANDB_MODE", "offline")  # no network, no account
    (tmp_path / "user").mkdir()
    user = wandb.init(project="user-project", dir=str(tmp_path / "user"), reinit="create_new",
                      settings=wandb.Settings(silent=True, console="off"))
    try:
        user.log({"user/a": 1})
        cfg = load(tmp_path, base(), ["logging.backends=[console,wandb]", "logging.project=megarl-test",
                                      "logging.run_name=offline-check"])
        sinks = build_sinks(cfg.logging.backends, str(tmp_path / "run"), cfg.logging, {"trainer": {"total_steps": 2}})
        assert [type(s).__name__ for s in sinks] == ["WandbSink"]
        sinks[0].log(1, {"reward/mean": 0.25, "time/step_s": 1.5, "note": "skipped"})
        sinks[0].log(2, {"reward/mean": 0.75, "time/step_s": 1.25, "nan": float("nan")})
        sinks[0].close()
        at_close = open(sinks[0].run.settings.sync_file, "rb").read()  # read at once: what close() guarantees
        runs = glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*"))
        assert len(runs) == 1, runs
        (log,) = glob.glob(f"{runs[0]}/run-*.wandb")
        assert log == sinks[0].run.settings.sync_file
        records = _wandb_records(log, at_close)
        assert _history(records) == [{"reward/mean": 0.25, "time/step_s": 1.5},
                                     {"reward/mean": 0.75, "time/step_s": 1.25}]
        run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
        assert (run.project, run.display_name) == ("megarl-test", "offline-check")

        # the completeness probe close() waits on: true for the full log, false for a header only or a cut file
        assert wandb_log_has_exit(log) and any(r.WhichOneof("record_type") == "exit" for r in records)
        for cut in (7, len(at_close) - 1):
            (tmp_path / "cut.wandb").write_bytes(at_close[:cut])
            assert not wandb_log_has_exit(str(tmp_path / "cut.wandb")), cut

        user.log({"user/a": 2})  # the user's run outlived the sink's close
        user.finish()
    finally:
        wandb.teardown()  # the user's own choice, after their run: flushes its log
    (user_log,) = glob.glob(str(tmp_path / "user" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert _history(_wandb_records(user_log)) == [{"user/a": 1}, {"user/a": 2}]


def test_missing_wandb_is_refused_naming_its_extra(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert error(tmp_path, base(), ["logging.backends=[console,wandb]"]) == (
        "logging.backends: 'wandb' needs the wandb package: pip install 'megarl[wandb]' (or drop it: "
        "metrics.jsonl holds every metric of every step)")
