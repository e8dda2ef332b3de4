"""The controller's pure parts (dispatch planning and collection, replica maps) and the launch scripts' argument
handling (--help, --dry-run, missing arguments) and ray_stop.sh's choice of processes. No Ray cluster, no processes
beyond bash and a few `sleep`s. (The scripts starting a real cluster: tests/e2e/test_dynamic_sampling.py.)"""

from __future__ import annotations

import pathlib
import subprocess

import pytest
import torch

from megarl.controller.dispatch import (
    ALL_TO_ALL,
    DP_SPLIT,
    LAST_STAGE_FIRST_RESULT,
    ONE_TO_ALL,
    RANK_ZERO,
    DispatchError,
    DispatchSpec,
    collect,
    dispatch,
    dispatched_methods,
    plan_calls,
    replicas_from_coords,
    replicas_from_group_size,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_plan_and_collect_by_hand():
    s = DispatchSpec(ONE_TO_ALL)
    assert plan_calls(s, (1,), {"k": 2}, 3) == [((1,), {"k": 2})] * 3
    assert collect(DispatchSpec(RANK_ZERO), ["a", "b"]) == "a"
    assert collect(DispatchSpec(LAST_STAGE_FIRST_RESULT), [None, None, "c", "d"]) == "c"
    assert collect(DispatchSpec(LAST_STAGE_FIRST_RESULT), [None, None]) is None
    assert plan_calls(DispatchSpec(ALL_TO_ALL), ([1, 2], "ab"), {"z": (5, 6)}, 2) == [
        ((1, "a"), {"z": 5}), ((2, "b"), {"z": 6}),
    ]


def test_dp_split_plan_chunks_and_concat():
    replica_of = replicas_from_group_size(4, 2)  # tp=2, dp=2: ranks 0,1 -> replica 0; 2,3 -> replica 1
    assert replica_of == [0, 0, 1, 1]
    calls = plan_calls(DispatchSpec(DP_SPLIT), ([1, 2, 3, 4], "same"), {}, 4, replica_of)
    assert [c[0] for c in calls] == [([1, 2], "same"), ([1, 2], "same"), ([3, 4], "same"), ([3, 4], "same")]
    assert calls[0] is calls[1]  # one object per replica: the group ray.put()s it once
    # per replica the first non-None result (the last pipeline stage reports)
    assert collect(DispatchSpec(DP_SPLIT), [None, [1, 2], [3], None], replica_of) == [1, 2, 3]
    t = collect(DispatchSpec(DP_SPLIT), [torch.ones(1, 2), None, torch.zeros(2, 2), None], replica_of)
    assert t.shape == (3, 2)
    assert collect(DispatchSpec(DP_SPLIT), [{"a": 1}, None, {"a": 2}, None], replica_of) == [{"a": 1}, {"a": 2}]


def test_dp_split_batch_round_trip():
    from megarl.data.batch import Batch

    b = Batch({"input_ids": torch.arange(12).view(6, 2)})
    replica_of = [0, 1, 2]
    calls = plan_calls(DispatchSpec(DP_SPLIT), (b,), {}, 3, replica_of)
    assert [c[0][0]["input_ids"][:, 0].tolist() for c in calls] == [[0, 2], [4, 6], [8, 10]]
    back = collect(DispatchSpec(DP_SPLIT), [c[0][0] for c in calls], replica_of)
    assert torch.equal(back["input_ids"], b["input_ids"])


def test_dispatch_errors_name_the_numbers():
    with pytest.raises(DispatchError, match="group_size 3 does not divide the group's 4 ranks"):
        replicas_from_group_size(4, 3, "W.f")
    with pytest.raises(DispatchError, match="ranks disagree on the number of replicas"):
        replicas_from_coords([(0, 2), (1, 3)])
    with pytest.raises(DispatchError, match=r"replica indices \[0, 0\] do not cover 0..1"):
        replicas_from_coords([(0, 2), (0, 2)])
    with pytest.raises(DispatchError, match="must be a list, tuple, tensor or Batch; got dict"):
        plan_calls(DispatchSpec(DP_SPLIT), ({"a": 1},), {}, 2, [0, 1])
    with pytest.raises(TypeError, match="only apply to DP_SPLIT"):
        dispatch(ONE_TO_ALL, group_size=2)


def test_dispatched_methods_include_inherited_only_decorated():
    class Base:
        @dispatch(RANK_ZERO)
        def a(self):
            pass

    class Child(Base):
        @dispatch(DP_SPLIT, group_size=2)
        def b(self, x):
            pass

        def c(self):
            pass

    found = dispatched_methods(Child)
    assert sorted(found) == ["a", "b"] and found["b"].group_size == 2


def _sh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("script", ["ray_start_head.sh", "ray_start_worker.sh", "ray_submit.sh", "ray_stop.sh"])
def test_launch_scripts_have_help(script):
    r = _sh(f"launch/{script}", "--help")
    assert r.returncode == 0 and "launch/" in r.stdout and "ray" in r.stdout


def test_launch_scripts_dry_run_commands():
    assert _sh("launch/ray_start_head.sh", "--port", "6380", "--num-gpus", "8", "--dry-run").stdout.strip().endswith(
        "ray start --head --port 6380 --num-gpus 8"
    )
    assert _sh("launch/ray_start_worker.sh", "--address", "10.0.0.1:6380", "--dry-run").stdout.strip().endswith(
        "ray start --address 10.0.0.1:6380"
    )
    out = _sh(
        "launch/ray_submit.sh", "cfg.yaml", "trainer.steps=2", "--address", "http://h:8265", "--no-wait", "--dry-run"
    )
    assert out.stdout.strip().endswith(
        "ray job submit --address http://h:8265 --no-wait -- megarl train cfg.yaml trainer.steps=2"
    )
    missing = _sh("launch/ray_start_worker.sh")
    assert missing.returncode == 2 and "--address HEAD_IP:PORT is required" in missing.stderr
    missing = _sh("launch/ray_submit.sh")
    assert missing.returncode == 2 and "CONFIG is required" in missing.stderr


def test_ray_submit_driver_mode_command_and_its_refusals():
    """`--driver` runs `megarl train` here with RAY_ADDRESS = the head's GCS address (its run on a 2-node cluster:
    tests/e2e/test_dynamic_sampling.py); what it cannot honour is refused with exit status 2 and a message."""
    out = _sh("launch/ray_submit.sh", "--driver", "--address", "10.0.0.1:6380", "cfg.yaml", "a.b=2", "--verbose",
              "--dry-run")
    assert out.returncode == 0 and out.stdout.strip() == (
        "RAY_AUTH_MODE=token RAY_ADDRESS=10.0.0.1:6380 megarl train cfg.yaml a.b=2 --verbose")
    refusals = {
        ("--driver", "cfg.yaml", "--dry-run"): "--driver needs the head's GCS address",
        ("--driver", "--address", "http://h:8265", "cfg.yaml", "--dry-run"): "not to a URL like 'http://h:8265'",
        ("--driver", "--address", "h", "cfg.yaml", "--dry-run"): "'h' is not HEAD_IP:PORT",
        ("--driver", "--address", "h:1", "--no-wait", "cfg.yaml", "--dry-run"): "--no-wait: only for Ray jobs",
        ("--driver", "--address", "h:1", "cfg.yaml", "steps", "--dry-run"): "'steps' after CONFIG is not a key=value",
        ("--driver", "--address", "h:1", "no_such.yaml"): "config 'no_such.yaml' not found",
        ("cfg.yaml", "--address"): "--address needs a value",
        ("cfg.yaml", "--bogus"): "unknown option '--bogus'",
    }
    for args, message in refusals.items():
        r = _sh("launch/ray_submit.sh", *args)
        assert r.returncode == 2 and message in r.stderr, (args, r.stderr)


def test_ray_stop_without_temp_dir_is_ray_stop_and_checks_its_dir(tmp_path):
    assert _sh("launch/ray_stop.sh", "--force", "--dry-run").stdout.strip() == "ray stop --force"
    bad = _sh("launch/ray_stop.sh", "--temp-dir", str(tmp_path / "nope"))
    assert bad.returncode == 2 and "is not a directory" in bad.stderr


def test_ray_stop_with_temp_dir_stops_only_that_node_and_what_runs_below_it(tmp_path):
    """Stand-ins for two nodes' Ray processes on one machine (command lines naming `--temp-dir=DIR/...` as Ray's do;
    the first has a child, like a raylet's workers): ray_stop.sh --temp-dir stops the first node and its child, and
    leaves the other node's process and one naming a directory whose name merely starts the same way running. Its
    stand-ins are children of this test, so they stay zombies until waited for: ray_stop.sh must count them as gone
    (within the grace period, without SIGKILL)."""
    import os
    import signal
    import sys
    import time

    node, other = tmp_path / "node", tmp_path / "node2"
    node.mkdir()
    other.mkdir()
    code = "import subprocess, sys, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"
    wait = "import time; time.sleep(60)"
    started = [subprocess.Popen([sys.executable, "-c", code, f"--temp-dir={node}/session_1"], start_new_session=True),
               subprocess.Popen([sys.executable, "-c", wait, f"--log-dir={other}/session_2/logs"],
                                start_new_session=True),
               subprocess.Popen([sys.executable, "-c", wait, f"--log-dir={node}x"], start_new_session=True)]
    try:
        import psutil

        parent = psutil.Process(started[0].pid)
        for _ in range(600):  # its child sleep has started (up to 30 s on a loaded machine)
            if parent.children():
                break
            time.sleep(0.05)  # (psutil.wait_procs([]) returned at once: the loop did not wait at all)
        assert parent.children(), "the stand-in node's child `sleep` did not start within 30 s"
        child = parent.children()[0]
        r = _sh("launch/ray_stop.sh", "--temp-dir", str(node), "--grace-period", "5")
        assert r.returncode == 0 and "stopped 2 of 2 Ray process(es)" in r.stdout, r.stdout + r.stderr
        assert "SIGKILL" not in r.stdout, r.stdout
        # the child, orphaned, may stay a zombie until its new parent reaps it: it has exited all the same
        assert started[0].wait(timeout=10) is not None
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
        assert started[1].poll() is None and started[2].poll() is None
        again = _sh("launch/ray_stop.sh", "--temp-dir", str(node))
        assert again.returncode == 0 and "no Ray process" in again.stdout
    finally:
        for p in started:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
