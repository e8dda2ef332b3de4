"""DP_SPLIT as the controller's data path: uneven contiguous chunks, every rank of one DP replica (its TP ranks and
pipeline stages) receives the same chunk and only it, last-stage results come back concatenated in the original
order. DP_SPLIT_MINI_BATCHES (updates): a replica receives its part of every mini-batch, in mini-batch order.
Expected values are written out by hand."""

import pytest
import torch

from megarl.controller.dispatch import (
    DP_SPLIT,
    DP_SPLIT_MINI_BATCHES,
    DispatchError,
    DispatchSpec,
    chunk_bounds,
    collect,
    dispatch,
    plan_calls,
    split_contiguous,
)
from megarl.data.batch import Batch
from megarl.data.mini_batches import SHARE_META, ShareLayout, plan_mini_batches, share_layout

SPEC = DispatchSpec(DP_SPLIT)


def test_uneven_chunks_are_contiguous_and_the_first_ones_larger():
    assert split_contiguous(list(range(10)), 4) == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert [chunk_bounds(10, 4, k) for k in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    t = split_contiguous(torch.arange(5), 2)
    assert [c.tolist() for c in t] == [[0, 1, 2], [3, 4]]


def test_tp_and_pp_ranks_of_one_dp_rank_receive_the_same_chunk_only():
    # 8 ranks, TP2 PP2 DP2 in megatron order (tp fastest, then dp, then pp): rank = tp + 2 * (dp + 2 * pp).
    replica_of = [0, 0, 1, 1, 0, 0, 1, 1]
    calls = plan_calls(SPEC, (list(range(5)), "sampling"), {"k": 1}, 8, replica_of)
    got = [c[0][0] for c in calls]
    assert got == [[0, 1, 2], [0, 1, 2], [3, 4], [3, 4], [0, 1, 2], [0, 1, 2], [3, 4], [3, 4]]
    assert all(c[0][1] == "sampling" and c[1] == {"k": 1} for c in calls)


def test_last_stage_results_come_back_in_the_original_order():
    replica_of = [0, 0, 1, 1, 0, 0, 1, 1]
    b = Batch({"input_ids": torch.arange(14).view(7, 2), "attention_mask": torch.ones(7, 2, dtype=torch.long)})
    calls = plan_calls(SPEC, (b,), {}, 8, replica_of)
    assert [len(c[0][0]) for c in calls] == [4, 4, 3, 3, 4, 4, 3, 3]
    # the first pipeline stage returns None; the last stage's TP ranks return their (identical) share's result
    results = [None] * 4 + [Batch({"x": c[0][0]["input_ids"] * 10}) for c in calls[4:]]
    back = collect(SPEC, results, replica_of)
    assert back["x"].tolist() == [[0, 10], [20, 30], [40, 50], [60, 70], [80, 90], [100, 110], [120, 130]]


def test_uneven_split_roundtrip_keeps_order_for_lists_and_tensors():
    replica_of = [0, 1, 2]
    calls = plan_calls(SPEC, (list("abcdefgh"),), {}, 3, replica_of)
    assert [c[0][0] for c in calls] == [list("abc"), list("def"), list("gh")]
    assert collect(SPEC, [c[0][0] for c in calls], replica_of) == list("abcdefgh")


def test_fewer_items_than_replicas_is_refused_with_the_numbers():
    with pytest.raises(DispatchError, match="each of 4 replicas at least one of 3 items"):
        plan_calls(SPEC, ([1, 2, 3],), {}, 4, [0, 1, 2, 3])


def test_a_rank_receives_only_its_share_on_the_wire():
    # pickling a tensor view ships its whole storage: the chunks must be compact copies, 1/4 of the bytes here
    import pickle

    ids = torch.zeros(64, 256, dtype=torch.long)
    b = Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    full = len(pickle.dumps(b))
    chunks = split_contiguous(b, 4)
    assert all(len(pickle.dumps(c)) < full / 4 + 4096 for c in chunks), (full, [len(pickle.dumps(c)) for c in chunks])
    t = split_contiguous(torch.zeros(1000), 4)
    assert all(len(pickle.dumps(c)) < len(pickle.dumps(torch.zeros(1000))) / 4 + 1024 for c in t)


# -- DP_SPLIT_MINI_BATCHES: an update's batch, cut as the role trains on it ------------------------------------------

def _rows_batch(n: int) -> Batch:
    return Batch({"input_ids": torch.arange(n).unsqueeze(1).repeat(1, 3), "attention_mask": torch.ones(n, 3)},
                 {"step": 7})


def test_update_cut_gives_each_replica_its_part_of_every_mini_batch_in_order():
    # 8 rows, mini-batches of 4 -> {0 1 2 3}, {4 5 6 7}; each over 2 DP ranks: rank 0 takes 0 1 then 4 5, rank 1
    # takes 2 3 then 6 7. Ranks in megatron order TP2 DP2: the TP ranks of one replica get the same piece.
    spec = DispatchSpec(DP_SPLIT_MINI_BATCHES, mini_batch_attr="m")
    calls = plan_calls(spec, (_rows_batch(8), 0.5), {"k": 1}, 4, [0, 0, 1, 1], mini_batch_samples=4)
    rows = [c[0][0]["input_ids"][:, 0].tolist() for c in calls]
    assert rows == [[0, 1, 4, 5], [0, 1, 4, 5], [2, 3, 6, 7], [2, 3, 6, 7]]
    assert calls[0] is calls[1] and calls[2] is calls[3]  # one piece per replica: serialised once
    assert all(c[0][1] == 0.5 and c[1] == {"k": 1} for c in calls)
    share = calls[2][0][0]
    assert share.meta["step"] == 7
    layout = ShareLayout.from_meta(share.meta[SHARE_META])
    assert layout == ShareLayout(samples=8, mini_batch_samples=4, dp=2, dp_rank=1)
    assert layout.rows == [(2, 4), (6, 8)] and layout.local_bounds == [(0, 2), (2, 4)]
    # the update's metrics are the same on every rank: rank 0's come back
    assert collect(spec, [{"loss": 1.0}, None, None, None], [0, 0, 1, 1]) == {"loss": 1.0}


def test_update_cut_with_one_mini_batch_is_the_contiguous_dp_split_and_ships_only_the_share():
    import pickle

    spec = DispatchSpec(DP_SPLIT_MINI_BATCHES, mini_batch_attr="m")
    calls = plan_calls(spec, (_rows_batch(6),), {}, 3, [0, 1, 2], mini_batch_samples=None)
    assert [c[0][0]["input_ids"][:, 0].tolist() for c in calls] == [[0, 1], [2, 3], [4, 5]]
    assert [ShareLayout.from_meta(c[0][0].meta[SHARE_META]).mini_batch_samples for c in calls] == [6, 6, 6]
    ids = torch.zeros(64, 256, dtype=torch.long)
    big = Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    pieces = plan_calls(spec, (big,), {}, 4, [0, 1, 2, 3], mini_batch_samples=16)
    assert all(len(pickle.dumps(p[0][0])) < len(pickle.dumps(big)) / 4 + 4096 for p in pieces)


def test_update_cut_refuses_sizes_the_role_would_refuse():
    spec = DispatchSpec(DP_SPLIT_MINI_BATCHES, mini_batch_attr="m")
    with pytest.raises(DispatchError, match="batch of 6 samples is not a multiple of mini_batch_samples=4"):
        plan_calls(spec, (_rows_batch(6),), {}, 2, [0, 1], mini_batch_samples=4)
    with pytest.raises(DispatchError, match="mini-batch of 3 samples does not split over dp=2"):
        plan_calls(spec, (_rows_batch(6),), {}, 2, [0, 1], mini_batch_samples=3)
    with pytest.raises(DispatchError, match="cuts a Batch"):
        plan_calls(spec, ([1, 2],), {}, 2, [0, 1], mini_batch_samples=None)
    with pytest.raises(TypeError, match="mini_batch_attr is required"):
        dispatch(DP_SPLIT_MINI_BATCHES)


def test_the_rule_matches_the_pre_split_loop():
    # what Role._train did before the controller cut updates: batch.split(mini) then mini.chunk_by_dp(rank, dp)
    b = _rows_batch(12)
    for mini, dp in [(None, 1), (None, 2), (6, 3), (4, 2), (12, 4), (2, 2)]:
        old = [[m.chunk_by_dp(k, dp)["input_ids"][:, 0].tolist() for m in b.split(mini or len(b))] for k in range(dp)]
        new = [[list(range(lo, hi)) for lo, hi in share_layout(12, mini, dp, k).rows] for k in range(dp)]
        assert new == old, (mini, dp)
    assert plan_mini_batches(8, 4, 2) == [[(0, 2), (2, 4)], [(4, 6), (6, 8)]]
