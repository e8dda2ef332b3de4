"""Faults of a real `megarl train` run (the CPU quickstart as a subprocess: Ray, 2 worker processes, vLLM TP=2).

- A worker process killed (SIGKILL) mid-run: the controller exits non-zero within 60 s naming the rank and the call
  that was running, shuts down the Ray cluster it started (no process of the run is left), and /dev/shm holds no
  file that was not there before the run (vLLM's `psm_*` ring buffer and `*-cpushm_*` segments included).
- A run that ends normally leaves /dev/shm as it found it too.
The kill-to-exit time is printed (run pytest with -s to see it).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil

from tests.subprocess_env import clean_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXIT_DEADLINE_S = 60.0


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm"))


def _start(run_dir, *overrides):
    log = open(run_dir / "train.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "megarl", "train", "yaml_configs/cpu_quickstart.yaml", "trainer.val_every=0",
         f"logging.dir={run_dir}", *overrides],
        cwd=ROOT, env=clean_env(), stdout=log, stderr=subprocess.STDOUT, text=True,
    )
    return proc, run_dir / "train.log"


def _steps_logged(run_dir) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _worker_pids(log_path) -> dict[int, int]:
    m = re.search(r"worker processes: (rank 0 pid \d+(?:, rank \d+ pid \d+)*)", log_path.read_text())
    return {int(r): int(p) for r, p in re.findall(r"rank (\d+) pid (\d+)", m.group(1))} if m else {}


def _alive(pids) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def _wait_gone(pids, timeout_s=15.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    return _alive(pids)


def test_killed_worker_stops_the_run_and_cleans_up(tmp_path):
    shm_before = _shm()
    proc, log = _start(tmp_path, "trainer.total_steps=200")
    try:
        deadline = time.monotonic() + 600
        while _steps_logged(tmp_path) < 1:  # step 1 done: step 2 is running now
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no step finished in 600 s"
            time.sleep(0.5)
        time.sleep(1.0)  # into step 2 (a quickstart step takes several seconds)
        pids = _worker_pids(log)
        assert sorted(pids) == [0, 1], log.read_text()[-3000:]
        run_procs = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]  # raylet, gcs, workers...
        assert pids[1] in run_procs
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        rc = proc.wait(timeout=180)
        kill_to_exit = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
    print(f"\nkill-to-exit: {kill_to_exit:.1f} s (steps finished before the kill: {_steps_logged(tmp_path)})")
    assert rc != 0, out[-3000:]
    assert kill_to_exit < EXIT_DEADLINE_S, kill_to_exit
    # the error names the call and the rank that died
    assert re.search(r"HybridWorker\.\w+.*: the actor of rank 1 of 2 died", out), out[-3000:]
    left = _wait_gone(run_procs)
    assert not left, [(p, psutil.Process(p).cmdline()[:3]) for p in left]
    new = _shm() - shm_before
    assert not new, sorted(new)


def test_normal_run_leaves_dev_shm_as_it_found_it(quickstart_run):
    """The session's shared quickstart run (tests/e2e/conftest.py) removed the vLLM segments its workers made:
    /dev/shm after it holds nothing that was not there before it."""
    out = quickstart_run.proc.stdout + quickstart_run.proc.stderr
    assert json.loads((quickstart_run.run_dir / "metrics.jsonl").read_text().splitlines()[0])["step"] == 1
    assert "removed the workers' vLLM shared-memory segments from /dev/shm" in out  # the psm_* buffer, at least
    assert not quickstart_run.shm_new, sorted(quickstart_run.shm_new)
