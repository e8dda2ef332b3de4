"""Kept forward results reaching an update cut differently over the same DP ranks (`exchange_plan`,
`shares_exchange`): carrying out the plan's segments gives every rank exactly its update share's rows of the whole
result, each received once; the expected rows come from `share_layout` (the update's cut) applied to the whole
tensor, independent of the plan."""

import pytest
import torch

from megarl.controller.dispatch import chunk_bounds, shares_cover, shares_exchange
from megarl.data.mini_batches import share_layout
from megarl.workers.kept_rows import exchange_plan

STRADDLING = ([(0, 5), (5, 12)], [[(0, 3), (8, 12)], [(3, 8)]])  # rank 1's range spans both ranks' kept rows


@pytest.mark.parametrize("rows,mini,dp", [(32, 16, 2), (32, 8, 4), (2048, 512, 4), (24, 24, 3), (30, 10, 2),
                                          (12, None, 2)])
def test_carrying_out_the_plan_gives_each_rank_its_update_rows(rows, mini, dp):
    whole = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3)
    if mini is None:
        kept, needed = STRADDLING
    else:
        kept = [chunk_bounds(rows, dp, k) for k in range(dp)]  # the forward's DP_SPLIT shares
        needed = [share_layout(rows, mini, dp, k).rows for k in range(dp)]
    plan = exchange_plan(kept, needed)
    received = {k: torch.full((sum(b - a for a, b in needed[k]), 3), float("nan")) for k in range(dp)}
    sent_rows = [0] * dp
    for seg in plan:  # what the ranks do: the source cuts the rows from its own kept tensor only
        lo, hi = kept[seg.src]
        part = whole[lo:hi][seg.lo - lo:seg.hi - lo]
        target = received[seg.dst][seg.offset:seg.offset + seg.hi - seg.lo]
        assert torch.isnan(target).all(), "a row received twice"
        target.copy_(part)
        if seg.src != seg.dst:
            sent_rows[seg.src] += seg.hi - seg.lo
    for k in range(dp):
        want = torch.cat([whole[a:b] for a, b in needed[k]])
        assert torch.equal(received[k], want), k
    # only rows a rank does not hold travel
    moved = sum(sent_rows)
    local = sum(max(0, min(b, kept[k][1]) - max(a, kept[k][0])) for k in range(dp) for a, b in needed[k])
    assert moved + local == rows


def test_a_row_nobody_kept_is_named():
    with pytest.raises(ValueError, match=r"rows \[4, 8\) of DP rank 1"):
        exchange_plan([(0, 4), (8, 12)], [[(0, 4)], [(4, 8)]])
    with pytest.raises(ValueError, match="exactly once"):  # overlapping kept ranges
        exchange_plan([(0, 6), (4, 8)], [[(0, 4)], [(4, 8)]])


def test_exchange_where_cover_is_false_with_the_same_replicas():
    replicas = [0, 0, 1, 1, 2, 2, 3, 3]  # TP2 DP4
    assert not shares_cover(replicas, replicas, 2048, 512)  # 4 mini-batches over DP4: rows elsewhere
    assert shares_exchange(replicas, replicas, 2048, 512)
    assert shares_cover(replicas, replicas, 2048, None)  # one mini-batch: no exchange needed
    assert not shares_exchange(replicas, [0, 1, 2, 3, 0, 1, 2, 3], 2048, 512)  # other DP groups
    assert not shares_exchange(replicas, replicas, 2048, 500)  # the update cannot be cut so
