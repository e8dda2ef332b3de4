"""Metric sinks beyond the console and `metrics.jsonl` (which every run writes): TensorBoard and Weights & Biases.

`logging.backends: [console, jsonl, tensorboard]` adds a TensorBoard event file under `<logging.dir>/tensorboard/`,
one scalar per metric per step (the same keys and values as `metrics.jsonl`; non-numeric values are skipped), flushed
after every step so a crash loses nothing already logged. Needs the `tensorboard` package (extra `logging`:
`pip install megarl[logging]`); the config check refuses the backend naming that command when it is missing.
View with `tensorboard --logdir <logging.dir>`.

`wandb` starts a W&B run in `<logging.dir>/wandb/` (project `logging.project`, name `logging.run_name`, the job
config as its config) and logs the same scalars per step. `WANDB_MODE=offline` needs no network or account: the run
is written to `<logging.dir>/wandb/offline-run-*/` (`wandb sync` uploads it later). Needs the `wandb` extra.

A missing package is refused at config load naming the extra (`megarl.config.validate.backend_problem`).
"""

from __future__ import annotations

import importlib.util
import math
import os
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

    def close(self) -> None:
        import wandb

        self.run.finish()
        # wandb 0.31.0: in offline mode finish() can return before its service has written the run's transaction
        # log (measured: 2 of 6 runs left a 7-byte `run-*.wandb`); teardown waits for the service to exit. One run
        # per trainer process, so stopping the service loses nothing (a later wandb.init starts a new one).
        wandb.teardown()


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
