"""Reshard planner: pure, no torch.distributed. (model, training layout, inference layout) -> transfer plan.

Two rank spaces in one "bridge" numbering: the training ranks (`RoleTopology.ranks`) hold Megatron shards, the
inference ranks (`layouts.InferLayout.ranks`) need vLLM shards. Colocated (the hybrid engine, `plan_reshard(spec,
train, infer_tp)`) they are the same ranks; disaggregated (a rollout pool, `plan_reshard(spec, train,
InferLayout(tp, replicas, rank_offset=T))`) they are disjoint: a rank may only send or only receive, and every
inference rank receives its whole shard (its lower bound: it holds nothing).

For every inference rank the plan lists the HF-layout pieces it needs (`layouts.vllm_needs`) and, for each, the
training rank it comes from:
  1. local first: whatever the rank already holds in its Megatron shards is copied in place, never sent;
  2. the rest from a rank that holds it, choosing among the holders (DP replicas; TP ranks for replicated norms)
     the one with the fewest bytes assigned so far, which balances the send load across replicas.
Every byte a rank needs but does not hold is received exactly once, so the bytes received equal the lower bound
for the rank mapping. That bound is computed from the layouts alone (`lower_bound_bytes`: for each inference rank,
bytes it needs minus bytes of (its Megatron holdings intersected with its needs), no reference to the chosen ops),
so "received == bound" is a real check of the plan; the plan's own figure (needed minus what it copied locally)
is reported beside it, with what a naive "gather the full model on every rank" moves.

Across pools (no rank both trains and infers) the choice among holders is the whole routing (`route_pool`): a run
only one training rank holds is that rank's to send (a pipeline stage's layers, an EP rank's experts, a TP rank's
half); the runs several ranks hold (the DP / EP replicas of dense weights; the TP ranks' replicated norms) are then
levelled over their holders, cut into whole rows where needed, so that the busiest sender sends the least any plan
can: max over sets S of training ranks of (bytes only S holds) / |S| (`PlanTraffic` reports max and mean;
tests/unit/test_reshard_disaggregated.py checks the bound). The colocated plan keeps its run-by-run routing.
No rank gathers a full tensor: a sender sends slices of its own shards. The fan-out alternatives (gather then
broadcast; one engine then broadcast) are costed in `fanout`.

Rank mapping: inference replicas are blocks of `infer_tp` consecutive bridge ranks (how vLLM's external launcher
forms its TP groups). Within each block the planner can choose which rank plays which inference TP rank;
`choose_mapping` searches the permutations for the one that keeps the most bytes local (ties keep the natural
order, the one vLLM realises). vLLM's external launcher fixes TP rank = position in the block, so the trainer plans
with the natural order (`plan_reshard`'s default, `search_mapping=False`) and checks at start-up that its engine
agrees (`check_engine_mapping`); `search_mapping=True` shows what a launcher that lets us choose would save.
The training side is ours to permute instead: a rank's Megatron coordinates are `train.coord(rank)`, which follow
`RoleTopology.rank_order`, and `megarl.reshard.rank_order` chooses that order (actor.parallel.rank_order: reshard)
so that each inference block holds more of what it needs.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections import defaultdict
from typing import Optional

from megarl.checkpoint.name_map import cached_hf_shapes, hf_shapes
from megarl.models.spec import ModelSpec
from megarl.parallel.topology import RoleTopology
from megarl.reshard.layouts import (
    DEFAULT_TRAIN_LAYOUT,
    InferLayout,
    Piece,
    Placement,
    TrainLayout,
    megatron_holdings,
    piece_bytes,
    vllm_needs,
)
from megarl.reshard.routing import ByteRate, HolderIndex, merge_runs, route_pool, route_runs


@dataclasses.dataclass(frozen=True)
class TransferOp:
    """Move `piece` from `src`'s Megatron parameter to `dst`'s vLLM parameter (`src == dst`: a local copy).

    Offsets are along `piece.dim` inside the local tensors; `nbytes` at the plan's element size.
    """

    src: int
    dst: int
    piece: Piece
    src_param: str
    src_offset: int
    dst_param: str
    dst_offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class RankStats:
    """Per-rank byte accounting (all in bytes), one per bridge rank of the plan (inference and training ranks).

    infer_tp_rank: the vLLM TP rank this rank writes, None on a rank that only sends (a training rank outside the
        inference ranks: every figure but `bytes_sent` is 0 there).
    bytes_received: bytes this rank receives from other ranks under the plan.
    bytes_local: bytes it copies from its own Megatron shards.
    bytes_sent: bytes it sends to other ranks.
    bytes_lower_bound: bytes it needs minus bytes of (its holdings intersected with its needs), from the layouts
        alone (`lower_bound_bytes`): no plan for this mapping receives less.
    bytes_plan_remote: bytes it needs minus what this plan copies locally (the plan's own figure; equals
        `bytes_received` for any plan that covers every need once, so it is no check of the plan).
    bytes_naive: bytes a gather-the-full-model-on-every-rank approach would receive (model bytes minus held bytes).
    """

    rank: int
    infer_tp_rank: Optional[int]
    bytes_received: int
    bytes_local: int
    bytes_sent: int
    bytes_lower_bound: int
    bytes_naive: int
    bytes_plan_remote: int = 0


@dataclasses.dataclass(frozen=True)
class PlanTraffic:
    """Bytes on the wire per rank under a plan (local copies are not traffic).

    max_sent / mean_sent: over the training ranks (every rank that may send, senders of 0 bytes included).
    max_received / mean_received: over the inference ranks.
    max_moved: max over all ranks of max(bytes sent, bytes received): with full-duplex links of B bytes/s the
        transfer takes at least max_moved / B seconds.
    """

    max_sent: int
    mean_sent: float
    max_received: int
    mean_received: float
    max_moved: int

    @property
    def sent_imbalance(self) -> float:
        """max_sent / mean_sent (1.0 = every training rank sends the same; 0 senders: 1.0)."""
        return self.max_sent / self.mean_sent if self.mean_sent else 1.0


@dataclasses.dataclass(frozen=True)
class ReshardPlan:
    """A transfer plan over bridge ranks (`planner` module docstring). `infer_rank_of` maps every inference rank to
    its vLLM TP rank; `stats` has one entry per bridge rank, in rank order; `infer` is where the engines are (the
    colocated layout when built from an int rollout tp)."""

    spec: ModelSpec
    train: RoleTopology
    infer_tp: int
    dtype_bytes: int
    infer_rank_of: dict[int, int]  # bridge rank (global rank when colocated in one world) -> inference TP rank
    ops: tuple[TransferOp, ...]
    stats: tuple[RankStats, ...]
    model_bytes: int
    train_layout: TrainLayout = DEFAULT_TRAIN_LAYOUT
    infer_ep: bool = False
    infer: Optional[InferLayout] = None  # None: colocated with `train` (filled in)

    def __post_init__(self) -> None:
        if self.infer is None:
            object.__setattr__(self, "infer", InferLayout.colocated(self.train, self.infer_tp, self.infer_ep))

    @property
    def natural_mapping(self) -> bool:
        return all(self.infer_rank_of[r] == self.infer.tp_rank(r) for r in self.infer.ranks)

    @property
    def colocated(self) -> bool:
        """True when the inference ranks are exactly the training ranks (the hybrid engine)."""
        return self.infer.ranks == self.train.ranks

    @property
    def ranks(self) -> list[int]:
        """Every bridge rank the plan involves (training and inference), ascending."""
        return sorted(set(self.train.ranks) | set(self.infer.ranks))

    def traffic(self) -> PlanTraffic:
        """Max and mean bytes sent over the training ranks, received over the inference ranks."""
        by_rank = {s.rank: s for s in self.stats}
        sent = [by_rank[r].bytes_sent for r in self.train.ranks]
        received = [by_rank[r].bytes_received for r in self.infer.ranks]
        return PlanTraffic(max(sent), sum(sent) / len(sent), max(received), sum(received) / len(received),
                           max(max(s.bytes_sent, s.bytes_received) for s in self.stats))

    def ops_for(self, rank: int) -> list[TransferOp]:
        return [op for op in self.ops if op.src == rank or op.dst == rank]

    def totals(self) -> dict[str, int]:
        return {
            "bytes_received": sum(s.bytes_received for s in self.stats),
            "bytes_local": sum(s.bytes_local for s in self.stats),
            "bytes_lower_bound": sum(s.bytes_lower_bound for s in self.stats),
            "bytes_plan_remote": sum(s.bytes_plan_remote for s in self.stats),
            "bytes_naive": sum(s.bytes_naive for s in self.stats),
        }


def _overlap_bytes(spec: ModelSpec, index: HolderIndex, rank: int, needs: list[Placement], dtype_bytes: int) -> int:
    total = 0
    for n in needs:
        for p in index.held_by(rank, n.piece):
            total += piece_bytes(spec, p.piece.intersect(n.piece), dtype_bytes)
    return total


def choose_mapping(spec: ModelSpec, train: RoleTopology, infer_tp: "int | InferLayout", dtype_bytes: int = 2,
                   _index: Optional[HolderIndex] = None, train_layout: TrainLayout = DEFAULT_TRAIN_LAYOUT,
                   infer_ep: bool = False) -> dict[int, int]:
    """Bridge rank -> inference TP rank maximising local bytes (permutations searched within each replica block
    when infer_tp <= 6, natural order otherwise). Ties keep the natural order (always the case for an inference
    rank that holds nothing). `infer_tp`: the rollout tp (colocated) or an `InferLayout`."""
    infer = infer_layout(train, infer_tp, infer_ep)
    infer_tp, infer_ep = infer.tp, infer.ep
    index = _index or HolderIndex(spec, train, train_layout)
    needs = {j: vllm_needs(spec, infer_tp, j, infer_ep) for j in range(infer_tp)}
    mapping: dict[int, int] = {}
    for block_start in range(infer.rank_offset, infer.rank_offset + infer.world_size, infer_tp):
        ranks = list(range(block_start, block_start + infer_tp))
        local = {(r, j): _overlap_bytes(spec, index, r, needs[j], dtype_bytes) for r in ranks for j in range(infer_tp)}
        natural = tuple(range(infer_tp))
        best, best_score = natural, sum(local[(r, j)] for r, j in zip(ranks, natural))
        if infer_tp <= 6:
            for perm in itertools.permutations(range(infer_tp)):
                score = sum(local[(r, j)] for r, j in zip(ranks, perm))
                if score > best_score:
                    best, best_score = perm, score
        mapping.update(dict(zip(ranks, best)))
    return mapping


def infer_layout(train: RoleTopology, infer: "int | InferLayout", infer_ep: bool = False) -> InferLayout:
    """`infer` as an `InferLayout`: an int is the rollout tp of engines colocated with `train` (the hybrid engine);
    an `InferLayout` carries its own `ep`, so `infer_ep` must then be False or agree with it."""
    if isinstance(infer, InferLayout):
        if infer_ep and not infer.ep:
            raise ValueError(f"infer_ep=True conflicts with {infer} (set InferLayout.ep instead)")
        return infer
    return InferLayout.colocated(train, infer, infer_ep)


def plan_reshard(spec: ModelSpec, train: RoleTopology, infer_tp: "int | InferLayout", dtype_bytes: int = 2,
                 search_mapping: bool = False, _prefer_local: bool = True,
                 train_layout: TrainLayout = DEFAULT_TRAIN_LAYOUT, infer_ep: bool = False,
                 keep_ops: bool = True) -> ReshardPlan:
    """The transfer plan (cached: call freely before every rollout).

    infer_tp: the rollout tp of engines colocated with the training ranks (the hybrid engine: inference ranks =
        training ranks, blocks of infer_tp consecutive ranks), or an `InferLayout` placing the engines anywhere in
        the bridge numbering (a rollout pool after the training ranks: every inference rank receives its whole
        shard from the training ranks, the senders chosen to balance the bytes each training rank sends).

    search_mapping: False (default) = inference TP rank = position in its block of `infer_tp` ranks, what vLLM's
        external launcher realises; True = the permutation keeping the most bytes local (`choose_mapping`).
    _prefer_local: testing knob; False routes every need from another holder where one exists (a deliberately
        worse plan that the independent lower bound must catch).
    train_layout: uneven pipeline split, virtual pipeline chunks and expert TP of the training side
        (`layouts.TrainLayout`); the default is an even split, no VPP, expert TP = tp.
    infer_ep: vLLM expert parallelism on the inference side (`rollout.ep`; `layouts.vllm_needs`).
    keep_ops: False routes every byte as usual but keeps only the per-rank statistics (`ops` is empty): cluster-scale
        simulations, where the ops of every rank (tens of millions for a 256-rank MoE model) would not fit.
    """
    return _plan_cached(repr(spec), spec, train, infer_layout(train, infer_tp, infer_ep), dtype_bytes,
                        search_mapping, _prefer_local, train_layout, keep_ops)


def lower_bound_bytes(spec: ModelSpec, train: RoleTopology, infer_tp: int, infer_rank_of: dict[int, int],
                      dtype_bytes: int = 2, train_layout: TrainLayout = DEFAULT_TRAIN_LAYOUT,
                      infer_ep: bool = False) -> dict[int, int]:
    """{rank: bytes it must receive} for every rank of `infer_rank_of` (bridge rank -> vLLM TP rank): bytes
    inference rank `infer_rank_of[rank]` needs minus the bytes of (the rank's Megatron holdings intersected with
    those needs; none when it is not a training rank). From the layouts alone; no plan involved."""
    out = {}
    needs: dict[int, list[Placement]] = {}
    shapes = cached_hf_shapes(spec)
    for rank in infer_rank_of:
        held: dict[tuple[str, int], list[tuple[int, int]]] = defaultdict(list)
        for p in (megatron_holdings(spec, train, rank, train_layout) if rank in train.ranks else ()):
            held[(p.piece.hf_name, p.piece.dim)].append((p.piece.start, p.piece.stop))
        runs = {key: merge_runs(v) for key, v in held.items()}
        j = infer_rank_of[rank]
        if j not in needs:
            needs[j] = vllm_needs(spec, infer_tp, j, infer_ep)
        total = 0
        for need in needs[j]:
            n = need.piece
            covered = sum(max(0, min(hi, n.stop) - max(lo, n.start)) for lo, hi in runs.get((n.hf_name, n.dim), []))
            elements = n.length - covered
            for d, size in enumerate(shapes[n.hf_name]):
                if d != n.dim:
                    elements *= size
            total += elements * dtype_bytes
        out[rank] = total
    return out


def check_engine_mapping(plan: ReshardPlan, rank: int, engine_tp_rank: int) -> None:
    """Refuse to reshard when the rollout engine on global `rank` is TP rank `engine_tp_rank` but the plan writes
    inference TP rank `plan.infer_rank_of[rank]`'s shards there (the engine would hold another rank's weights)."""
    planned = plan.infer_rank_of.get(rank)
    if planned != engine_tp_rank:
        raise RuntimeError(
            f"reshard plan and rollout engine disagree on rank {rank}: the plan writes inference TP rank {planned}'s "
            f"shards, the vLLM engine there is TP rank {engine_tp_rank}. Build the plan with the engine's mapping "
            f"(plan_reshard(..., search_mapping=False): TP rank = position in each block of {plan.infer_tp} ranks)"
        )


@functools.lru_cache(maxsize=32)
def _plan_cached(_key: str, spec: ModelSpec, train: RoleTopology, infer: InferLayout, dtype_bytes: int,
                 search_mapping: bool, prefer_local: bool, train_layout: TrainLayout = DEFAULT_TRAIN_LAYOUT,
                 keep_ops: bool = True) -> ReshardPlan:
    infer_tp, infer_ep = infer.tp, infer.ep
    index = HolderIndex(spec, train, train_layout)
    if search_mapping:
        mapping = choose_mapping(spec, train, infer, dtype_bytes, index, train_layout)
    else:
        mapping = {r: infer.tp_rank(r) for r in infer.ranks}
    needs = {j: vllm_needs(spec, infer_tp, j, infer_ep) for j in range(infer_tp)}
    model_bytes = _model_bytes(spec, dtype_bytes)

    rate = ByteRate(spec, dtype_bytes)
    sent: dict[int, int] = defaultdict(int)
    ops: list[TransferOp] = []
    stats: list[RankStats] = []
    # across pools (no rank both trains and infers) every needed byte is sent, the senders levelled plan-wide
    pooled = None
    if set(infer.ranks).isdisjoint(train.ranks):
        pooled = route_pool(index.runs, infer.ranks, mapping, needs, rate)
    for dst in infer.ranks:
        received = local = lower = 0
        for k, need in enumerate(needs[mapping[dst]]):
            if pooled is not None:
                runs = pooled[(dst, k)]
                if keep_ops:
                    ops.extend(_ops_from_runs(dst, need, runs))
                routed = [(src, nbytes) for src, _, _, _, nbytes in runs]
            elif keep_ops:
                new_ops = _route(spec, index, dst, need, sent, dtype_bytes, prefer_local, rate)
                ops.extend(new_ops)
                routed = [(op.src, op.nbytes) for op in new_ops]
            else:  # statistics only: the same routing, no TransferOp objects
                routed = [(src, nbytes) for src, _, _, _, nbytes in route_runs(index.runs, dst, need.piece, sent, rate,
                                                                                prefer_local)]
            for src, nbytes in routed:
                if src == dst:
                    local += nbytes
                else:
                    received += nbytes
                    sent[src] += nbytes
            lower += rate(need.piece)
        held = _unique_bytes(spec, index.by_rank.get(dst, []), dtype_bytes)
        stats.append(RankStats(dst, mapping[dst], received, local, 0, 0, model_bytes - held, lower - local))
    bound = lower_bound_bytes(spec, train, infer_tp, mapping, dtype_bytes, train_layout, infer_ep)
    stats = [dataclasses.replace(s, bytes_sent=sent[s.rank], bytes_lower_bound=bound[s.rank]) for s in stats]
    stats += [RankStats(r, None, 0, 0, sent[r], 0, 0, 0) for r in train.ranks if r not in mapping]  # send only
    stats.sort(key=lambda s: s.rank)
    return ReshardPlan(spec, train, infer_tp, dtype_bytes, mapping, tuple(ops), tuple(stats), model_bytes,
                       train_layout, infer_ep, infer)


def _model_bytes(spec: ModelSpec, dtype_bytes: int) -> int:
    total = 0
    for shape in hf_shapes(spec).values():
        n = 1
        for s in shape:
            n *= s
        total += n * dtype_bytes
    return total


def _unique_bytes(spec: ModelSpec, placements: list[Placement], dtype_bytes: int) -> int:
    """Bytes of the union of `placements` (a tied output layer duplicates the embedding)."""
    seen: dict[tuple[str, int], list[tuple[int, int]]] = defaultdict(list)
    for p in placements:
        seen[(p.piece.hf_name, p.piece.dim)].append((p.piece.start, p.piece.stop))
    total = 0
    for (name, dim), runs in seen.items():
        runs.sort()
        cur_lo, cur_hi = runs[0]
        covered = 0
        for lo, hi in runs[1:]:
            if lo > cur_hi:
                covered += cur_hi - cur_lo
                cur_lo, cur_hi = lo, hi
            else:
                cur_hi = max(cur_hi, hi)
        covered += cur_hi - cur_lo
        total += piece_bytes(spec, Piece(name, dim, 0, covered), dtype_bytes)
    return total


def _route(spec: ModelSpec, index: HolderIndex, dst: int, need: Placement, sent: dict[int, int],
           dtype_bytes: int, prefer_local: bool = True, rate: Optional[ByteRate] = None) -> list[TransferOp]:
    """Ops covering `need` for `dst` (`route_runs`), one op per contiguous run from one source.

    `sent` (bytes already assigned to each source) is read for balancing; the caller updates it.
    """
    runs = route_runs(index.runs, dst, need.piece, sent, rate or ByteRate(spec, dtype_bytes), prefer_local)
    return _ops_from_runs(dst, need, runs)


def _ops_from_runs(dst: int, need: Placement, runs) -> list[TransferOp]:
    """Ops writing `need` on `dst` from `runs` ((src, src placement, lo, hi, nbytes), ascending lo), one op per
    contiguous run from one source."""
    piece = need.piece
    ops: list[TransferOp] = []
    for src, src_p, lo, hi, nbytes in runs:
        op = TransferOp(
            src=src, dst=dst, piece=Piece(piece.hf_name, piece.dim, lo, hi),
            src_param=src_p.param, src_offset=src_p.offset + (lo - src_p.piece.start),
            dst_param=need.param, dst_offset=need.offset + (lo - piece.start), nbytes=nbytes,
        )
        if ops and _contiguous(ops[-1], op):  # one op per contiguous run from one source
            prev = ops.pop()
            op = dataclasses.replace(prev, piece=Piece(piece.hf_name, piece.dim, prev.piece.start, hi),
                                     nbytes=prev.nbytes + nbytes)
        ops.append(op)
    return ops


def _contiguous(a: TransferOp, b: TransferOp) -> bool:
    return (
        a.src == b.src and a.src_param == b.src_param and a.dst_param == b.dst_param
        and a.piece.hf_name == b.piece.hf_name and a.piece.stop == b.piece.start
        and a.src_offset + a.piece.length == b.src_offset and a.dst_offset + a.piece.length == b.dst_offset
    )
