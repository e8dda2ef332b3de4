"""benchmarks/reshard.py's own collectives (timing max, weights-exact flag) run on the platform's device tensors,
so the same code works in an NCCL-only world on GPU (issue 15 item 4); here on 2 gloo ranks."""

from __future__ import annotations

import importlib.util
import os
import time

import pytest

from megarl.platform.spawn import run_ranks

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "reshard.py")


def _load_benchmark():
    spec = importlib.util.spec_from_file_location("reshard_benchmark", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _worker(rank, world_size):
    from megarl.platform.device import local_device

    bench = _load_benchmark()
    _, seconds = bench.timed(lambda: time.sleep(0.3 if rank == 1 else 0.0))
    return {
        "device": str(bench.collective_device()), "platform_device": str(local_device()), "seconds": seconds,
        "all_true": bench._all_ranks_true(True), "one_false": bench._all_ranks_true(rank == 0),
    }


def test_collective_device_is_the_platform_device():
    from megarl.platform.device import local_device

    assert _load_benchmark().collective_device() == local_device()


@pytest.mark.slow
def test_benchmark_collectives_reduce_over_ranks():
    out = run_ranks(2, _worker, timeout_s=120)
    for r in out:
        assert r["device"] == r["platform_device"]
        assert r["seconds"] >= 0.3  # the slowest rank's time, on every rank
        assert r["all_true"] is True and r["one_false"] is False
