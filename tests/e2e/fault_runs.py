"""The two `megarl train` runs of the suite that end abnormally, each also serving a check of training (so the suite
starts no `megarl train` for that check alone: ~25-30 s of start-up each on the 2-core machine):

- `killed_worker_run`: PPO with a colocated TP2 critic (test_resume.py's PPO preset), a checkpoint every 2 steps;
  once step 4 is logged (its checkpoint saved: the save precedes the row), worker rank 1 is SIGKILLed in a later
  step. The fault checks are tests/e2e/test_worker_faults.py's; steps 1-4 and the step-2 / step-4 checkpoints are
  the uninterrupted PPO run of tests/e2e/test_resume.py (constant LR: a 200-step run's first 4 steps are a 4-step
  run's; until 2026-12-06 a 4-step run of its own, and the killed run a plain quickstart).
- `signal_runs`: the quickstart in bf16 with token-level TIS, REINFORCE++ and adaptive KL in the reward, stopped by
  SIGTERM once step 4 is logged, then resumed with the command it printed and stopped by Ctrl-C. The signal checks
  are tests/e2e/test_stop_signal.py's; steps 1-4 of the fresh run are tests/e2e/test_rollout_correction.py's run
  (until 2026-12-06 a 4-step run of its own, and the signalled runs plain fp32 quickstarts).

Both start their own Ray cluster (not the suite's shared one): what happens to a run's cluster is part of the checks.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from tests.subprocess_env import clean_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICKSTART = ("megarl", "train", "yaml_configs/cpu_quickstart.yaml", "trainer.val_every=0", "logging.plots=false")
PPO = ("algorithm.name=ppo", "critic.enabled=true", "critic.parallel={tp: 2}", "critic.optimizer.lr=1e-3")
BF16_TIS_REINFORCE_PP = ("model.dtype=bf16", "algorithm.rollout_correction.tis=token",
                         "algorithm.name=reinforce_plus_plus", "algorithm.kl.placement=reward",
                         "algorithm.kl.coef=0.05", "algorithm.kl.target=0.001", "algorithm.kl.horizon=100")
STEPS_BEFORE_FAULT = 4  # the steps the training checks read, logged before the kill or the SIGTERM


def rows(run_dir) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def alive(pids) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def wait_gone(pids, timeout_s=15.0) -> list[int]:
    """The processes among `pids` still alive after up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    return alive(pids)


def _wait_for_rows(proc, run_dir, log_path, n: int) -> None:
    deadline = time.monotonic() + 600
    while len(rows(run_dir)) < n:
        assert proc.poll() is None, Path(log_path).read_text()[-3000:]
        assert time.monotonic() < deadline, f"{n} steps not finished in 600 s"
        time.sleep(0.5)


# -- a worker killed ------------------------------------------------------------------------------------------------

@dataclass
class KilledWorkerRun:
    run_dir: Path
    ckpt_dir: Path  # step_000002, step_000004, ... (save_every 2, keep_last 0)
    rows: list  # every step logged (>= STEPS_BEFORE_FAULT)
    out: str  # the controller's stdout + stderr
    rc: int
    kill_to_exit: float
    pids: dict  # {rank: pid} of the worker processes, as the controller logged them
    run_procs: list  # the run's processes (raylet, gcs, workers, ...) seen before the kill
    left: list  # those of them still alive 15 s after the controller exited
    shm_new: set  # /dev/shm entries after the run (and `left`'s wait) that were not there before it


def _worker_pids(out: str) -> dict[int, int]:
    m = re.search(r"worker processes: (rank 0 pid \d+(?:, rank \d+ pid \d+)*)", out)
    return {int(r): int(p) for r, p in re.findall(r"rank (\d+) pid (\d+)", m.group(1))} if m else {}


def killed_worker_run(base: Path) -> KilledWorkerRun:
    run_dir, ckpt = base / "run", base / "ckpt"
    log_path = base / "train.log"
    shm_before = set(os.listdir("/dev/shm"))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", *QUICKSTART, f"logging.dir={run_dir}", f"checkpoint.dir={ckpt}",
             "checkpoint.save_every=2", "checkpoint.keep_last=0", "trainer.total_steps=200", *PPO],
            cwd=ROOT, env=clean_env(), stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for_rows(proc, run_dir, log_path, STEPS_BEFORE_FAULT)  # the next step is running now
        time.sleep(1.0)  # into it (a step takes about a second)
        pids = _worker_pids(log_path.read_text())
        assert sorted(pids) == [0, 1], log_path.read_text()[-3000:]
        run_procs = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        assert pids[1] in run_procs
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        rc = proc.wait(timeout=180)
        kill_to_exit = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
    left = wait_gone(run_procs)
    shm_new = set(os.listdir("/dev/shm")) - shm_before
    return KilledWorkerRun(run_dir, ckpt, rows(run_dir), log_path.read_text(), rc, kill_to_exit, pids, run_procs,
                           left, shm_new)


# -- SIGTERM, then Ctrl-C ---------------------------------------------------------------------------------------------

@dataclass
class SignalledRun:
    args: list  # the command after `python -m`
    rc: int
    out: str
    signal_to_exit: float
    run_procs: list  # the run's processes seen before the signal
    left: list  # those of them still alive 15 s after the controller exited
    rows: list  # metrics.jsonl after this run (the resumed run appends to the fresh run's)
    complete_steps: list  # the complete checkpoints after this run


def signal_after(args, run_dir, ckpt, log_path, steps_before: int, sig, to_group: bool) -> SignalledRun:
    """Start `python -m <args>`, wait until `run_dir` logs more than `steps_before` steps (the next one is running
    then), send `sig` to the controller alone or (`to_group`) to its whole process group."""
    from megarl.trainer.checkpointing import complete_steps

    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, env=clean_env(), stdout=log,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        _wait_for_rows(proc, run_dir, log_path, steps_before + 1)
        run_procs = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]  # raylet, workers, ...
        if to_group:
            os.killpg(proc.pid, sig)  # what a terminal's Ctrl-C does: the whole foreground process group
        else:
            os.kill(proc.pid, sig)
        sent = time.monotonic()
        rc = proc.wait(timeout=300)
        signal_to_exit = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    left = wait_gone(run_procs)
    return SignalledRun(list(args), rc, Path(log_path).read_text(), signal_to_exit, run_procs, left, rows(run_dir),
                        complete_steps(str(ckpt)))


def signal_runs(base: Path) -> dict:
    """{"run_dir", "ckpt", "sigterm": the fresh run (SIGTERM to the controller once STEPS_BEFORE_FAULT steps are
    logged), "ctrl_c": the run of the resume command the first printed (None if it printed none; SIGINT to its
    process group once it logged a step of its own)}."""
    run_dir, ckpt = base / "run", base / "ckpt"
    args = [*QUICKSTART, *BF16_TIS_REINFORCE_PP, f"logging.dir={run_dir}", f"checkpoint.dir={ckpt}",
            "trainer.total_steps=50"]
    first = signal_after(args, run_dir, ckpt, base / "sigterm.log", STEPS_BEFORE_FAULT - 1, signal.SIGTERM, False)
    m = re.search(r"To resume: (.+)$", first.out, re.M)
    second = None
    if first.rc == 0 and m:
        import shlex

        second = signal_after(shlex.split(m.group(1)), run_dir, ckpt, base / "ctrl_c.log", len(first.rows),
                              signal.SIGINT, True)
    return {"run_dir": run_dir, "ckpt": ckpt, "sigterm": first, "ctrl_c": second}
