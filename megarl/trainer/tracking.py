"""Metric sinks beyond the console line and `metrics.jsonl` (which every run writes): TensorBoard.

`logging.backends: [console, jsonl, tensorboard]` adds a TensorBoard event file under `<logging.dir>/tensorboard/`,
one scalar per metric per step (the same keys and values as `metrics.jsonl`; non-numeric values are skipped), flushed
after every step so a crash loses nothing already logged. Needs the `tensorboard` package (extra `logging`:
`pip install megarl[logging]`); the config check refuses the backend naming that command when it is missing.
View with `tensorboard --logdir <logging.dir>`.
"""

from __future__ import annotations

import importlib.util
import math
import os
from typing import Protocol

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
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self.writer.add_scalar(key, float(value), global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def build_sinks(backends, run_dir: str) -> list[MetricSink]:
    """The extra sinks `logging.backends` asks for (console and jsonl are written by the trainer itself)."""
    sinks: list[MetricSink] = []
    if "tensorboard" in backends:
        sinks.append(TensorBoardSink(os.path.join(run_dir, "tensorboard")))
    return sinks
