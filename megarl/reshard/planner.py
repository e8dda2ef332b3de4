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

Across pools (no rank both trains and infers) the choice among holders is the whole routing (`_route_pool`): a run
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


class _Index:
    """Holdings of every training rank, indexed by HF tensor name."""

    def __init__(self, spec: ModelSpec, train: RoleTopology, layout: TrainLayout = DEFAULT_TRAIN_LAYOUT):
        self.by_rank: dict[int, list[Placement]] = {r: megatron_holdings(spec, train, r, layout) for r in train.ranks}
        self.by_name: dict[str, list[tuple[int, Placement]]] = defaultdict(list)
        # by_name with the run unpacked: (rank, placement, dim, start, stop), for the router's hot loop
        self.runs: dict[str, list[tuple[int, Placement, int, int, int]]] = defaultdict(list)
        for r, placements in self.by_rank.items():
            for p in placements:
                self.by_name[p.piece.hf_name].append((r, p))
                self.runs[p.piece.hf_name].append((r, p, p.piece.dim, p.piece.start, p.piece.stop))

    def held_by(self, rank: int, need: Piece) -> list[Placement]:
        return [p for r, p in self.by_name[need.hf_name] if r == rank and p.piece.intersect(need)]


def _overlap_bytes(spec: ModelSpec, index: _Index, rank: int, needs: list[Placement], dtype_bytes: int) -> int:
    total = 0
    for n in needs:
        for p in index.held_by(rank, n.piece):
            total += piece_bytes(spec, p.piece.intersect(n.piece), dtype_bytes)
    return total


def choose_mapping(spec: ModelSpec, train: RoleTopology, infer_tp: "int | InferLayout", dtype_bytes: int = 2,
                   _index: Optional[_Index] = None, train_layout: TrainLayout = DEFAULT_TRAIN_LAYOUT,
                   infer_ep: bool = False) -> dict[int, int]:
    """Bridge rank -> inference TP rank maximising local bytes (permutations searched within each replica block
    when infer_tp <= 6, natural order otherwise). Ties keep the natural order (always the case for an inference
    rank that holds nothing). `infer_tp`: the rollout tp (colocated) or an `InferLayout`."""
    infer = infer_layout(train, infer_tp, infer_ep)
    infer_tp, infer_ep = infer.tp, infer.ep
    index = _index or _Index(spec, train, train_layout)
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
        runs = {key: _merge(v) for key, v in held.items()}
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


def _merge(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Union of half-open runs, as disjoint sorted runs."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(runs):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
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
    index = _Index(spec, train, train_layout)
    if search_mapping:
        mapping = choose_mapping(spec, train, infer, dtype_bytes, index, train_layout)
    else:
        mapping = {r: infer.tp_rank(r) for r in infer.ranks}
    needs = {j: vllm_needs(spec, infer_tp, j, infer_ep) for j in range(infer_tp)}
    model_bytes = _model_bytes(spec, dtype_bytes)

    rate = _ByteRate(spec, dtype_bytes)
    sent: dict[int, int] = defaultdict(int)
    ops: list[TransferOp] = []
    stats: list[RankStats] = []
    # across pools (no rank both trains and infers) every needed byte is sent, the senders levelled plan-wide
    pooled = _route_pool(index, infer.ranks, mapping, needs, rate) if set(infer.ranks).isdisjoint(train.ranks) else None
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
                routed = [(src, nbytes) for src, _, _, _, nbytes in _route_runs(index, dst, need.piece, sent, rate,
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


class _ByteRate:
    """Bytes per index along a piece's dim, per HF tensor (one shape lookup per tensor: `piece_bytes` on a hot path
    would re-key the shape cache by the spec's repr every call)."""

    def __init__(self, spec: ModelSpec, dtype_bytes: int) -> None:
        self.shapes = cached_hf_shapes(spec)
        self.dtype_bytes = dtype_bytes
        self._rate: dict[tuple[str, int], int] = {}

    def __call__(self, piece: Piece) -> int:
        key = (piece.hf_name, piece.dim)
        rate = self._rate.get(key)
        if rate is None:
            rate = self.dtype_bytes
            for d, n in enumerate(self.shapes[piece.hf_name]):
                if d != piece.dim:
                    rate *= n
            self._rate[key] = rate
        return rate * (piece.stop - piece.start)


def _route_runs(index: _Index, dst: int, piece: Piece, load: dict[int, int], rate: "_ByteRate",
                prefer_local: bool = True) -> list[tuple[int, Placement, int, int, int]]:
    """(src, src placement, lo, hi, nbytes) runs covering `piece` for `dst`: its own holdings first, then the
    least-loaded holder (`load`: bytes already assigned to each source) per elementary run."""
    lo_, hi_, dim = piece.start, piece.stop, piece.dim
    holders = [(r, p) for r, p, d, s, e in index.runs[piece.hf_name] if d == dim and s < hi_ and lo_ < e]
    if prefer_local:
        # fast path (most pieces): some holder has all of it, and dst holds all of it or none of it
        whole = [(r, p) for r, p in holders if p.piece.start <= lo_ and hi_ <= p.piece.stop]
        mine = [(r, p) for r, p in whole if r == dst]
        if mine or (whole and not any(r == dst for r, _ in holders)):
            src, src_p = mine[0] if mine else min(whole, key=lambda rp: (load[rp[0]], rp[0]))
            return [(src, src_p, lo_, hi_, rate(piece))]
    # Cut the needed run at every holder boundary: each elementary run then has a set of candidate holders.
    cuts = {piece.start, piece.stop}
    for _, p in holders:
        cuts.update(c for c in (p.piece.start, p.piece.stop) if piece.start < c < piece.stop)
    bounds = sorted(cuts)
    pending: dict[int, int] = defaultdict(int)
    out = []
    for lo, hi in zip(bounds, bounds[1:]):
        run = Piece(piece.hf_name, piece.dim, lo, hi)
        candidates = [(r, p) for r, p in holders if p.piece.start <= lo and hi <= p.piece.stop]
        if not candidates:
            raise ValueError(f"no training rank holds {run} (needed by rank {dst})")
        mine = [(r, p) for r, p in candidates if r == dst]
        if not prefer_local and len(mine) < len(candidates):  # testing knob: a deliberately worse plan
            candidates, mine = [(r, p) for r, p in candidates if r != dst], []
        src, src_p = mine[0] if mine else min(candidates, key=lambda rp: (load[rp[0]] + pending[rp[0]], rp[0]))
        nbytes = rate(run)
        if src != dst:
            pending[src] += nbytes
        out.append((src, src_p, lo, hi, nbytes))
    return out


def _route(spec: ModelSpec, index: _Index, dst: int, need: Placement, sent: dict[int, int],
           dtype_bytes: int, prefer_local: bool = True, rate: Optional["_ByteRate"] = None) -> list[TransferOp]:
    """Ops covering `need` for `dst` (`_route_runs`), one op per contiguous run from one source.

    `sent` (bytes already assigned to each source) is read for balancing; the caller updates it.
    """
    return _ops_from_runs(dst, need, _route_runs(index, dst, need.piece, sent, rate or _ByteRate(spec, dtype_bytes),
                                                 prefer_local))


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


def _route_pool(index: _Index, infer_ranks, mapping: dict[int, int], needs: dict[int, list[Placement]],
                rate: "_ByteRate") -> dict[tuple[int, int], list[tuple[int, Placement, int, int, int]]]:
    """Sources of every need of every inference rank when no inference rank trains (a rollout pool): {(dst, index of
    the need in `needs[mapping[dst]]`): runs (src, src placement, lo, hi, nbytes), ascending lo}.

    Each needed run is cut at every holder boundary. A run with one holder is that holder's to send (forced). The
    others are then levelled over their holders, group by group (a group = the runs with the same set of holders,
    fewest holders first): the group's water level T is the load every holder would reach if the group's bytes
    filled the holders up to one level (`_water_level`, holders already above it get nothing); each run, coarsest
    rows first (largest first among equals), goes whole to the holder with the most room under T, or, where it
    fits whole nowhere, is cut into the holders' room (whole rows), what is left to the least-loaded holder. The
    finest runs (1-D norms) come last and fill the gaps the cuts left, so a holder ends within about one row of the
    finest run of T. On every layout of tests/unit/test_reshard_disaggregated.py the busiest sender then sends
    exactly the least any plan can (max over sets S of training ranks of the bytes only S holds, / |S|)."""
    load: dict[int, int] = defaultdict(int)
    out: dict[tuple[int, int], list[tuple[int, Placement, int, int, int]]] = defaultdict(list)
    groups: dict[tuple[int, ...], list[tuple]] = defaultdict(list)
    order = 0
    for dst in infer_ranks:
        for k, need in enumerate(needs[mapping[dst]]):
            piece = need.piece
            holders = [(r, p) for r, p, d, s, e in index.runs[piece.hf_name]
                       if d == piece.dim and s < piece.stop and piece.start < e]
            cuts = {piece.start, piece.stop}
            for _, p in holders:
                cuts.update(c for c in (p.piece.start, p.piece.stop) if piece.start < c < piece.stop)
            bounds = sorted(cuts)
            for lo, hi in zip(bounds, bounds[1:]):
                candidates = {}
                for r, p in holders:  # one placement per rank (the first, as `_route_runs` would take it)
                    if p.piece.start <= lo and hi <= p.piece.stop and r not in candidates:
                        candidates[r] = p
                if not candidates:
                    raise ValueError(f"no training rank holds {Piece(piece.hf_name, piece.dim, lo, hi)} (needed by "
                                     f"rank {dst})")
                per_index = rate(Piece(piece.hf_name, piece.dim, 0, 1))
                if len(candidates) == 1:
                    (src, src_p), = candidates.items()
                    out[(dst, k)].append((src, src_p, lo, hi, per_index * (hi - lo)))
                    load[src] += per_index * (hi - lo)
                else:
                    groups[tuple(sorted(candidates))].append((-per_index, -per_index * (hi - lo), order, dst, k, lo,
                                                              hi, candidates))
                    order += 1
    for holders in sorted(groups, key=lambda h: (len(h), h)):
        runs = sorted(groups[holders], key=lambda run: run[:3])
        level = _water_level([load[r] for r in holders], -sum(run[1] for run in runs))
        for neg_rate, _, _, dst, k, lo, hi, candidates in runs:
            per_index, nbytes = -neg_rate, -neg_rate * (hi - lo)
            room = sorted(holders, key=lambda r: (-(level - load[r]), r))
            if nbytes <= level - load[room[0]]:
                parts = [(room[0], lo, hi)]
            else:  # fits whole nowhere: whole rows into each holder's room, the rest to the least-loaded
                parts, at = [], lo
                for r in room:
                    n = min(hi - at, max(0, int((level - load[r]) // per_index)))
                    if n:
                        parts.append((r, at, at + n))
                        at += n
                if at < hi:
                    parts.append((min(holders, key=lambda r: (load[r] + sum(
                        (b - a) * per_index for q, a, b in parts if q == r), r)), at, hi))
            for src, a, b in parts:
                out[(dst, k)].append((src, candidates[src], a, b, per_index * (b - a)))
                load[src] += per_index * (b - a)
    for runs in out.values():
        runs.sort(key=lambda run: run[2])
    return out


def _water_level(loads: list[int], extra: int) -> float:
    """The level T with sum(max(0, T - load)) == extra: where `extra` bytes poured over senders already holding
    `loads` bring the lowest of them (each sender above T keeps its load)."""
    ordered = sorted(loads)
    for k in range(1, len(ordered) + 1):
        level = (sum(ordered[:k]) + extra) / k
        if k == len(ordered) or level <= ordered[k]:
            return level
    raise AssertionError("unreachable")


def _contiguous(a: TransferOp, b: TransferOp) -> bool:
    return (
        a.src == b.src and a.src_param == b.src_param and a.dst_param == b.dst_param
        and a.piece.hf_name == b.piece.hf_name and a.piece.stop == b.piece.start
        and a.src_offset + a.piece.length == b.src_offset and a.dst_offset + a.piece.length == b.dst_offset
    )
