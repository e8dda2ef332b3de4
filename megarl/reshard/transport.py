"""How reshard buffers travel between ranks: one small protocol, one torch.distributed implementation.

The executor (and delta mode) never call `torch.distributed` point-to-point functions themselves. Per bucket they
build the list of messages this rank sends and the list it receives, `post` them together, and `wait`:

    pending = transport.post(sends=[Message(peer, tensor, tag), ...], recvs=[Message(peer, buffer, tag), ...])
    pending.wait()            # the receive buffers now hold the peers' data; the send buffers may be reused

Peers are ranks of the transport's process group (the reshard's bridge: its group ranks are the plan's ranks), or
global ranks when it has none (the default world). Between one pair of ranks, messages are matched in the order
they are posted (tags tell them apart where the backend supports tags; NCCL ignores tags, so both sides must post
in the same order, which the executor does: per peer, sorted by peer, payload before indices before checksums).

`TorchP2PTransport` runs the messages as one `batch_isend_irecv` (gloo on CPU, NCCL on GPU) over a process group.
NCCL builds its communicator lazily at the first operation on a group, and for a batched P2P that first operation
must involve every rank of the group (torch.distributed docs, `batch_isend_irecv`); a rank with no messages in a
bucket posts nothing. So `begin()` -- called by every rank at the start of every reshard -- runs one barrier on
the group the first time it sees that group on a lazily-initialising backend, after which ranks may skip buckets
freely. Across pools (trainer and rollout engines) the group is a bridge over the union of both pools, built
with the training ranks first (`new_group(ranks, sort_ranks=False)`); its group ranks need not equal the global
ones, so each peer is mapped explicitly. Another transport (e.g. a separate world) implements the same two calls.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Optional, Protocol, Sequence

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class Message:
    """One buffer to send to, or receive from, rank `peer` of the transport's group (a contiguous tensor; receive
    buffers are written in place)."""

    peer: int
    tensor: torch.Tensor
    tag: int = 0


class Pending(Protocol):
    def wait(self) -> None:
        """Block until every message of the `post` completed."""


class Transport(Protocol):
    """Point-to-point exchange of one bucket's buffers (see the module docstring)."""

    def begin(self) -> None:
        """Called by every rank of the reshard, at its start, before any `post` (collective the first time)."""

    def post(self, sends: Sequence[Message], recvs: Sequence[Message]) -> Pending:
        """Start sending `sends` and receiving into `recvs`; returns immediately."""


class _Done:
    def wait(self) -> None:
        pass


class _Requests:
    def __init__(self, requests) -> None:
        self._requests = requests

    def wait(self) -> None:
        for req in self._requests:
            req.wait()
        self._requests = []


# Process groups `begin()` already saw (their lazily built NCCL communicator, if any, is initialised). Weak: an
# entry leaves with its group object, so a group of a rebuilt world -- which may reuse a freed group's `id()` --
# is never taken for ready. (torch's ProcessGroup, a pybind11 class, takes weak references; checked on 2.13.)
_READY_GROUPS: weakref.WeakSet[dist.ProcessGroup] = weakref.WeakSet()


def builds_communicator_lazily(backend: str) -> bool:
    """True when `backend` (as `dist.get_backend` returns it) includes NCCL, which builds a group's communicator at
    its first operation: "nccl", or a per-device string such as "cpu:gloo,cuda:nccl"."""
    return "nccl" in backend.lower()


class TorchP2PTransport:
    """`Transport` over a torch.distributed process group: one `batch_isend_irecv` per `post`.

    Args:
        group: the process group spanning the reshard's ranks; `Message.peer` is a rank of this group, mapped to
            its global rank here (`dist.get_process_group_ranks`: group rank i -> global rank). None = the default
            world (peers are global ranks). On NCCL, `begin()` barriers on this group once, so every rank of it
            must run the reshard.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None) -> None:
        self.group = group
        self._global: Optional[list[int]] = None  # group rank -> global rank, read at the first post

    def global_rank(self, peer: int) -> int:
        """Global rank of group rank `peer`."""
        if self.group is None:
            return peer
        if self._global is None:
            self._global = list(dist.get_process_group_ranks(self.group))
        if not 0 <= peer < len(self._global):
            raise ValueError(f"peer {peer} is outside the bridge group's {len(self._global)} ranks")
        return self._global[peer]

    def begin(self) -> None:
        if not dist.is_initialized():
            return
        group = self.group if self.group is not None else dist.group.WORLD
        if group in _READY_GROUPS:
            return
        if builds_communicator_lazily(str(dist.get_backend(self.group))):
            # Builds the group's communicator with every rank present (issue 15 item 9): later batches may leave
            # ranks out.
            dist.barrier(group=self.group, device_ids=[torch.cuda.current_device()])
        _READY_GROUPS.add(group)

    def post(self, sends: Sequence[Message], recvs: Sequence[Message]) -> Pending:
        ops = [dist.P2POp(dist.isend, m.tensor, self.global_rank(m.peer), self.group, tag=m.tag) for m in sends]
        ops += [dist.P2POp(dist.irecv, m.tensor, self.global_rank(m.peer), self.group, tag=m.tag) for m in recvs]
        if not ops:
            return _Done()
        return _Requests(dist.batch_isend_irecv(ops))


def exchange(transport: Transport, sends: Sequence[Message], recvs: Sequence[Message]) -> None:
    """`post` then `wait`."""
    transport.post(sends, recvs).wait()
