"""TorchP2PTransport.begin's once-per-group NCCL barrier: which backend strings get it, and how groups are
remembered (weakly, so a rebuilt world's group is never taken for ready). No torch.distributed world: `dist` is a
stand-in recording the barriers."""

from __future__ import annotations

import gc
import types

import pytest
import torch

from megarl.reshard import transport
from megarl.reshard.transport import TorchP2PTransport, builds_communicator_lazily


@pytest.mark.parametrize("backend, lazy", [
    ("nccl", True),
    ("cpu:gloo,cuda:nccl", True),  # a group with a backend per device type
    ("cuda:nccl,cpu:gloo", True),
    ("gloo", False),
    ("cpu:gloo", False),
    ("mpi", False),
])
def test_backend_strings_that_build_the_communicator_lazily(backend, lazy):
    assert builds_communicator_lazily(backend) is lazy


class _Group:
    """Stands in for a ProcessGroup (a plain object: takes weak references, as torch's does)."""

    def __init__(self, name: str, backend: str) -> None:
        self.name, self.backend = name, backend


@pytest.fixture
def fake_dist(monkeypatch):
    barriers = []
    world = _Group("world", "cpu:gloo,cuda:nccl")
    fake = types.SimpleNamespace(
        is_initialized=lambda: True,
        group=types.SimpleNamespace(WORLD=world),
        get_backend=lambda group=None: (group or world).backend,
        barrier=lambda group=None, device_ids=None: barriers.append((group or world).name),  # names only: no references
    )
    monkeypatch.setattr(transport, "dist", fake)
    monkeypatch.setattr(transport, "_READY_GROUPS", type(transport._READY_GROUPS)())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    fake.barriers = barriers
    return fake


def test_begin_barriers_once_per_nccl_group_and_never_on_gloo(fake_dist):
    nccl, gloo = _Group("tp", "nccl"), _Group("dp", "gloo")
    for _ in range(2):
        TorchP2PTransport(nccl).begin()
        TorchP2PTransport(gloo).begin()
        TorchP2PTransport().begin()  # the default world, a mixed "cpu:gloo,cuda:nccl" group
    assert fake_dist.barriers == ["tp", "world"]


def test_a_rebuilt_group_is_not_taken_for_ready(fake_dist):
    old = _Group("old", "nccl")
    TorchP2PTransport(old).begin()
    assert len(transport._READY_GROUPS) == 1
    del old
    gc.collect()
    assert len(transport._READY_GROUPS) == 0  # the entry left with its group: a new one (same id or not) barriers
    new = _Group("new", "nccl")
    TorchP2PTransport(new).begin()
    assert fake_dist.barriers == ["old", "new"]
