"""Resource pools: the devices a worker group runs on, reserved up front with Ray placement groups.

Data path: the controller (`megarl train`) builds one `ResourcePool` per entry of `resources.pools`; each pool
reserves `nodes` x `devices_per_node` *device slots* -- one placement-group bundle per slot ({"CPU": c} on CPU,
{"GPU": 1, "CPU": c} on GPU) -- and a `WorkerGroup` then pins one Ray actor to each bundle. Slots are numbered
node-major (slot = node * devices_per_node + local index), which is the global-rank order of
`megarl.config.placement` and the rank order of the worker group.

Each node of a pool is one placement group with strategy STRICT_PACK (all of that node's slots on one Ray node;
a single-node pool is therefore one STRICT_PACK group). Reservation is bounded: `ready(timeout_s)` raises
`ResourceError` naming the pool and the numbers instead of hanging, and a request no node of the cluster could
ever satisfy fails at once, without waiting.
"""

from __future__ import annotations

import time
from typing import Any

_DEVICES = ("cpu", "cuda")


class ResourceError(RuntimeError):
    """The cluster cannot (or not within the timeout) give a pool the slots it asks for."""


class ResourcePool:
    """`nodes` x `devices_per_node` device slots reserved as Ray placement groups (one per node, STRICT_PACK).

    Args:
        name: pool name, used in errors and actor names (e.g. "actor_pool").
        nodes: Ray nodes the pool spans.
        devices_per_node: device slots per node = worker processes per node.
        device: "cpu" (bundle {"CPU": cpus_per_slot}) or "cuda" (bundle {"GPU": 1, "CPU": cpus_per_slot}).
        cpus_per_slot: CPUs reserved per slot; fractional values let several workers share a core (the CPU test
            machines run 2 workers in `ray.init(num_cpus=2)`, the driver needs none).
        timeout_s: how long `ready()` waits by default for the cluster to grant the reservation.

    The placement groups are created by the constructor (Ray grants them asynchronously); call `ready()` (the
    `WorkerGroup` does) before placing actors. Must be called with Ray initialised (`ray.init` or `ray start`).
    """

    def __init__(
        self,
        name: str,
        nodes: int,
        devices_per_node: int,
        device: str = "cpu",
        cpus_per_slot: float = 1.0,
        timeout_s: float = 60.0,
    ) -> None:
        import ray

        if device not in _DEVICES:
            raise ValueError(f"pool {name!r}: device must be one of {'|'.join(_DEVICES)}, got {device!r}")
        if nodes < 1 or devices_per_node < 1:
            raise ValueError(
                f"pool {name!r}: nodes and devices_per_node must be >= 1, got {nodes} x {devices_per_node}"
            )
        if cpus_per_slot < 0:
            raise ValueError(f"pool {name!r}: cpus_per_slot must be >= 0, got {cpus_per_slot}")
        if not ray.is_initialized():
            raise RuntimeError(f"pool {name!r}: Ray is not initialised; call ray.init() (or join a cluster) first")
        self.name = name
        self.nodes = nodes
        self.devices_per_node = devices_per_node
        self.device = device
        self.cpus_per_slot = float(cpus_per_slot)
        self.timeout_s = timeout_s
        self._ready = False
        self._check_cluster_can_fit()
        from ray.util.placement_group import placement_group

        self.placement_groups = [
            placement_group([self.bundle] * devices_per_node, strategy="STRICT_PACK", name=f"megarl:{name}:node{n}")
            for n in range(nodes)
        ]

    # -- what the pool asks for ----------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        """Device slots in the pool (= ranks of a worker group on it)."""
        return self.nodes * self.devices_per_node

    @property
    def bundle(self) -> dict[str, float]:
        """The resources of one slot."""
        b: dict[str, float] = {}
        if self.device == "cuda":
            b["GPU"] = 1.0
        if self.cpus_per_slot > 0:
            b["CPU"] = self.cpus_per_slot
        return b

    def actor_resources(self) -> dict[str, Any]:
        """`ray.remote(...).options` resources for the actor that occupies one slot (all of the slot)."""
        return {"num_cpus": self.cpus_per_slot, "num_gpus": 1.0 if self.device == "cuda" else 0.0}

    def slot(self, rank: int) -> tuple[Any, int]:
        """(placement group, bundle index) of slot `rank` (node-major)."""
        if not 0 <= rank < self.world_size:
            raise IndexError(f"pool {self.name!r} has {self.world_size} slots, asked for slot {rank}")
        return self.placement_groups[rank // self.devices_per_node], rank % self.devices_per_node

    def _need_text(self) -> str:
        return (
            f"{self.nodes} node(s) x {self.devices_per_node} slot(s) of {self.bundle} "
            f"= {self.world_size} {self.device} slot(s)"
        )

    # -- reservation -----------------------------------------------------------------------------------------------

    def _check_cluster_can_fit(self) -> None:
        """Fail at once if no `nodes` alive Ray nodes each have (in total, busy or not) one node's worth of slots."""
        import ray

        per_node = {k: v * self.devices_per_node for k, v in self.bundle.items()}
        alive = [n for n in ray.nodes() if n.get("Alive")]
        fitting = [n for n in alive if all(n.get("Resources", {}).get(k, 0.0) >= v for k, v in per_node.items())]
        if len(fitting) < self.nodes:
            have = [
                {k: n.get("Resources", {}).get(k, 0.0) for k in per_node} | {"ip": n.get("NodeManagerAddress")}
                for n in alive
            ]
            raise ResourceError(
                f"pool {self.name!r} needs {self._need_text()}, i.e. {self.nodes} node(s) with {per_node} each, "
                f"but only {len(fitting)} of the cluster's {len(alive)} node(s) are that large: {have}. "
                f"Shrink the pool (nodes/devices_per_node/cpus_per_slot) or add nodes (launch/ray_start_worker.sh)."
            )

    def ready(self, timeout_s: float | None = None) -> "ResourcePool":
        """Block until every placement group is granted, at most `timeout_s` (default: the pool's `timeout_s`).

        Raises ResourceError naming the pool, what it asked for and what the cluster has free; the ungranted
        reservation is removed so it does not linger in Ray's queue.
        """
        if self._ready:
            return self
        import ray

        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        refs = [pg.ready() for pg in self.placement_groups]
        t0 = time.monotonic()
        done, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if pending:
            waiting = [i for i, r in enumerate(refs) if r in pending]
            free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
            self.shutdown()
            raise ResourceError(
                f"pool {self.name!r}: {len(pending)} of {self.nodes} node reservation(s) (nodes {waiting}) not "
                f"granted within {time.monotonic() - t0:.1f}s; the pool needs {self._need_text()}, the cluster has "
                f"{free} free. Other pools or jobs hold the rest: free them, shrink this pool, or raise timeout_s."
            )
        self._ready = True
        return self

    def shutdown(self) -> None:
        """Remove the placement groups (idempotent). Actors still placed on them are killed by Ray."""
        from ray.util.placement_group import remove_placement_group

        for pg in getattr(self, "placement_groups", []):
            try:
                remove_placement_group(pg)
            except Exception:  # already removed, or Ray shut down under us: nothing left to free
                pass
        self.placement_groups = []
        self._ready = False

    def __repr__(self) -> str:
        return (
            f"ResourcePool({self.name!r}, nodes={self.nodes}, devices_per_node={self.devices_per_node}, "
            f"device={self.device!r})"
        )

