"""Stopping a run on SIGTERM / SIGINT (Slurm's warning before the time limit, a preemption notice, Ctrl-C).

`StopRequest` is installed by `megarl.trainer.run` around `RLLoop.fit`, on the controller's main thread. What a
signal does:

- with `checkpoint.dir` set, the first SIGTERM or SIGINT only sets `StopRequest.signal_name`: the step in flight
  finishes (its update and weight sync included; a step is never cut in half, so the checkpoint is the exact state
  after it), `RLLoop.fit` saves a checkpoint of that step (unless the step was just saved on schedule) and
  returns, and `run` logs the command that resumes the run and exits 0. A signal that comes while the checkpoint
  is loaded or before the first step stops the run before any step, with nothing new to save.
- a second SIGINT or SIGTERM (or the first one without `checkpoint.dir`: nothing could be saved, so there is
  nothing to wait for) raises `RunInterrupted` at once, wherever the controller is; the workers are shut down as
  on any error and the CLI exits 128 + the signal's number (130 for SIGINT, 143 for SIGTERM), the shell's convention
  for a process ended by a signal. A checkpoint being written at that moment stays incomplete and is never resumed
  from (`megarl.trainer.checkpointing`).

Worker processes ignore SIGINT (`megarl.controller.worker_group`): Ctrl-C in a terminal signals the whole
foreground process group, Ray's workers included, and a worker interrupted mid-collective would take the step down
with it. They keep SIGTERM's default: Ray stops them with it on shutdown. Before `fit` starts (workers being built),
SIGINT raises KeyboardInterrupt (the CLI: one line, exit 130) and SIGTERM meets the handler `ray.init` installs
(`sys.exit(15)`, read from Ray 2.60's source, not measured); either way the workers are shut down and nothing has
been trained yet.

On Slurm, `launch/slurm_ray.sbatch` asks for SIGTERM `--signal=B:TERM@300` seconds before the time limit and
forwards it to `megarl train`; the lead time must cover one step plus one checkpoint save. A preemption that
signals every process of the job at once (the Ray head and worker steps too) leaves no time for this: the last
scheduled checkpoint (`checkpoint.save_every`) is what such a run resumes from.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any, Optional

logger = logging.getLogger("megarl.trainer")

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunInterrupted(KeyboardInterrupt):
    """The run was stopped at once by a signal (see the module docstring); `exit_code` = 128 + the signal number."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum


class StopRequest:
    """SIGINT/SIGTERM handlers for the controller, as a context manager (the previous handlers come back on exit).

    `graceful`: whether the first signal waits for the step in flight (true when there is a checkpoint to save).
    `signal_name` ('SIGTERM', 'SIGINT') is set by the first signal of a graceful stop; None until then."""

    def __init__(self, graceful: bool, what: str = "the step in flight") -> None:
        self.graceful = graceful
        self.what = what
        self.signal_name: Optional[str] = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("StopRequest must be installed on the main thread (Python delivers signals there)")
        for s in SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if not self.graceful:
            raise RunInterrupted(f"{name} received: stopping at once; nothing was saved (checkpoint.dir is not set)",
                                 signum)
        if self.requested:
            raise RunInterrupted(f"{name} received again: aborting at once without a checkpoint of the step in "
                                 f"flight (the last complete checkpoint in checkpoint.dir is intact)", signum)
        self.signal_name = name
        logger.warning("%s received: finishing %s, then saving a checkpoint and stopping; send it again (Ctrl-C) "
                       "to abort at once", name, self.what)
