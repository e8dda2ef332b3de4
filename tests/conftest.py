"""Test-suite wiring: GPU-only tests carry the `gpu` mark and are skipped, with the reason, where CUDA is absent."""

import os

import pytest
import torch

# Multi-rank tests spawn processes; keep each rank single-threaded so 4 ranks share 2 cores without thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA: run on a GPU machine (tests/gpu/README.md)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
