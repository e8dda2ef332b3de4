"""Test-suite wiring: GPU-only tests carry the `gpu` mark and are skipped, with the reason, where CUDA is absent."""

import os

import pytest
import torch

# Multi-rank tests spawn processes; keep each rank single-threaded so 4 ranks share 2 cores without thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")


# Every test under these folders spawns ranks or trains end to end: it is `slow`, so `pytest -m "not slow"` is the
# fast tier (unit tests, no processes). Marked here by folder so a new file there cannot slip into the fast tier.
SLOW_DIRS = ("distributed", "e2e")


def pytest_collection_modifyitems(config, items):
    slow = pytest.mark.slow
    for item in items:
        parts = item.path.relative_to(config.rootpath).parts
        if len(parts) > 1 and parts[0] == "tests" and parts[1] in SLOW_DIRS:
            item.add_marker(slow)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA: run on a GPU machine (tests/gpu/README.md)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
