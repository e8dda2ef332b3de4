"""One run of a shared session (`tests/e2e/async_runs.py`, `tests/e2e/multi_turn_runs.py`): a new `RLLoop` over a
started session's worker groups, resuming from a copy of a checkpoint (the session's step-0 state, or another run's
step) with `checkpoint.allow_config_change`, so runs that differ only in their options share one start-up."""

from __future__ import annotations

import dataclasses
import os
import shutil
import time


def train_from(first, raw: dict, overrides: list, run_dir: str, source: str, rollout=None) -> float:
    """Copy checkpoint `source` into `run_dir`/ckpt, validate `raw` + `overrides` with that checkpoint directory
    (resume on, config changes allowed), fit a trainer over `first`'s groups (`first`: the session's RLLoop;
    `rollout`: its service unless given), logging into `run_dir`. Returns the run's seconds."""
    from megarl.config.loader import parse_config
    from megarl.config.validate import validate
    from megarl.trainer.rl_trainer import RLLoop

    ckpt = os.path.join(run_dir, "ckpt")
    shutil.copytree(source, os.path.join(ckpt, os.path.basename(source)))
    cfg = validate(parse_config(raw, [*overrides, f"checkpoint.dir={ckpt}", "checkpoint.resume=true",
                                      "checkpoint.allow_config_change=true"]))
    cfg = dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, dir=run_dir))
    trainer = RLLoop(cfg, first.workers, first.loader, first.encoder, first.reward_fn,
                        role_groups=first.role_groups, val_records=first.val_records,
                        metrics_path=os.path.join(run_dir, "metrics.jsonl"),
                        rollout=rollout if rollout is not None else first.rollout)
    started = time.monotonic()
    try:
        trainer.fit()
    finally:
        trainer.close()
    return time.monotonic() - started
