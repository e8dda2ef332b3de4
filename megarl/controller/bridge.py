"""The bridge: a process group over the union of two pools (the actor's and the rollout engines'), through which the
actor's shards reach the engines (`megarl.rollout.service.PoolRollout`).

Rank numbering (the reshard planner's "bridge ranks"): the actor pool's ranks first, 0..T-1 (= their ranks in the
actor pool's world), then the rollout pool's, T..T+R-1 (T + their rank in the rollout pool's world).

Each pool is already its own torch.distributed default world (one per process), so the bridge is a standalone group:
`torch.distributed.ProcessGroupGloo` over a `PrefixStore` of a `TCPStore` whose server runs on bridge rank 0 (the
actor pool's rank 0). The controller chooses the rendezvous -- a host and a port free on actor rank 0's node,
asked of that rank (`WorkerGroup.rank_address`) -- and hands the same `BridgeSpec` to both groups' workers, which
call `connect_bridge` concurrently (construction is collective over the bridge's T+R ranks). Gloo only: the bridge
moves CPU tensors (the CPU build; a GPU bridge over NCCL is left to the GPU issue).

Every wait is bounded: the store by `timeout_s` at connection, each send/receive by the group's timeout, and a
failure names the bridge and the peer (`megarl.reshard.transport.GroupTransport`).
"""

from __future__ import annotations

import dataclasses
import datetime


@dataclasses.dataclass(frozen=True)
class BridgeSpec:
    """Where and how big: `host`:`port` = the TCPStore server (on bridge rank 0); `train_ranks` (T) + `rollout_ranks`
    (R) = the bridge's size; `timeout_s` bounds connection and every transfer; `name` appears in errors."""

    host: str
    port: int
    train_ranks: int
    rollout_ranks: int
    timeout_s: float = 300.0
    name: str = "actor-rollout"

    @property
    def size(self) -> int:
        return self.train_ranks + self.rollout_ranks

    def rank(self, side: str, pool_rank: int) -> int:
        """Bridge rank of rank `pool_rank` of the 'train' or 'rollout' pool."""
        if side == "train":
            if not 0 <= pool_rank < self.train_ranks:
                raise ValueError(f"bridge {self.name!r}: train pool rank {pool_rank} outside 0..{self.train_ranks - 1}")
            return pool_rank
        if side == "rollout":
            if not 0 <= pool_rank < self.rollout_ranks:
                raise ValueError(f"bridge {self.name!r}: rollout pool rank {pool_rank} outside "
                                 f"0..{self.rollout_ranks - 1}")
            return self.train_ranks + pool_rank
        raise ValueError(f"side must be 'train' or 'rollout', got {side!r}")


class Bridge:
    """This process's end of the bridge: `group` (a standalone gloo `ProcessGroup`), `rank`, `size`, and the
    reshard `transport` over it."""

    def __init__(self, spec: BridgeSpec, group, rank: int, store) -> None:
        from megarl.reshard.transport import GroupTransport

        self.spec, self.group, self.rank, self.size = spec, group, rank, spec.size
        self._store = store  # kept alive: on rank 0 it is the server every other rank talks to
        self.transport = GroupTransport(group, rank, spec.size, spec.name)

    def describe(self) -> str:
        return f"bridge {self.spec.name!r} rank {self.rank} of {self.size} via {self.spec.host}:{self.spec.port}"


def connect_bridge(spec: BridgeSpec, rank: int) -> Bridge:
    """Join the bridge as `rank` (collective over all `spec.size` ranks; rank 0 hosts the store). Raises naming the
    bridge and the rendezvous when the others do not arrive within `spec.timeout_s`."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=spec.timeout_s)
    try:
        store = dist.TCPStore(spec.host, spec.port, spec.size, rank == 0, timeout=timeout, wait_for_workers=False)
        group = dist.ProcessGroupGloo(dist.PrefixStore(f"megarl/{spec.name}/", store), rank, spec.size, timeout)
    except (RuntimeError, dist.DistStoreError) as e:
        raise RuntimeError(f"bridge {spec.name!r}: rank {rank} of {spec.size} could not connect through "
                           f"{spec.host}:{spec.port} within {spec.timeout_s:.0f} s: {e}") from e
    return Bridge(spec, group, rank, store)
