"""Reshard routing: for each piece an inference rank needs, which training ranks send which rows.

The core the planner (`planner.plan_reshard`) and the cost models beside it (`fanout`, `rank_order`) share. Pure
Python over the layouts (`layouts.megatron_holdings` / `vllm_needs`), no torch.

  HolderIndex   what every training rank holds, by rank and by HF tensor name
  ByteRate      a piece's size in bytes, the shape lookups cached per tensor
  merge_runs    union of half-open [lo, hi) runs
  route_runs    the sources of one needed piece: local first, else the least-loaded holder per elementary run
                (the colocated plan, run by run)
  route_pool    the sources of every need when no inference rank trains (a rollout pool): forced runs first, the
                replicated ones levelled over their holders (`water_level`) so the busiest sender sends the least
                any plan can

A *run* is (src rank, src placement, lo, hi, nbytes): rows [lo, hi) of the needed piece along its dim, sent by `src`
from `placement` (src == dst: copied in place).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

from megarl.checkpoint.name_map import cached_hf_shapes
from megarl.models.spec import ModelSpec
from megarl.parallel.topology import RoleTopology
from megarl.reshard.layouts import DEFAULT_TRAIN_LAYOUT, Piece, Placement, TrainLayout, megatron_holdings

Run = tuple[int, Placement, int, int, int]
"""(src rank, src placement, lo, hi, nbytes)."""
Holdings = dict[str, list[tuple[int, Placement, int, int, int]]]
"""{hf_name: [(rank, placement, dim, start, stop)]}: who holds which rows of each HF tensor."""


class HolderIndex:
    """What every training rank holds (`layouts.megatron_holdings`), indexed by rank and by HF tensor name.

    by_rank: {rank: its placements}. by_name: {hf_name: [(rank, placement)]}. runs: by_name unpacked for the
    router's hot loop, {hf_name: [(rank, placement, dim, start, stop)]} (the `Holdings` `route_runs` and
    `route_pool` read).
    """

    def __init__(self, spec: ModelSpec, train: RoleTopology, layout: TrainLayout = DEFAULT_TRAIN_LAYOUT):
        self.by_rank: dict[int, list[Placement]] = {r: megatron_holdings(spec, train, r, layout) for r in train.ranks}
        self.by_name: dict[str, list[tuple[int, Placement]]] = defaultdict(list)
        self.runs: Holdings = defaultdict(list)
        for r, placements in self.by_rank.items():
            for p in placements:
                self.by_name[p.piece.hf_name].append((r, p))
                self.runs[p.piece.hf_name].append((r, p, p.piece.dim, p.piece.start, p.piece.stop))

    def held_by(self, rank: int, need: Piece) -> list[Placement]:
        """`rank`'s placements that overlap `need`."""
        return [p for r, p in self.by_name[need.hf_name] if r == rank and p.piece.intersect(need)]


class ByteRate:
    """`rate(piece)`: the piece's size in bytes (`layouts.piece_bytes`), from the bytes per index along its dim,
    kept per HF tensor (one shape lookup per tensor: `piece_bytes` on a hot path would re-key the shape cache by the
    spec's repr every call)."""

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


def route_runs(holdings: Holdings, dst: int, piece: Piece, load: dict[int, int], rate: ByteRate,
               prefer_local: bool = True) -> list[Run]:
    """(src, src placement, lo, hi, nbytes) runs covering `piece` for `dst`, ascending lo: its own holdings first,
    then the least-loaded holder (`load`: bytes already assigned to each source, read only) per elementary run.
    `holdings`: `HolderIndex.runs`, or a part of it (one pipeline stage's). `prefer_local=False` is a testing knob
    (a deliberately worse plan: a run held locally is still taken from another holder)."""
    lo_, hi_, dim = piece.start, piece.stop, piece.dim
    holders = [(r, p) for r, p, d, s, e in holdings[piece.hf_name] if d == dim and s < hi_ and lo_ < e]
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


def route_pool(holdings: Holdings, infer_ranks: Iterable[int], mapping: dict[int, int],
               needs: dict[int, list[Placement]], rate: ByteRate) -> dict[tuple[int, int], list[Run]]:
    """Sources of every need of every inference rank when no inference rank trains (a rollout pool): {(dst, index of
    the need in `needs[mapping[dst]]`): runs (src, src placement, lo, hi, nbytes), ascending lo}.

    Each needed run is cut at every holder boundary. A run with one holder is that holder's to send (forced). The
    others are then levelled over their holders, group by group (a group = the runs with the same set of holders,
    fewest holders first): the group's water level T is the load every holder would reach if the group's bytes
    filled the holders up to one level (`water_level`, holders already above it get nothing); each run, coarsest
    rows first (largest first among equals), goes whole to the holder with the most room under T, or, where it
    fits whole nowhere, is cut into the holders' room (whole rows), what is left to the least-loaded holder. The
    finest runs (1-D norms) come last and fill the gaps the cuts left, so a holder ends within about one row of the
    finest run of T. On every layout of tests/unit/test_reshard_disaggregated.py the busiest sender then sends
    exactly the least any plan can (max over sets S of training ranks of the bytes only S holds, / |S|)."""
    load: dict[int, int] = defaultdict(int)
    out: dict[tuple[int, int], list[Run]] = defaultdict(list)
    groups: dict[tuple[int, ...], list[tuple]] = defaultdict(list)
    order = 0
    for dst in infer_ranks:
        for k, need in enumerate(needs[mapping[dst]]):
            piece = need.piece
            holders = [(r, p) for r, p, d, s, e in holdings[piece.hf_name]
                       if d == piece.dim and s < piece.stop and piece.start < e]
            cuts = {piece.start, piece.stop}
            for _, p in holders:
                cuts.update(c for c in (p.piece.start, p.piece.stop) if piece.start < c < piece.stop)
            bounds = sorted(cuts)
            for lo, hi in zip(bounds, bounds[1:]):
                candidates = {}
                for r, p in holders:  # one placement per rank (the first, as `route_runs` would take it)
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
        level = water_level([load[r] for r in holders], -sum(run[1] for run in runs))
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


def water_level(loads: list[int], extra: int) -> float:
    """The level T with sum(max(0, T - load)) == extra: where `extra` bytes poured over senders already holding
    `loads` bring the lowest of them (each sender above T keeps its load)."""
    ordered = sorted(loads)
    for k in range(1, len(ordered) + 1):
        level = (sum(ordered[:k]) + extra) / k
        if k == len(ordered) or level <= ordered[k]:
            return level
    raise AssertionError("unreachable")


def merge_runs(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Union of half-open runs, as disjoint sorted runs."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(runs):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out
