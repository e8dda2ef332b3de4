"""Shares by reference (issue 30, item 1): inside a step, each DP share of each batch key is put once and every role
call passes references (`plan_shared_calls`, `resolve_shares`, `cut_ranges`; `megarl.controller.shares` puts with
Ray). Pure: the handles here are row ranges, `get` looks them up. Expected values come from `plan_calls` (the path
that sends copies) and from rows written out by hand."""

import pytest
import torch

from megarl.controller.dispatch import (
    DP_SPLIT,
    DispatchError,
    DispatchSpec,
    ShareRefs,
    cut_ranges,
    dispatched_methods,
    plan_calls,
    plan_shared_calls,
    resolve_shares,
    share_rows,
)
from megarl.data.batch import Batch
from megarl.workers.role_host import RoleHost

SPECS = dispatched_methods(RoleHost)


def _step_batch(n: int = 8, s: int = 3) -> Batch:
    f = torch.rand(n, s, generator=torch.Generator().manual_seed(0))
    return Batch({"input_ids": torch.arange(n * s).reshape(n, s), "attention_mask": torch.ones(n, s, dtype=torch.long),
                  "loss_mask": (torch.arange(n * s).reshape(n, s) % 3 > 0).long(), "rollout_log_probs": f,
                  "scores": torch.rand(n), "old_log_probs": f + 1, "ref_log_probs": f + 2, "advantages": f + 3},
                 {"note": "kept"})


class _Store:
    """Handles = (key, tensor id, lo, hi); one put per distinct handle (what `BatchShares.piece` does with Ray)."""

    def __init__(self) -> None:
        self.values: dict[tuple, torch.Tensor] = {}
        self.puts: list[tuple] = []

    def piece(self, key, tensor, lo, hi):
        handle = (key, id(tensor), lo, hi)
        if handle not in self.values:
            self.values[handle] = tensor[lo:hi].clone()
            self.puts.append(handle)
        return handle

    def get(self, handles):
        return [self.values[h] for h in handles]


def test_cut_ranges_cuts_only_inside():
    assert cut_ranges([(0, 4), (8, 12)], [0, 2, 4, 6, 10, 12, 16]) == [(0, 2), (2, 4), (8, 10), (10, 12)]
    assert cut_ranges([(3, 5)], []) == [(3, 5)]


def test_share_rows_are_the_rows_plan_calls_cuts():
    fwd = share_rows(SPECS["compute_log_probs"], 10, 4, None)
    assert [r for r, _ in fwd] == [[(0, 3)], [(3, 6)], [(6, 8)], [(8, 10)]]  # the first chunks one larger
    upd = share_rows(SPECS["update_actor"], 8, 2, 4)
    assert [r for r, _ in upd] == [[(0, 2), (4, 6)], [(2, 4), (6, 8)]]
    with pytest.raises(DispatchError, match="not a multiple of mini_batch_samples=3"):
        share_rows(SPECS["update_actor"], 8, 2, 3)


@pytest.mark.parametrize("method,mini", [("compute_log_probs", None), ("compute_ref_log_probs", None),
                                         ("score", None), ("update_actor", 4), ("update_actor", None)])
def test_a_share_by_reference_resolves_to_what_plan_calls_sends(method, mini):
    batch, store = _step_batch(), _Store()
    replicas = [0, 0, 1, 1]
    cuts = [0, 2, 4, 6, 8]
    by_value = plan_calls(SPECS[method], (batch, "extra"), {"k": 1}, 4, replicas, method, mini_batch_samples=mini)
    by_ref = plan_shared_calls(SPECS[method], (batch, "extra"), {"k": 1}, 4, replicas, store.piece, cuts, method,
                               mini_batch_samples=mini)
    assert by_ref[0] is by_ref[1] and by_ref[2] is by_ref[3]  # a replica's ranks share one argument set
    for (va, vk), (ra, rk) in zip(by_value, by_ref):
        assert isinstance(ra[0], ShareRefs)
        args, kwargs = resolve_shares(ra, rk, store.get)
        assert args[1:] == va[1:] == ("extra",) and kwargs == vk == {"k": 1}
        got, want = args[0], va[0]
        assert got.meta == want.meta
        assert sorted(got.keys()) == sorted(want.keys())
        for k in want.keys():
            assert torch.equal(got[k], want[k]), k


def test_every_piece_is_put_once_for_all_the_calls_of_a_step():
    """A GRPO step at DP2 with mini-batches of 4 of 8 rows: the forward shares are rows [0, 4) and [4, 8), the
    update's [0, 2) + [4, 6) and [2, 4) + [6, 8); cut at 0 2 4 6 8 every key read is put as 4 pieces, once."""
    batch, store = _step_batch(), _Store()
    replicas, cuts = [0, 1], [0, 2, 4, 6, 8]
    for method, mini in [("compute_log_probs", None), ("compute_ref_log_probs", None), ("update_actor", 4)]:
        plan_shared_calls(SPECS[method], (batch,), {}, 2, replicas, store.piece, cuts, method, mini_batch_samples=mini)
    per_key: dict[str, list] = {}
    for key, _, lo, hi in store.puts:
        per_key.setdefault(key, []).append((lo, hi))
    pieces = [(0, 2), (2, 4), (4, 6), (6, 8)]
    read = ("input_ids", "attention_mask", "loss_mask", "advantages", "old_log_probs", "ref_log_probs",
            "rollout_log_probs")
    assert {k: sorted(v) for k, v in per_key.items()} == {k: pieces for k in read}


def test_a_call_without_declared_reads_or_a_batch_cannot_go_by_reference():
    with pytest.raises(DispatchError, match="declared reads over a Batch"):
        plan_shared_calls(DispatchSpec(DP_SPLIT), (_step_batch(),), {}, 2, [0, 1], _Store().piece)
    with pytest.raises(DispatchError, match="declared reads over a Batch"):
        plan_shared_calls(SPECS["compute_log_probs"], ([1, 2],), {}, 2, [0, 1], _Store().piece)


def test_an_inline_piece_is_used_as_sent_and_fetches_nothing():
    """A share whose small one-dimensional pieces came with the call (`InlinePiece`, `BatchShares.piece`): resolved to
    the same Batch as the by-value path, `get` asked only for the pieces that were put."""
    from megarl.controller.dispatch import InlinePiece

    batch, store = _step_batch(), _Store()
    batch.tensors["advantages"] = torch.linspace(-1, 1, len(batch))  # per sequence, as GRPO's go down
    method = "update_actor"

    def piece(key, tensor, lo, hi):  # [rows] keys inline, the rest put
        return InlinePiece(tensor[lo:hi].clone()) if tensor.dim() == 1 else store.piece(key, tensor, lo, hi)

    by_value = plan_calls(SPECS[method], (batch,), {}, 2, [0, 1], method, mini_batch_samples=4)
    by_ref = plan_shared_calls(SPECS[method], (batch,), {}, 2, [0, 1], piece, [0, 2, 4, 6, 8], method,
                               mini_batch_samples=4)
    asked = []
    for (va, _), (ra, rk) in zip(by_value, by_ref):
        inline = [h for hs in ra[0].pieces.values() for h in hs if isinstance(h, InlinePiece)]
        assert inline  # the update reads a [rows] key (the advantages)
        got = resolve_shares(ra, rk, lambda hs: asked.append(list(hs)) or store.get(hs))[0][0]
        assert all(not isinstance(h, InlinePiece) for hs in asked for h in hs)
        for k in va[0].keys():
            assert torch.equal(got[k], va[0][k]), k
