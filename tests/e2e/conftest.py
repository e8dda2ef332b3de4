"""The one CPU quickstart run the e2e tests share (session scope): `megarl train yaml_configs/cpu_quickstart.yaml`
as a user runs it, with checkpoints.

Each `megarl train` costs ~30 s of start-up on the 2-core machine before its first step, so one 20-step run serves
every check that needs "the plain quickstart": the golden reward curve, the first screen, the end-of-run summary and
plots, learning, fp32 rollout/actor agreement, /dev/shm left as found, and the uninterrupted reference of the resume,
offload and API tests (steps 1-4 and the step-2 / step-4 checkpoints; validation only at steps 10 and 20 and a
constant LR, so its first steps are those of any shorter run of the same config).

The two runs that end abnormally (a killed worker; SIGTERM then Ctrl-C) are session fixtures too: each also serves
a check of training (tests/e2e/fault_runs.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.subprocess_env import clean_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICKSTART_SAVE_EVERY = 2


@dataclass
class QuickstartRun:
    rows: list  # metrics.jsonl, one dict per step
    proc: subprocess.CompletedProcess
    run_dir: Path
    ckpt_dir: Path  # step_000002, step_000004, ... step_000020 (keep_last=0)
    shm_new: set  # /dev/shm entries present after the run that were not there before it


def assert_checkpoint_loads_without_pickle(step_dir, must_have: tuple = ()) -> list[str]:
    """Every torch file (`*.pt`) under checkpoint step directory `step_dir` (megarl's and megatron-core's) loads with
    torch.load(weights_only=True), which refuses any pickled object: loading a checkpoint never runs code from it.
    `must_have`: files (relative paths) that must be among them, so that the check cannot pass on an empty
    directory. Returns the relative paths checked."""
    import torch

    found = sorted(os.path.relpath(os.path.join(d, f), step_dir) for d, _, files in os.walk(step_dir)
                   for f in files if f.endswith(".pt"))
    assert set(must_have) <= set(found), (sorted(set(must_have) - set(found)), found)
    for rel in found:
        torch.load(os.path.join(step_dir, rel), weights_only=True)
    return found


def read_rows(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="session")
def quickstart_run(tmp_path_factory) -> QuickstartRun:
    base = tmp_path_factory.mktemp("quickstart")
    run_dir, ckpt = base / "run", base / "ckpt"
    shm_before = set(os.listdir("/dev/shm"))
    proc = subprocess.run(
        [sys.executable, "-m", "megarl", "train", "yaml_configs/cpu_quickstart.yaml", f"logging.dir={run_dir}",
         f"checkpoint.dir={ckpt}", f"checkpoint.save_every={QUICKSTART_SAVE_EVERY}", "checkpoint.keep_last=0"],
        cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    shm_new = set(os.listdir("/dev/shm")) - shm_before
    return QuickstartRun(read_rows(run_dir), proc, run_dir, ckpt, shm_new)


@pytest.fixture(scope="session")
def pool_runs(tmp_path_factory, joined_ray_env) -> dict:
    """The rollout-pool quickstart's runs in one session (`tests/e2e/async_runs.py`: sync, one_step_off, async, their
    resumes, partial rollouts; and, overlapping the session's last part, the colocated quickstart's `megarl train` in
    one_step_off, out / "colocated"): {"out": its directory, "rows": {run: metrics rows}, "cfg": the shared
    config}."""
    out = tmp_path_factory.mktemp("pool_runs")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "e2e", "async_runs.py"), str(out)], cwd=ROOT,
                          env=joined_ray_env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    report = json.load(open(out / "runs.json"))
    rows = {name: read_rows(out / name) for name in report if not name.startswith("_")}
    print("pool runs (s):", {k: round(v["seconds"], 1) for k, v in report.items() if "seconds" in v},
          report["_session"])
    return {"out": out, "rows": rows, "cfg": json.load(open(out / "config.json"))}


@pytest.fixture(scope="session")
def killed_worker_run(tmp_path_factory):
    """PPO (colocated TP2 critic) whose worker rank 1 is SIGKILLed after step 4 (tests/e2e/fault_runs.py): the
    fault checks of test_worker_faults.py and the uninterrupted PPO run of test_resume.py."""
    from tests.e2e.fault_runs import killed_worker_run

    return killed_worker_run(tmp_path_factory.mktemp("killed_worker"))


@pytest.fixture(scope="session")
def signal_runs(tmp_path_factory) -> dict:
    """The bf16 TIS REINFORCE++ quickstart stopped by SIGTERM after step 4, then resumed and stopped by Ctrl-C
    (tests/e2e/fault_runs.py): the checks of test_stop_signal.py and test_rollout_correction.py."""
    from tests.e2e.fault_runs import signal_runs

    return signal_runs(tmp_path_factory.mktemp("signals"))
