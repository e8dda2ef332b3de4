"""Declared reads (issue 30, item 1): a role method's `@dispatch(reads=..., optional_reads=...)` makes the controller
send each rank only those keys of its DP share; a method reading a key it did not declare fails with a KeyError
naming the method and the key. Expected key sets are written out by hand from the roles' documented inputs."""

import pickle

import pytest
import torch

from megarl.controller.dispatch import (
    DP_SPLIT,
    DP_SPLIT_MINI_BATCHES,
    DispatchError,
    dispatch,
    dispatched_methods,
    plan_calls,
)
from megarl.data.batch import Batch
from megarl.data.mini_batches import SHARE_META
from megarl.workers.role_host import RoleHost


def _step_batch(n: int = 8, s: int = 5) -> Batch:
    """A GRPO step's batch as the controller holds it before the update (every key the trainer puts in)."""
    ids = torch.arange(n * s).reshape(n, s)
    f = torch.rand(n, s)
    return Batch({"input_ids": ids, "attention_mask": torch.ones(n, s, dtype=torch.long),
                  "loss_mask": torch.ones(n, s, dtype=torch.long), "rollout_log_probs": f,
                  "policy_version": torch.zeros(n, s, dtype=torch.long), "group_ids": torch.arange(n) // 4,
                  "scores": torch.rand(n), "old_log_probs": f + 1, "ref_log_probs": f + 2, "advantages": f + 3,
                  "returns": f + 4}, {"note": "kept"})


def _plan(method: str, batch: Batch, world: int = 4, replicas=(0, 0, 1, 1), mini=None):
    spec = dispatched_methods(RoleHost)[method]
    return plan_calls(spec, (batch,), {}, world, list(replicas), f"RoleHost.{method}", mini_batch_samples=mini)


@pytest.mark.parametrize("method,keys", [
    # the old-log-prob forward computes the mismatch rows: vLLM's log-probs, and the versions (RLLoop leaves them out
    # of the batch unless it mixes weights versions)
    ("compute_log_probs", {"input_ids", "attention_mask", "loss_mask", "rollout_log_probs", "policy_version"}),
    ("compute_ref_log_probs", {"input_ids", "attention_mask", "loss_mask"}),
    # the critic's forward reads the scores for GAE on its ranks (`compute_values(gae=)`; RLLoop leaves them out
    # of the batch otherwise)
    ("compute_values", {"input_ids", "attention_mask", "loss_mask", "scores"}),
    ("score", {"input_ids", "attention_mask"}),
    # the update reads the policy keys; never scores, group ids, returns or versions
    ("update_actor", {"input_ids", "attention_mask", "loss_mask", "advantages", "old_log_probs", "ref_log_probs",
                      "rollout_log_probs"}),
])
def test_each_rank_receives_only_the_keys_its_method_reads_of_its_share(method, keys):
    batch = _step_batch()
    calls = _plan(method, batch, mini=4 if method == "update_actor" else None)
    for rank, (args, _kwargs) in enumerate(calls):
        share = args[0]
        assert set(share.keys()) == keys, (method, rank, sorted(share.keys()))
        assert len(share) == 4  # 8 rows over 2 replicas
        assert share.meta["note"] == "kept"
    # replica 1 (ranks 2, 3) gets the second half (DP_SPLIT) or the second half of each mini-batch of 4
    rows = [2, 3, 6, 7] if method == "update_actor" else [4, 5, 6, 7]
    assert torch.equal(calls[2][0][0]["input_ids"], batch["input_ids"][rows])


def test_update_critic_reads_values_and_returns_only():
    b = _step_batch().update({"old_values": torch.rand(8, 5)})
    share = _plan("update_critic", b, mini=8)[0][0][0]
    assert set(share.keys()) == {"input_ids", "attention_mask", "loss_mask", "old_values", "returns"}
    assert SHARE_META in share.meta


def test_the_reference_share_on_the_wire_is_smaller_than_the_whole_share():
    # before: the reference got old_log_probs, scores, rollout_log_probs, advantages... it never reads
    batch = _step_batch(64, 256)
    sent = len(pickle.dumps(_plan("compute_ref_log_probs", batch)[0]))
    whole = len(pickle.dumps(batch.slice(0, 32).tensors))
    three_keys = 3 * 32 * 256 * 8  # three int64 [32, 256] tensors
    assert three_keys <= sent < three_keys + 4096 < whole


def test_a_missing_declared_read_is_refused_on_the_controller_naming_method_and_key():
    b = _step_batch()
    del b.tensors["attention_mask"]
    with pytest.raises(DispatchError, match=r"RoleHost.compute_log_probs reads \['attention_mask'\]"):
        _plan("compute_log_probs", b)


class _Worker:
    @dispatch(DP_SPLIT, group_size=1, reads=("input_ids",), optional_reads=("loss_mask",))
    def reads_an_undeclared_key(self, batch: Batch):
        return batch["advantages"]

    @dispatch(DP_SPLIT_MINI_BATCHES, group_size=1, mini_batch_attr="m", reads=("input_ids",))
    def requires_an_undeclared_key(self, batch: Batch):
        batch.require("input_ids", "returns")


def test_reading_an_undeclared_key_on_the_worker_names_the_method_and_the_key():
    batch = _step_batch()
    for name, match in [("reads_an_undeclared_key", r"no tensor 'advantages'.*_Worker.reads_an_undeclared_key"),
                        ("requires_an_undeclared_key", r"missing \['returns'\].*_Worker.requires_an_undeclared_key")]:
        spec = dispatched_methods(_Worker)[name]
        (args, kwargs), = plan_calls(spec, (batch,), {}, 1, [0], f"_Worker.{name}")
        assert set(args[0].keys()) <= {"input_ids", "loss_mask"}
        with pytest.raises(KeyError, match=match):
            getattr(_Worker(), name)(*args, **kwargs)


def test_reads_need_a_batch_and_a_sequence_of_names():
    with pytest.raises(DispatchError, match="must be a Batch; got list"):
        plan_calls(dispatched_methods(_Worker)["reads_an_undeclared_key"], ([1, 2],), {}, 1, [0], "m")
    with pytest.raises(TypeError, match="sequences of key names"):
        dispatch(DP_SPLIT, reads="input_ids")
    with pytest.raises(TypeError, match="optional_reads needs reads"):
        dispatch(DP_SPLIT, optional_reads=("x",))


def test_every_role_method_that_takes_a_batch_declares_its_reads():
    methods = dispatched_methods(RoleHost)
    for name in ("compute_log_probs", "compute_ref_log_probs", "compute_values", "score", "update_actor",
                 "update_critic"):
        assert methods[name].reads is not None, name


# -- results kept on the ranks: does a rank's forward share hold the rows its update share trains on? ---------------

def test_one_replica_always_keeps_the_rows_its_update_needs():
    from megarl.controller.dispatch import shares_cover

    assert shares_cover([0, 0], [0, 0], 32, 8)  # quickstart: TP2 DP1, mini-batches of 8 samples


def test_two_replicas_keep_their_rows_only_when_the_update_is_one_mini_batch():
    from megarl.controller.dispatch import shares_cover

    # 8 rows over DP2: the forward gives rank pair k rows [4k, 4k+4); one mini-batch of 8 cuts the same halves
    assert shares_cover([0, 0, 1, 1], [0, 0, 1, 1], 8, None)
    # two mini-batches of 4: replica 0 trains on rows 0-1 and 4-5, row 4 is the other replica's
    assert not shares_cover([0, 0, 1, 1], [0, 0, 1, 1], 8, 4)
    # a reference with another DP layout on the same ranks (DP4 vs the actor's DP2)
    assert not shares_cover([0, 1, 2, 3], [0, 0, 1, 1], 8, None)
    # an update the role cannot cut (8 rows, mini-batches of 3) is not claimed either
    assert not shares_cover([0, 0], [0, 0], 8, 3)
