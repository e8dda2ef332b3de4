"""How the weights fan out from the training pool to the rollout engines: a pure cost model (`sync_fanout`).

Three shapes of the same sync, each as phases of point-to-point traffic with the bytes every rank sends and receives
(bridge ranks, `planner` module docstring), and the time those bytes imply on full-duplex links:

  "direct"            megarl's shard-to-shard plan (`plan_reshard` into the `InferLayout`): every inference rank
                      receives exactly its vLLM shard from the training ranks, one phase on the bridge link.
  "gather_broadcast"  (a) slime's / verl's checkpoint-engine shape: 1. per pipeline stage one training rank (the
                      stage's tp0/cp0/dp0 rank) gathers the full HF tensors of its stage (the bytes it does not
                      hold, taken from the least-loaded holder of each run) over the training pool's link; 2. each
                      such leader broadcasts its stage's full tensors to every inference rank (a pipelined chain:
                      the leader sends the stage once, each inference rank receives it and forwards it, the last
                      one only receives; its first hop crosses the bridge, the others the rollout pool, so it moves
                      at the slower of the two); every inference rank receives the whole model.
  "replica_broadcast" (b) 1. the direct plan into engine 0 only, on the bridge link; 2. engine 0's TP rank j
                      broadcasts its shard to TP rank j of every other engine (a pipelined chain over the engines),
                      on the rollout pool's link. With one engine this is "direct".

Time of a phase = max over ranks of max(bytes sent, bytes received) / the bandwidth of the phase's link (a rank's
link is full duplex; a pipelined chain moves at the rate of its slowest hop); time of a shape = sum of its phases
(they run one after the other). It is what the bytes imply on an ideal network: no latency, no congestion, no
compute. `choose_fanout` returns the cheapest shape ("auto") or the one asked for.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Optional

from megarl.models.spec import ModelSpec
from megarl.parallel.topology import RoleTopology
from megarl.reshard.layouts import DEFAULT_TRAIN_LAYOUT, InferLayout, Piece, TrainLayout, vllm_needs
from megarl.reshard.planner import plan_reshard
from megarl.reshard.routing import ByteRate, HolderIndex, merge_runs, route_runs

SYNC_FANOUTS = ("direct", "gather_broadcast", "replica_broadcast")


@dataclasses.dataclass(frozen=True)
class Links:
    """Per-rank link bandwidths, bytes per second in each direction.

    bridge: between a training rank and an inference rank.
    rollout_pool: between two inference ranks ((b)'s broadcast among engines).
    train_pool: between two training ranks ((a)'s gather); None = `rollout_pool`.
    """

    bridge: float
    rollout_pool: float
    train_pool: Optional[float] = None

    def __post_init__(self) -> None:
        for name in ("bridge", "rollout_pool", "train_pool"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"link bandwidth {name} must be > 0 bytes/s, got {value!r}")

    def bandwidth(self, link: str) -> float:
        """Bytes/s of `link` ("bridge", "rollout_pool" or "train_pool"; "a+b": a path over both, the slower)."""
        if "+" in link:
            return min(self.bandwidth(part) for part in link.split("+"))
        if link == "train_pool":
            return self.train_pool if self.train_pool is not None else self.rollout_pool
        if link not in ("bridge", "rollout_pool"):
            raise ValueError(f"unknown link {link!r}: bridge, rollout_pool or train_pool")
        return getattr(self, link)


@dataclasses.dataclass(frozen=True)
class Phase:
    """One phase of a fan-out: bytes each rank sends and receives (bridge rank -> bytes) over one kind of link."""

    name: str
    link: str
    sent: dict[int, int]
    received: dict[int, int]

    @property
    def max_sent(self) -> int:
        return max(self.sent.values(), default=0)

    @property
    def max_received(self) -> int:
        return max(self.received.values(), default=0)

    @property
    def max_moved(self) -> int:
        """max over ranks of max(sent, received), bytes."""
        ranks = set(self.sent) | set(self.received)
        return max((max(self.sent.get(r, 0), self.received.get(r, 0)) for r in ranks), default=0)

    def time_s(self, links: Links) -> float:
        """Seconds the phase's bytes imply: `max_moved` / the link's bandwidth."""
        return self.max_moved / links.bandwidth(self.link)


@dataclasses.dataclass(frozen=True)
class FanoutCost:
    """One fan-out shape: its phases, the most bytes any rank sends / receives over all phases, the implied time.

    max_sent / max_received: max over ranks of the rank's bytes summed over the phases.
    time_s: sum of the phases' times under `links`.
    """

    strategy: str
    phases: tuple[Phase, ...]
    max_sent: int
    max_received: int
    time_s: float


def fanout_cost(strategy: str, phases: tuple[Phase, ...], links: Links) -> FanoutCost:
    """Totals and implied time of `phases` (pure arithmetic; see the module docstring)."""
    sent: dict[int, int] = defaultdict(int)
    received: dict[int, int] = defaultdict(int)
    for phase in phases:
        for r, b in phase.sent.items():
            sent[r] += b
        for r, b in phase.received.items():
            received[r] += b
    return FanoutCost(strategy, tuple(phases), max(sent.values(), default=0), max(received.values(), default=0),
                      sum(p.time_s(links) for p in phases))


def chain_broadcast(root: int, receivers: list[int], nbytes: int, sent: dict[int, int],
                    received: dict[int, int]) -> None:
    """Add a pipelined chain broadcast of `nbytes` from `root` through `receivers` (in order) to the tallies: the
    root sends once, each receiver receives once and forwards to the next, the last only receives."""
    if not receivers:
        return
    sent[root] += nbytes
    for i, r in enumerate(receivers):
        received[r] += nbytes
        if i + 1 < len(receivers):
            sent[r] += nbytes


def direct_phases(spec: ModelSpec, train: RoleTopology, infer: InferLayout, dtype_bytes: int = 2,
                  train_layout: TrainLayout = DEFAULT_TRAIN_LAYOUT) -> tuple[Phase, ...]:
    """megarl's plan: one bridge phase with the plan's bytes sent and received per rank."""
    plan = plan_reshard(spec, train, infer, dtype_bytes=dtype_bytes, train_layout=train_layout, keep_ops=False)
    return (_plan_phase("shard-to-shard", plan),)


def gather_broadcast_phases(spec: ModelSpec, train: RoleTopology, infer: InferLayout, dtype_bytes: int = 2,
                            train_layout: TrainLayout = DEFAULT_TRAIN_LAYOUT) -> tuple[Phase, ...]:
    """(a): gather each stage's full tensors on its leader (training pool), then chain-broadcast them to every
    inference rank (bridge). Each HF tensor belongs to the first stage holding it (a tied output layer's copy on
    the last stage is not sent twice)."""
    index = HolderIndex(spec, train, train_layout)
    rate = ByteRate(spec, dtype_bytes)
    stage_of = {r: train.coord(r).pp for r in train.ranks}
    owner: dict[str, int] = {}
    for name, runs in index.runs.items():
        owner[name] = min(stage_of[r] for r, *_ in runs)
    g_sent: dict[int, int] = defaultdict(int)
    g_recv: dict[int, int] = defaultdict(int)
    b_sent: dict[int, int] = defaultdict(int)
    b_recv: dict[int, int] = defaultdict(int)
    load: dict[int, int] = defaultdict(int)
    for stage in range(train.pp):
        leader = train.rank_of(pp=stage)
        stage_runs = {name: [run for run in runs if stage_of[run[0]] == stage]
                      for name, runs in index.runs.items() if owner[name] == stage}
        stage_bytes = 0
        for name, runs in stage_runs.items():
            by_dim: dict[int, list[tuple[int, int]]] = defaultdict(list)
            for _, _, dim, start, stop in runs:
                by_dim[dim].append((start, stop))
            for dim, spans in by_dim.items():
                for lo, hi in merge_runs(spans):
                    piece = Piece(name, dim, lo, hi)
                    stage_bytes += rate(piece)
                    for src, _, _, _, nbytes in route_runs(stage_runs, leader, piece, load, rate):
                        if src != leader:
                            load[src] += nbytes
                            g_sent[src] += nbytes
                            g_recv[leader] += nbytes
        chain_broadcast(leader, [r for r in infer.ranks if r != leader], stage_bytes, b_sent, b_recv)
    return (Phase("gather to stage leaders", "train_pool", dict(g_sent), dict(g_recv)),
            Phase("broadcast full tensors to every inference rank", "bridge+rollout_pool", dict(b_sent), dict(b_recv)))


def replica_broadcast_phases(spec: ModelSpec, train: RoleTopology, infer: InferLayout, dtype_bytes: int = 2,
                             train_layout: TrainLayout = DEFAULT_TRAIN_LAYOUT) -> tuple[Phase, ...]:
    """(b): the direct plan into engine 0 (bridge), then engine 0's TP rank j chain-broadcasts its shard to TP rank
    j of engines 1.. (rollout pool)."""
    first = dataclasses.replace(infer, replicas=1)
    plan = plan_reshard(spec, train, first, dtype_bytes=dtype_bytes, train_layout=train_layout, keep_ops=False)
    sent: dict[int, int] = defaultdict(int)
    received: dict[int, int] = defaultdict(int)
    rate = ByteRate(spec, dtype_bytes)
    for j in range(infer.tp):
        shard = sum(rate(p.piece) for p in vllm_needs(spec, infer.tp, j, infer.ep))
        engines = [infer.rank_offset + k * infer.tp + j for k in range(infer.replicas)]
        chain_broadcast(engines[0], engines[1:], shard, sent, received)
    return (_plan_phase("shard-to-shard into engine 0", plan),
            Phase("broadcast shards to the other engines", "rollout_pool", dict(sent), dict(received)))


_PHASES = {"direct": direct_phases, "gather_broadcast": gather_broadcast_phases,
           "replica_broadcast": replica_broadcast_phases}


def fanout_costs(spec: ModelSpec, train: RoleTopology, infer: InferLayout, links: Links, dtype_bytes: int = 2,
                 train_layout: TrainLayout = DEFAULT_TRAIN_LAYOUT) -> dict[str, FanoutCost]:
    """{strategy: its cost} for every shape of `SYNC_FANOUTS`."""
    return {name: fanout_cost(name, _PHASES[name](spec, train, infer, dtype_bytes, train_layout), links)
            for name in SYNC_FANOUTS}


def choose_fanout(costs: dict[str, FanoutCost], sync_fanout: str = "auto") -> FanoutCost:
    """The cost of `sync_fanout`, or for "auto" the cheapest in time (ties: the order of `SYNC_FANOUTS`, direct
    first)."""
    if sync_fanout == "auto":
        return min((costs[name] for name in SYNC_FANOUTS if name in costs), key=lambda c: c.time_s)
    if sync_fanout not in costs:
        raise ValueError(f"sync_fanout={sync_fanout!r}: choose auto or one of {', '.join(SYNC_FANOUTS)}")
    return costs[sync_fanout]


def _plan_phase(name: str, plan) -> Phase:
    return Phase(name, "bridge", {s.rank: s.bytes_sent for s in plan.stats if s.bytes_sent},
                 {s.rank: s.bytes_received for s in plan.stats if s.bytes_received})
