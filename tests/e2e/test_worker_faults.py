"""Faults of a real `megarl train` run (the CPU quickstart as a subprocess: Ray, 2 worker processes, vLLM TP=2; here
with PPO's colocated TP2 critic, the session's `killed_worker_run`, tests/e2e/fault_runs.py, whose first 4 steps are
also test_resume.py's uninterrupted PPO run).

- A worker process killed (SIGKILL) mid-run: the controller exits non-zero within 60 s naming the rank and the call
  that was running, shuts down the Ray cluster it started (no process of the run is left), and /dev/shm holds no
  file that was not there before the run (vLLM's `psm_*` ring buffer and `*-cpushm_*` segments included).
- A run that ends normally leaves /dev/shm as it found it too.
The kill-to-exit time is printed (run pytest with -s to see it).
"""

from __future__ import annotations

import json
import re

import psutil

from tests.e2e.fault_runs import STEPS_BEFORE_FAULT, alive

EXIT_DEADLINE_S = 60.0


def test_killed_worker_stops_the_run_and_cleans_up(killed_worker_run):
    run = killed_worker_run
    out = run.out
    print(f"\nkill-to-exit: {run.kill_to_exit:.1f} s (steps finished before the kill: {len(run.rows)})")
    assert len(run.rows) >= STEPS_BEFORE_FAULT  # killed mid-run, after those steps
    assert run.rc != 0, out[-3000:]
    assert run.kill_to_exit < EXIT_DEADLINE_S, run.kill_to_exit
    # the error names the call and the rank that died
    assert re.search(r"HybridWorker\.\w+.*: the actor of rank 1 of 2 died", out), out[-3000:]
    assert not run.left, [(p, psutil.Process(p).cmdline()[:3]) for p in alive(run.left)]
    assert not run.shm_new, sorted(run.shm_new)


def test_normal_run_leaves_dev_shm_as_it_found_it(quickstart_run):
    """The session's shared quickstart run (tests/e2e/conftest.py) removed the vLLM segments its workers made:
    /dev/shm after it holds nothing that was not there before it."""
    out = quickstart_run.proc.stdout + quickstart_run.proc.stderr
    assert json.loads((quickstart_run.run_dir / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1
    assert "removed the workers' vLLM shared-memory segments from /dev/shm" in out  # the psm_* buffer, at least
    assert not quickstart_run.shm_new, sorted(quickstart_run.shm_new)
