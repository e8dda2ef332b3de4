"""SIGTERM / SIGINT on a real `megarl train` run (the CPU quickstart as a subprocess: Ray, 2 worker processes, vLLM
TP=2, checkpoint.dir set), as Slurm's warning signal and a terminal's Ctrl-C deliver them:

- SIGTERM to the controller alone (what `launch/slurm_ray.sbatch` forwards): the step in flight finishes, a
  complete checkpoint of it is saved, the run exits 0 within a bound and prints the command that resumes it; that
  command (with one more step) resumes from the checkpoint and runs exactly the next step.
- SIGINT to the whole process group (Ctrl-C in a terminal reaches the Ray workers too), sent to that resumed run
  once it finished a step of its own: the same clean stop, no worker dies of it, and no process of the run is left.
The signal-to-exit time is printed (pytest -s).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import psutil

from megarl.trainer.checkpointing import complete_steps
from tests.subprocess_env import clean_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXIT_DEADLINE_S = 90.0  # one quickstart step (a few seconds) + a save + shutting Ray down, with room for a busy host


def _rows(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _alive(pids) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def _signal_after(args, run_dir, log_path, steps_before: int, sig, to_group: bool):
    """Start `python -m <args>`, wait until `run_dir` logs more than `steps_before` steps (the next one is running
    then), send `sig` to the controller alone or (`to_group`) to its whole process group; -> (exit code, log text,
    signal-to-exit seconds, the run's processes seen before the signal)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, env=clean_env(), stdout=log,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while len(_rows(run_dir)) <= steps_before:  # a step of this run done: the next one is running now
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "no step finished in 600 s"
            time.sleep(0.5)
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
    return rc, log_path.read_text(), signal_to_exit, run_procs


def _assert_clean_stop(rc, out, signal_to_exit, run_procs, sig, args, run_dir, ckpt, first: int) -> tuple[int, str]:
    """The stop after a signal: exit 0 in time, steps `first`.. logged in order, no worker died, the last finished
    step checkpointed and nothing later, the resume command printed, no process of the run left.
    -> (the last step, the printed resume command)."""
    rows = _rows(run_dir)
    print(f"\n{signal.Signals(sig).name}: signal-to-exit {signal_to_exit:.1f} s, {len(rows)} step(s) logged")
    assert rc == 0, out[-3000:]
    assert signal_to_exit < EXIT_DEADLINE_S, signal_to_exit
    last = rows[-1]["step"]
    assert [r["step"] for r in rows] == list(range(1, last + 1)) and first <= last < 50
    assert not re.search(r"of 2 died|KeyboardInterrupt|megarl: error", out), out[-3000:]  # no worker died of it
    assert complete_steps(str(ckpt))[-1] == last  # the finished step is checkpointed, and nothing later
    assert "checkpoint/save_s" in rows[-1] or f"saved checkpoint {ckpt}/step_{last:06d}" in out
    name = signal.Signals(sig).name
    expected = shlex.join([*args, "checkpoint.resume=true"] if "checkpoint.resume=true" not in args else args)
    m = re.search(rf"stopped by {name} after step {last} of 50; checkpoint {ckpt}/step_{last:06d} holds step "
                  rf"{last}\. To resume: (.+)$", out, re.M)
    assert m and m.group(1) == expected, out[-3000:]
    left = [p for p in run_procs if p in _alive(run_procs)]
    deadline = time.monotonic() + 15
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = _alive(left)
    assert not left, [(p, psutil.Process(p).cmdline()[:3]) for p in left]
    return last, m.group(1)


def test_sigterm_stops_after_the_step_and_the_resumed_run_stops_on_ctrl_c(tmp_path):
    """SIGTERM to the controller of a fresh run, then the printed resume command run as printed (50 steps), which
    continues at the next step and is stopped by Ctrl-C to its whole process group once it has run a step. (Until
    2026-12-03 the Ctrl-C case was a third run of its own, ~30 s of start-up.)"""
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    args = ["megarl", "train", "yaml_configs/cpu_quickstart.yaml", "trainer.val_every=0", "logging.plots=false",
            f"logging.dir={run_dir}",
            f"checkpoint.dir={ckpt}", "trainer.total_steps=50"]
    rc, out, secs, procs = _signal_after(args, run_dir, tmp_path / "sigterm.log", 0, signal.SIGTERM, False)
    last, resume = _assert_clean_stop(rc, out, secs, procs, signal.SIGTERM, args, run_dir, ckpt, first=1)
    assert complete_steps(str(ckpt)) == [last]

    # the printed command resumes the run where it stopped; Ctrl-C once it has finished a step of its own
    resume_args = shlex.split(resume)
    assert resume_args == [*args, "checkpoint.resume=true"]
    rc, out, secs, procs = _signal_after(resume_args, run_dir, tmp_path / "ctrl_c.log", last, signal.SIGINT, True)
    assert f"resumed from {ckpt}/step_{last:06d} (step {last} of 50" in out, out[-3000:]
    last2, _ = _assert_clean_stop(rc, out, secs, procs, signal.SIGINT, resume_args, run_dir, ckpt, first=last + 1)
    assert complete_steps(str(ckpt)) == [last, last2]
