"""The RL trainer: `run(cfg)` trains a validated config start to end (what `megarl train CONFIG` does, through the
Python API `megarl.api.RLTrainer`; both drive a `megarl.trainer.session.TrainingSession`).

The session joins a Ray cluster (`RAY_ADDRESS`, e.g. from `launch/ray_submit.sh`) or starts a local one, places a
`HybridWorker` on every device slot of the actor's pool (the actor, the vLLM engine and any role configured on the
same pool), a `RoleWorker` group on each other pool (a critic, reference or reward model of its own layout and
size), and runs `RLLoop.fit` on this process, the single controller. Metrics go to the console (progress bar or
lines), `<logging.dir>/metrics.jsonl` and the `logging.backends` sinks; at the end a summary table and PNG plots
(`megarl.trainer.plots`).

SIGTERM / SIGINT during training (Slurm's warning signal, Ctrl-C) stop the run after the step in flight, with a
checkpoint of it when `checkpoint.dir` is set and a logged command that resumes it, exit status 0; a second signal,
or the first without `checkpoint.dir`, aborts at once (`megarl.trainer.stop`).
"""

from __future__ import annotations

import logging
from typing import Optional

from megarl.config.schema import JobConfig
from megarl.config.validate import SIDE_ROLES, check_supported  # noqa: F401  (re-exported: the trainer's refusals)
from megarl.trainer.checkpointing import complete_steps, latest
from megarl.trainer.session import TrainingSession, config_key, worker_threads  # noqa: F401  (re-exported)

logger = logging.getLogger("megarl.trainer")


def run(cfg: JobConfig, resume_command: Optional[str] = None) -> Optional[int]:
    """Train `cfg`; returns 0 (also after a graceful stop on SIGTERM/SIGINT). `resume_command`: the command line
    that resumes this run, logged when a signal stops it (the CLI passes the one it was started with)."""
    session = TrainingSession(cfg)
    try:
        fit_and_report(session, resume_command)
    finally:
        session.close()
    return 0


def fit_and_report(session: TrainingSession, resume_command: Optional[str] = None) -> list:
    """`session.fit()`, then the summary table and plots (`finish_report`) and, when a signal stopped the run early,
    the line naming the checkpoint and the command that resumes it. Returns the `StepResult`s."""
    cfg = session.cfg
    results = session.fit()
    finish_report(cfg, session.run_dir, cfg.logging.plots)
    done = results[-1].step if results else None
    if session.stop.requested and (done or 0) < cfg.trainer.total_steps:
        logger.warning(stopped_message(cfg, session.stop.signal_name, done, resume_command))
    return results


def finish_report(cfg: JobConfig, run_dir: str, plots: bool) -> list[str]:
    """The end-of-run summary table on stdout and, when `plots`, the PNG plots of `run_dir`; returns their paths.
    A missing matplotlib is one log line naming the extra, not an error: the run itself succeeded."""
    from megarl.trainer.plots import PlotsUnavailable, plot_run, read_metrics, summary_table

    rows = read_metrics(run_dir)
    if not rows:
        return []
    print(summary_table(rows, cfg.trainer.total_steps), flush=True)
    if not plots:
        return []
    try:
        paths = plot_run(run_dir)
    except PlotsUnavailable as e:
        logger.warning("%s", e)
        return []
    logger.info("plots: %s", ", ".join(paths))
    return paths


def stopped_message(cfg: JobConfig, signal_name: Optional[str], step: Optional[int],
                    resume_command: Optional[str]) -> str:
    """The last line of a run stopped by a signal: which step finished, the checkpoint that holds it, and the
    command that resumes the run (`resume_command`, else a template)."""
    command = resume_command or "megarl train CONFIG [the same overrides] checkpoint.resume=true"
    path = latest(cfg.checkpoint.dir) if cfg.checkpoint.dir else None
    what = f"after step {step} of {cfg.trainer.total_steps}" if step else "before its first step"
    held = f"checkpoint {path} holds step {complete_steps(cfg.checkpoint.dir)[-1]}" if path else "no checkpoint yet"
    return f"stopped by {signal_name} {what}; {held}. To resume: {command}"
