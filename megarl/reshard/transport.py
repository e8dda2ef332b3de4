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


class _BoundedWorks:
    """The works of one `GroupTransport.post`; `wait` raises naming the bridge and the peer of the first that fails
    (gloo bounds each wait by the group's timeout)."""

    def __init__(self, works: list, what: list[str], name: str) -> None:
        self._works, self._what, self._name = works, what, name

    def wait(self) -> None:
        for work, what in zip(self._works, self._what):
            try:
                work.wait()
            except RuntimeError as e:
                raise RuntimeError(f"bridge {self._name!r}: {what} failed or timed out: "
                                   f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
        self._works = []


class GroupTransport:
    """`Transport` over a standalone process group (`megarl.controller.bridge.Bridge`: a gloo group built from its
    own store, not registered with torch.distributed, since a process has one default world and the actor's or the
    rollout pool's is already it). `Message.peer` is a rank of that group; each message is one `group.send` /
    `group.recv` (point-to-point, matched in posting order per pair and by tag), every wait bounded by the group's
    timeout.

    Args:
        group: the `torch.distributed.ProcessGroup` object (e.g. `ProcessGroupGloo(store, rank, size, timeout)`).
        rank: this process's rank in it (refused as a peer: nothing is sent to oneself).
        name: the bridge's name, for errors.
    """

    def __init__(self, group, rank: int, size: int, name: str = "bridge") -> None:
        self.group, self.rank, self.size, self.name = group, rank, size, name

    def begin(self) -> None:
        pass  # gloo connects pairs at construction; nothing is built lazily

    def post(self, sends: Sequence[Message], recvs: Sequence[Message]) -> Pending:
        works, what = [], []
        for m, verb in [(m, "send to") for m in sends] + [(m, "receive from") for m in recvs]:
            if not 0 <= m.peer < self.size or m.peer == self.rank:
                raise ValueError(f"bridge {self.name!r}: peer {m.peer} is not another of its {self.size} ranks "
                                 f"(this is bridge rank {self.rank})")
            call = self.group.send if verb == "send to" else self.group.recv
            works.append(call([m.tensor], m.peer, m.tag))
            what.append(f"{verb} bridge rank {m.peer} ({m.tensor.numel() * m.tensor.element_size()} bytes, tag "
                        f"{m.tag}) on bridge rank {self.rank}")
        if not works:
            return _Done()
        return _BoundedWorks(works, what, self.name)
