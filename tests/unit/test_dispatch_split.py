"""DP_SPLIT as the controller's data path: uneven contiguous chunks, every rank of one DP replica (its TP ranks and
pipeline stages) receives the same chunk and only it, last-stage results come back concatenated in the original
order. Expected values are written out by hand."""

import pytest
import torch

from megarl.controller.dispatch import (
    DP_SPLIT,
    DispatchError,
    DispatchSpec,
    chunk_bounds,
    collect,
    plan_calls,
    split_contiguous,
)
from megarl.data.batch import Batch

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
