"""SIGTERM / SIGINT on a real `megarl train` run (the CPU quickstart as a subprocess: Ray, 2 worker processes, vLLM
TP=2, checkpoint.dir set), as Slurm's warning signal and a terminal's Ctrl-C deliver them:

- SIGTERM to the controller alone (what `launch/slurm_ray.sbatch` forwards): the step in flight finishes, a
  complete checkpoint of it is saved, the run exits 0 within a bound and prints the command that resumes it; that
  command (with one more step) resumes from the checkpoint and runs exactly the next step.
- SIGINT to the whole process group (Ctrl-C in a terminal reaches the Ray workers too): the same clean stop, no
  worker dies of it, and no process of the run is left.
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
import pytest

from megarl.trainer.checkpointing import complete_steps
from tests.subprocess_env import clean_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXIT_DEADLINE_S = 90.0  # one quickstart step (a few seconds) + a save + shutting Ray down, with room for a busy host


def _rows(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _alive(pids) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize("sig,to_group", [(signal.SIGTERM, False), (signal.SIGINT, True)], ids=["sigterm", "ctrl-c"])
def test_signal_stops_after_the_step_with_a_checkpoint_and_resumes(tmp_path, sig, to_group):
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    log_path = tmp_path / "train.log"
    args = ["megarl", "train", "yaml_configs/cpu_quickstart.yaml", "trainer.val_every=0", f"logging.dir={run_dir}",
            f"checkpoint.dir={ckpt}", "trainer.total_steps=50"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", *args], cwd=ROOT, env=clean_env(), stdout=log,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while len(_rows(run_dir)) < 1:  # step 1 done: step 2 is running now
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
    out = log_path.read_text()
    rows = _rows(run_dir)
    print(f"\n{signal.Signals(sig).name}: signal-to-exit {signal_to_exit:.1f} s, {len(rows)} step(s) finished")
    assert rc == 0, out[-3000:]
    assert signal_to_exit < EXIT_DEADLINE_S, signal_to_exit
    last = rows[-1]["step"]
    assert [r["step"] for r in rows] == list(range(1, last + 1)) and 1 <= last < 50
    assert not re.search(r"of 2 died|KeyboardInterrupt|megarl: error", out), out[-3000:]  # no worker died of it
    assert complete_steps(str(ckpt)) == [last]  # the finished step is checkpointed, and nothing later
    assert "checkpoint/save_s" in rows[-1] or f"saved checkpoint {ckpt}/step_{last:06d}" in out
    name = signal.Signals(sig).name
    expected = shlex.join([*args, "checkpoint.resume=true"])
    m = re.search(rf"stopped by {name} after step {last} of 50; checkpoint {ckpt}/step_{last:06d} holds step "
                  rf"{last}\. To resume: (.+)$", out, re.M)
    assert m and m.group(1) == expected, out[-3000:]
    left = [p for p in run_procs if p in _alive(run_procs)]
    deadline = time.monotonic() + 15
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = _alive(left)
    assert not left, [(p, psutil.Process(p).cmdline()[:3]) for p in left]
    if to_group:
        return

    # the printed command resumes the run; one more step than the stop is enough to see where it continues
    resume = shlex.split(m.group(1))
    resume = [sys.executable, "-m", *[a if a != "trainer.total_steps=50" else f"trainer.total_steps={last + 1}"
                                      for a in resume]]
    done = subprocess.run(resume, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from {ckpt}/step_{last:06d} (step {last} of {last + 1}" in done.stderr, done.stderr[-3000:]
    assert [r["step"] for r in _rows(run_dir)] == list(range(1, last + 2))
    assert complete_steps(str(ckpt)) == [last, last + 1]
