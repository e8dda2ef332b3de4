"""Metric sinks beyond the console and `metrics.jsonl` (which every run writes): TensorBoard and Weights & Biases.

`logging.backends: [console, jsonl, tensorboard]` adds a TensorBoard event file under `<logging.dir>/tensorboard/`,
one scalar per metric per step (the same keys and values as `metrics.jsonl`; non-numeric values are skipped), flushed
after every step so a crash loses nothing already logged. Needs the `tensorboard` package (extra `logging`:
`pip install megarl[logging]`); the config check refuses the backend naming that command when it is missing.
View with `tensorboard --logdir <logging.dir>`.

`wandb` starts a W&B run in `<logging.dir>/wandb/` (project `logging.project`, name `logging.run_name`, the job
config as its config) and logs the same scalars per step. `WANDB_MODE=offline` needs no network or account: the run
is written to `<logging.dir>/wandb/offline-run-*/` (`wandb sync` uploads it later). Needs the `wandb` extra.
The sink's `close` finishes megarl's run only, then waits (up to `WANDB_FLUSH_TIMEOUT_S`) until that run's
transaction log (`run-<id>.wandb`) holds its exit record: other wandb runs of the process (a notebook user's own,
opened before or during `megarl.RLTrainer`) and wandb's service are left running.

A missing package is refused at config load naming the extra (`megarl.config.validate.backend_problem`).
"""

from __future__ import annotations

import importlib.util
import math
import os
import struct
import time
import warnings
from typing import Any, Optional, Protocol

TENSORBOARD_MISSING = ("logging.backends: 'tensorboard' needs the tensorboard package: pip install 'megarl[logging]' "
                       "(or drop it: metrics.jsonl holds every metric of every step)")


def tensorboard_available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


class MetricSink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """Scalars to a TensorBoard event file in `log_dir` (torch.utils.tensorboard's SummaryWriter)."""

    def __init__(self, log_dir: str) -> None:
        if not tensorboard_available():
            raise RuntimeError(TENSORBOARD_MISSING)
        from torch.utils.tensorboard import SummaryWriter

        os.makedirs(log_dir, exist_ok=True)
        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=log_dir)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in _scalars(metrics).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics dict (what every sink logs)."""
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class WandbSink:
    """Scalars to a W&B run whose files live under `run_dir/wandb` (offline with WANDB_MODE=offline)."""

    def __init__(self, run_dir: str, project: str = "megarl", run_name: Optional[str] = None,
                 config: Optional[dict] = None, quiet: bool = True) -> None:
        from megarl.config.validate import backend_problem

        problem = backend_problem(["wandb"])
        if problem:
            raise RuntimeError(problem)
        import wandb

        os.makedirs(run_dir, exist_ok=True)
        self.run = wandb.init(project=project, name=run_name, dir=run_dir, config=config or {}, reinit="create_new",
                              settings=wandb.Settings(silent=quiet, console="off"))
        self.run_dir = self.run.dir  # <run_dir>/wandb/<offline-run-...|run-...>/files

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(_scalars(metrics), step=step)

    def close(self, timeout_s: Optional[float] = None) -> None:
        """Finish this sink's run and wait until its transaction log holds the run's exit record (every logged step
        is before it). wandb 0.31.0: finish() returns before the service has closed the run's log, which it flushes
        only on close or every 15 s (measured: 2 of 6 runs left a 7-byte `run-*.wandb`); `wandb.teardown()` would
        wait for that but ends every run of the process, so the log itself is polled (every 20 ms) instead. After
        `timeout_s` (default `WANDB_FLUSH_TIMEOUT_S`) without the record, a warning names the file."""
        self.run.finish()
        path = self.run.settings.sync_file
        if self.run.settings.x_skip_transaction_log:  # online only: no log to wait for
            return
        timeout_s = WANDB_FLUSH_TIMEOUT_S if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while not wandb_log_has_exit(path):
            if time.monotonic() > deadline:
                warnings.warn(f"wandb: the run's transaction log {path} has no exit record {timeout_s:.0f} s after "
                              "finish(); wandb's service may still be writing it", stacklevel=2)
                return
            time.sleep(0.02)


WANDB_FLUSH_TIMEOUT_S = 60.0
_LOG_BLOCK = 32768  # wandb's transaction log: LevelDB-style 32 KiB blocks after a 7-byte file header


def wandb_log_has_exit(path: str) -> bool:
    """Whether a W&B transaction log (`run-<id>.wandb`) holds an exit record, decoded with wandb's protobuf schema.

    The format (wandb-core `internal/stream/store.go`, `pkg/leveldb`): a 7-byte header (':W&B', magic 0xBEE1,
    version 0), then 32 KiB blocks of chunks, each a 7-byte header (crc32 uint32, length uint16, type uint8: 1 full,
    2 first, 3 middle, 4 last) and its payload; a record is one full chunk or first..last joined. A block's tail
    shorter than a chunk header, or a zero header, is padding. A missing or partly written file answers False."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2

    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return False
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        if _LOG_BLOCK - pos % _LOG_BLOCK < 7:
            pos += _LOG_BLOCK - pos % _LOG_BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += _LOG_BLOCK - pos % _LOG_BLOCK
            continue
        if pos + 7 + length > len(data):  # a chunk still being written
            return False
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            try:
                record.ParseFromString(pending)
            except DecodeError:  # bytes the service has not finished writing
                return False
            if record.WhichOneof("record_type") == "exit":
                return True
            pending = b""
    return False


def build_sinks(backends, run_dir: str, logging_cfg=None, config: Optional[dict] = None) -> list[MetricSink]:
    """The extra sinks `logging.backends` asks for (console and jsonl are written by the trainer itself).
    `logging_cfg`: the job's `LoggingConfig` (wandb's project, run name and quietness); `config`: the job config as
    plain data (`megarl.config.to_dict`), recorded by wandb."""
    sinks: list[MetricSink] = []
    if "tensorboard" in backends:
        sinks.append(TensorBoardSink(os.path.join(run_dir, "tensorboard")))
    if "wandb" in backends:
        sinks.append(WandbSink(run_dir, project=getattr(logging_cfg, "project", "megarl"),
                               run_name=getattr(logging_cfg, "run_name", None), config=config,
                               quiet=getattr(logging_cfg, "vendor_level", "error") != "info"))
    return sinks
