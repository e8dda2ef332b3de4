"""Results kept on the ranks that made them, moved between data-parallel peers when a rank's update share needs rows
another peer's forward share computed (issue 30, item 1: the update's rows never go through the controller).

A forward call (DP_SPLIT) leaves rank k of a DP group with rows [lo_k, hi_k) of the batch; the update
(DP_SPLIT_MINI_BATCHES, `megarl.data.mini_batches`) gives rank k its part of every mini-batch -- with several
mini-batches over several DP ranks, rows mostly held by the other peers. `exchange_plan` says, from every peer's kept
range and needed rows (all-gathered: a few integers each), which rows each rank copies from its own store, which it
sends to which peer and which it receives from which peer; `RoleHost._with_kept` carries it out with point-to-point
sends over the role's DP group (worker to worker, `exchange_rows`), so each rank receives exactly the rows of its
share it does not hold, once.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class RowsMove:
    """Rows [lo, hi) of the batch, moved between `src` and `dst` (DP group ranks; equal for a local copy), landing at
    row `offset` of the receiving rank's share."""

    src: int
    dst: int
    lo: int
    hi: int
    offset: int


def exchange_plan(kept: Sequence[tuple[int, int]], needed: Sequence[Sequence[tuple[int, int]]]) -> list[RowsMove]:
    """Every segment of the exchange, in the one order every rank derives the same way (by receiving rank, then its
    needed ranges in order, then holders by kept row): `kept[k]` the rows [lo, hi) rank k kept, `needed[k]` the
    [lo, hi) ranges of rank k's update share in share order. A rank sends the segments with `src` == itself and
    receives those with `dst` == itself, in this order (so the pairs of sends and receives match). Raises ValueError
    naming the rows when a needed row is kept by no rank."""
    order = sorted(range(len(kept)), key=lambda k: kept[k][0])
    out = []
    for dst, ranges in enumerate(needed):
        offset = 0
        for lo, hi in ranges:
            covered = 0
            for src in order:
                a, b = max(lo, kept[src][0]), min(hi, kept[src][1])
                if a < b:
                    out.append(RowsMove(src, dst, a, b, offset + a - lo))
                    covered += b - a
            if covered != hi - lo:
                raise ValueError(f"rows [{lo}, {hi}) of DP rank {dst}'s update share are kept by no rank exactly once "
                                 f"(kept: {list(kept)}): send the key from the controller")
            offset += hi - lo
    return out


def all_gather_objects(mine: Any, group: Any) -> list:
    """Every rank of `group`'s `mine`, in group rank order (`torch.distributed.all_gather_object`)."""
    got = [None] * dist.get_world_size(group)
    dist.all_gather_object(got, mine, group=group)
    return got


def exchange_rows(mine: torch.Tensor, kept: tuple[int, int], rows: Sequence[tuple[int, int]],
                  group: Any) -> torch.Tensor:
    """This rank's update share [sum of `rows`' lengths, ...] of a kept result, from its own kept rows `kept` ([lo, hi)
    of the batch: `mine`) and its DP peers' (`group`: every rank of it calls this for the same key, a collective): the
    peers' kept ranges and needed rows are all-gathered (integers), then each move of `exchange_plan` is a local copy
    or a point-to-point send / receive."""
    me = dist.get_rank(group)
    layouts = all_gather_objects((tuple(kept), [tuple(r) for r in rows]), group)
    plan = exchange_plan([k for k, _ in layouts], [r for _, r in layouts])
    out = torch.empty((sum(b - a for a, b in rows), *mine.shape[1:]), dtype=mine.dtype, device=mine.device)
    lo = kept[0]
    pending = []
    for move in plan:
        n = move.hi - move.lo
        if move.src == me and move.dst == me:
            out[move.offset:move.offset + n] = mine[move.lo - lo:move.hi - lo]
        elif move.src == me:
            pending.append(dist.isend(mine[move.lo - lo:move.hi - lo].contiguous(),
                                      dist.get_global_rank(group, move.dst), group=group))
        elif move.dst == me:
            pending.append(dist.irecv(out[move.offset:move.offset + n], dist.get_global_rank(group, move.src),
                                      group=group))
    for work in pending:  # bounded by the process group's timeout (`init_distributed(timeout_s=)`)
        try:
            work.wait()
        except RuntimeError as e:
            raise RuntimeError(f"exchange_rows: rank {me} of its DP group waited for its peers' kept rows "
                               f"(rows {list(rows)}, kept {tuple(kept)}) past the process group's timeout: a peer "
                               f"did not take part in this exchange ({e})") from e
    return out
