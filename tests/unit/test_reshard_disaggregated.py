"""The reshard across pools, pure: training ranks and inference ranks in one bridge numbering (`InferLayout`).

Colocated plans are pinned to what the planner produced before the second rank space existed. Disaggregated plans
are checked against byte counts written out here from the HF shapes of the test models (Megatron pads the
vocabulary to a multiple of 128*tp, vLLM to a multiple of 64), against the independent element masks of
`test_reshard_moe_planner` (what each training rank holds, what each vLLM rank needs), and for balance against the
list-scheduling bound. The fan-out cost model is checked against the same hand-computed bytes.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from megarl.parallel.topology import RoleTopology
from megarl.reshard.fanout import (
    Links,
    Phase,
    choose_fanout,
    fanout_cost,
    fanout_costs,
)
from megarl.reshard.layouts import InferLayout
from megarl.reshard.planner import plan_reshard
from tests.unit.test_reshard_moe_planner import LAYOUTS as MOE_LAYOUTS
from tests.unit.test_reshard_moe_planner import QWEN3_MOE, SPECS, _held, _needed, _train_layout
from tests.unit.test_reshard_planner import MORE_LAYOUTS, QWEN_TIED, SPEC

BF16 = 2


# ------------------------------------------------------------------------------- colocated: the plan is unchanged
def _digest(plans) -> str:
    h = hashlib.sha256()
    for plan in plans:
        for op in plan.ops:
            h.update(repr((op.src, op.dst, op.piece.hf_name, op.piece.dim, op.piece.start, op.piece.stop,
                           op.src_param, op.src_offset, op.dst_param, op.dst_offset, op.nbytes)).encode())
        for s in plan.stats:
            h.update(repr((s.rank, s.infer_tp_rank, s.bytes_received, s.bytes_local, s.bytes_sent,
                           s.bytes_lower_bound, s.bytes_naive, s.bytes_plan_remote)).encode())
        h.update(repr(sorted(plan.infer_rank_of.items())).encode())
    return h.hexdigest()[:24]


# Digests of every op and every rank's statistics of these plans, computed with the planner of main at 451d930
# (before `InferLayout`): the colocated plan must stay byte-for-byte the same plan.
PINNED = {
    "llama": "f745e0dab6abfc006f43a7b0", "qwen2-tied": "7d53742063b6fc6b8e770d37",
    "qwen3moe": "a7e873c3b579dc329c5609b7", "mixtral": "7c352b2ef1d087b99cc30dda",
    "qwen2moe-shared-tied": "7914a0933bad34130040a994",
}


@pytest.mark.parametrize("as_layout", [False, True], ids=["int-tp", "InferLayout.colocated"])
def test_colocated_plans_are_the_plans_of_before(as_layout):
    def infer(train, tp, ep=False):
        return InferLayout.colocated(train, tp, ep) if as_layout else tp

    got = {}
    for name, spec in (("llama", SPEC), ("qwen2-tied", QWEN_TIED)):
        plans = []
        for tp, pp, dp, itp in MORE_LAYOUTS:
            if spec.num_layers % pp:
                continue
            train = RoleTopology(tp=tp, pp=pp, dp=dp)
            for search in (False, True):
                plans.append(plan_reshard(spec, train, infer(train, itp), dtype_bytes=BF16, search_mapping=search))
        got[name] = _digest(plans)
    for name, spec in SPECS.items():
        plans = []
        for tp, pp, dp, ep, etp, vpp, first, last, itp, iep in MOE_LAYOUTS:
            if ep > spec.num_experts or (iep and itp > spec.num_experts):
                continue
            train = RoleTopology(tp=tp, pp=pp, dp=dp, ep=ep, etp=etp)
            for keep in (True, False):
                kwargs = {} if as_layout else {"infer_ep": iep}
                plans.append(plan_reshard(spec, train, infer(train, itp, iep), dtype_bytes=BF16, keep_ops=keep,
                                          train_layout=_train_layout(first, last, vpp), **kwargs))
        got[name] = _digest(plans)
    assert got == PINNED


def test_infer_layout_errors_name_the_numbers():
    with pytest.raises(ValueError, match="rollout tp=3 must divide the rollout pool's 8 ranks"):
        InferLayout.pool(8, 3, rank_offset=8)
    with pytest.raises(ValueError, match="rollout tp=4 must divide the actor's 2 ranks"):
        InferLayout.colocated(RoleTopology(tp=2), 4)
    with pytest.raises(ValueError, match="InferLayout.replicas must be a positive integer, got 0"):
        InferLayout(tp=2, replicas=0)
    with pytest.raises(ValueError, match="infer_ep=True conflicts"):
        plan_reshard(QWEN3_MOE, RoleTopology(dp=2, ep=2), InferLayout(2, 1, rank_offset=2), infer_ep=True)
    assert InferLayout.pool(8, 2, rank_offset=8) == InferLayout(tp=2, replicas=4, rank_offset=8)
    assert list(InferLayout(2, 2, rank_offset=4).ranks) == [4, 5, 6, 7]
    assert [InferLayout(2, 2, rank_offset=4).tp_rank(r) for r in range(4, 8)] == [0, 1, 0, 1]


# ------------------------------------------------------------------- disaggregated: bytes derived by hand
# SPEC (tiny Llama): hidden 128, 4 heads of 32, 2 KV heads, ffn 256, vocab 300, 4 layers, untied.
H, Q, KV, FFN, V, LAYERS = 128, 128, 64, 256, 300, 4
LINEAR = Q * H + 2 * KV * H + H * Q + 3 * FFN * H  # q, k, v, o, gate, up, down: 147456 elements per layer
LAYER_NORMS = 2 * H
MODEL = LAYERS * (LINEAR + LAYER_NORMS) + 2 * V * H + H  # + embed_tokens, lm_head, final norm
MODEL_BYTES = MODEL * BF16  # 1335552
# Megatron TP2 pads the vocabulary to 512 (a multiple of 128*2): TP rank 0 holds rows 0..255, rank 1 rows 256..299
# (44 rows) of embed_tokens and of lm_head. Every TP-sharded linear weight is split in halves.
ONLY_TP0 = (LAYERS * LINEAR // 2 + 2 * 256 * H) * BF16  # bytes only Megatron TP rank 0 holds: 720896
ONLY_TP1 = (LAYERS * LINEAR // 2 + 2 * 44 * H) * BF16  # 612352
NORMS = (LAYERS * LAYER_NORMS + H) * BF16  # held by both TP ranks: 2304


def test_hand_numbers():
    assert MODEL_BYTES == 1335552 and ONLY_TP0 + ONLY_TP1 + NORMS == MODEL_BYTES
    assert plan_reshard(SPEC, RoleTopology(tp=2), InferLayout(1, 2, rank_offset=2)).model_bytes == MODEL_BYTES


def test_tp2_actor_into_two_tp1_engines_receives_the_whole_model_on_each():
    plan = plan_reshard(SPEC, RoleTopology(tp=2), InferLayout(tp=1, replicas=2, rank_offset=2), dtype_bytes=BF16)
    by = {s.rank: s for s in plan.stats}
    assert sorted(by) == [0, 1, 2, 3] and by[0].infer_tp_rank is None and by[2].infer_tp_rank == 0
    for r in (2, 3):  # an inference rank holds nothing: it receives all it needs, the whole model at TP1
        assert by[r].bytes_received == by[r].bytes_lower_bound == MODEL_BYTES
        assert by[r].bytes_local == by[r].bytes_sent == 0
    # each engine needs everything: TP rank 0 sends what only it holds twice; the norms (held by both) go to the
    # less-loaded TP rank 1, which stays below rank 0 even with all of them: the best possible max
    assert by[0].bytes_sent == 2 * ONLY_TP0
    assert by[1].bytes_sent == 2 * (ONLY_TP1 + NORMS)
    assert by[0].bytes_received == by[1].bytes_received == 0
    t = plan.traffic()
    assert (t.max_sent, t.mean_sent, t.max_received, t.mean_received) == (
        2 * ONLY_TP0, MODEL_BYTES, MODEL_BYTES, MODEL_BYTES)
    assert all(op.src in (0, 1) and op.dst in (2, 3) for op in plan.ops)


def test_tp2_actor_into_one_tp2_engine():
    plan = plan_reshard(SPEC, RoleTopology(tp=2), InferLayout(tp=2, rank_offset=2), dtype_bytes=BF16)
    by = {s.rank: s for s in plan.stats}
    # vLLM TP2 pads the vocabulary to 320: rank 0 rows 0..159, rank 1 rows 160..299 (140). KV heads 2 over TP2.
    shard = LAYERS * (LINEAR // 2 + LAYER_NORMS) + H
    assert by[2].bytes_received == (shard + 2 * 160 * H) * BF16 == 674048
    assert by[3].bytes_received == (shard + 2 * 140 * H) * BF16 == 663808
    # Megatron TP rank t holds vLLM TP rank t's half of every linear weight; vocab rows 0..255 are on TP rank 0
    # (rank 1 needs 160..255 of them from there), rows 256..299 on TP rank 1; norms to both from the less loaded.
    assert by[0].bytes_sent == ONLY_TP0
    assert by[1].bytes_sent == ONLY_TP1 + 2 * NORMS
    assert plan.traffic().max_sent == ONLY_TP0


def test_pp2_actor_into_one_tp2_engine():
    plan = plan_reshard(SPEC, RoleTopology(pp=2), InferLayout(tp=2, rank_offset=2), dtype_bytes=BF16)
    by = {s.rank: s for s in plan.stats}
    # stage 0 (rank 0): layers 0-1 and embed_tokens; stage 1 (rank 1): layers 2-3, final norm, lm_head. Both
    # inference ranks need their half of every linear weight and every norm whole: each stage sends its layers'
    # linear weights once (two halves) and its norms twice, and its vocab tensor once (160 + 140 rows).
    assert by[0].bytes_sent == (2 * LINEAR + 2 * 2 * LAYER_NORMS + V * H) * BF16 == 668672
    assert by[1].bytes_sent == (2 * LINEAR + 2 * 2 * LAYER_NORMS + 2 * H + V * H) * BF16 == 669184
    assert by[2].bytes_received + by[3].bytes_received == by[0].bytes_sent + by[1].bytes_sent


def test_moe_ep2_actor_into_one_tp2_engine():
    # QWEN3_MOE: hidden 64, 4 heads of 32, 2 KV heads, q/k norms of 32, 4 experts of width 32, vocab 300, 4 layers.
    # EP2 (dp2): both ranks hold every dense weight whole; rank 0 experts 0-1, rank 1 experts 2-3.
    h, m = 64, 32
    dense_per_layer = 64 * h + 32 * h + 32 * h + h * 64 + 2 * 32 + 2 * h + 4 * h  # vLLM TP2 halves + norms, router
    expert_half = 3 * (m // 2) * h  # gate, up rows and down columns: half an expert
    per_rank_experts = 4 * 4 * expert_half  # every layer, every expert
    plan = plan_reshard(QWEN3_MOE, RoleTopology(dp=2, ep=2), InferLayout(tp=2, rank_offset=2), dtype_bytes=BF16)
    by = {s.rank: s for s in plan.stats}
    assert by[2].bytes_received == (4 * dense_per_layer + per_rank_experts + 2 * 160 * h + h) * BF16 == 241280
    assert by[3].bytes_received == (4 * dense_per_layer + per_rank_experts + 2 * 140 * h + h) * BF16 == 236160
    # each training rank must send its two experts' halves to both inference ranks (the same bytes on both); the
    # dense rest, held by both, is levelled between them: each sends half of everything
    forced = 4 * 2 * 2 * expert_half * BF16
    total = by[2].bytes_received + by[3].bytes_received
    assert min(by[0].bytes_sent, by[1].bytes_sent) >= forced
    assert by[0].bytes_sent == by[1].bytes_sent == total // 2


# (tp, pp, dp, ep, infer_tp, replicas): dense and MoE, the rollout pool after the training ranks
DISAGG = [(2, 1, 1, 1, 1, 2), (2, 1, 1, 1, 2, 1), (1, 2, 1, 1, 2, 1), (1, 1, 2, 1, 1, 2), (2, 2, 2, 1, 2, 4),
          (1, 2, 2, 1, 4, 2), (2, 1, 2, 1, 4, 1), (1, 1, 2, 2, 2, 1), (1, 2, 2, 2, 2, 2), (2, 1, 2, 2, 4, 1)]


@pytest.mark.parametrize("tp,pp,dp,ep,infer_tp,replicas", DISAGG)
def test_every_inference_rank_gets_exactly_its_shard_from_holders(tp, pp, dp, ep, infer_tp, replicas):
    spec = QWEN3_MOE if ep > 1 else SPEC
    train = RoleTopology(tp=tp, pp=pp, dp=dp, ep=ep)
    infer = InferLayout(infer_tp, replicas, rank_offset=train.world_size)
    plan = plan_reshard(spec, train, infer, dtype_bytes=BF16)
    needs = {j: _needed(spec, infer_tp, j, False) for j in range(infer_tp)}
    held = {r: _held(spec, tp, pp, dp, ep, None, 1, None, None, r) for r in train.ranks}
    got = {r: {n: torch.zeros(t.shape, dtype=torch.int32) for n, t in needs[0].items()} for r in infer.ranks}
    for op in plan.ops:
        assert op.src in train.ranks and op.dst in infer.ranks, op
        idx = [slice(None)] * held[op.src][op.piece.hf_name].dim()
        idx[op.piece.dim] = slice(op.piece.start, op.piece.stop)
        assert bool(held[op.src][op.piece.hf_name][tuple(idx)].all()), f"rank {op.src} does not hold {op.piece}"
        got[op.dst][op.piece.hf_name][tuple(idx)] += 1
    for r in infer.ranks:
        need = needs[(r - infer.rank_offset) % infer_tp]
        for name, mask in need.items():
            assert torch.equal(got[r][name], mask.int()), f"rank {r}: {name} not covered exactly once"
        want = sum(int(m.sum()) for m in need.values()) * BF16
        s = next(s for s in plan.stats if s.rank == r)
        assert s.bytes_received == s.bytes_lower_bound == want and s.bytes_local == 0


@pytest.mark.parametrize("tp,pp,dp,infer_tp,replicas", [(1, 1, 2, 1, 2), (1, 1, 4, 2, 4), (2, 2, 2, 2, 4),
                                                        (1, 2, 4, 1, 4), (2, 1, 4, 4, 2)])
def test_senders_are_balanced_across_replicas(tp, pp, dp, infer_tp, replicas):
    # Every byte is held by dp replicas; the planner levels the runs they share between them, so within a pipeline
    # stage and TP rank no replica sends more than the others' mean plus the largest single run, bounded by a whole
    # embed_tokens / lm_head (V*H elements) -- a loose bound; the exact one is the next test's.
    train = RoleTopology(tp=tp, pp=pp, dp=dp)
    plan = plan_reshard(SPEC, train, InferLayout(infer_tp, replicas, rank_offset=train.world_size), dtype_bytes=BF16)
    sent = {s.rank: s.bytes_sent for s in plan.stats if s.rank in train.ranks}
    largest = V * H * BF16
    for stage in range(pp):
        for t in range(tp):
            group = [sent[train.rank_of(tp=t, dp=d, pp=stage)] for d in range(dp)]
            assert max(group) - min(group) <= largest, (stage, t, group)
    # every engine gets its shards once: replicas x the bytes of the vLLM masks (norms and, at TP4 over 2 KV heads,
    # k/v replicated per TP rank)
    shards = sum(int(m.sum()) for j in range(infer_tp) for m in _needed(SPEC, infer_tp, j, False).values()) * BF16
    traffic = plan.traffic()
    assert traffic.mean_sent * len(sent) == replicas * shards
    assert traffic.max_received == max(s.bytes_received for s in plan.stats)


def _min_max_sent(spec, train: RoleTopology, ep: int, infer_tp: int, replicas: int) -> float:
    """The least bytes the busiest training rank can send, any plan: max over sets S of training ranks of (bytes of
    the needed elements held only inside S) / |S| (the work S alone can do, shared at best evenly; with runs that
    can be cut anywhere this bound is reached, by max-flow min-cut). From the independent element masks."""
    import itertools

    held = {r: _held(spec, train.tp, train.pp, train.dp, ep, None, 1, None, None, r) for r in train.ranks}
    needs = [_needed(spec, infer_tp, j, False) for j in range(infer_tp)]
    holders = torch.cat([sum(held[r][n].long() << r for r in train.ranks).flatten() for n in needs[0]])
    counts = torch.cat([(sum(need[n].long() for need in needs) * replicas).flatten() for n in needs[0]])
    best = 0.0
    for k in range(1, train.world_size + 1):
        for subset in itertools.combinations(train.ranks, k):
            inside = sum(1 << r for r in subset)
            best = max(best, int(counts[(holders & ~inside) == 0].sum()) * BF16 / k)
    return best


@pytest.mark.parametrize("tp,pp,dp,ep,infer_tp,replicas", DISAGG + [(1, 1, 4, 1, 2, 4), (1, 2, 4, 1, 1, 4),
                                                                    (2, 1, 4, 1, 4, 2)])
def test_the_busiest_sender_sends_the_least_any_plan_can(tp, pp, dp, ep, infer_tp, replicas):
    # Measured before the pool router levelled the shared runs (least-loaded holder, run by run, in need order):
    # up to 28 KB above this minimum (pp2 dp4 into four TP1 engines), EP2 into one TP2 engine 6.7 KB above.
    spec = QWEN3_MOE if ep > 1 else SPEC
    train = RoleTopology(tp=tp, pp=pp, dp=dp, ep=ep)
    plan = plan_reshard(spec, train, InferLayout(infer_tp, replicas, rank_offset=train.world_size), dtype_bytes=BF16)
    assert plan.traffic().max_sent == _min_max_sent(spec, train, ep, infer_tp, replicas)


def test_lower_bound_of_a_rank_holding_nothing_is_its_whole_shard():
    from megarl.reshard.planner import lower_bound_bytes

    train = RoleTopology(tp=2)
    bound = lower_bound_bytes(SPEC, train, 1, {2: 0, 3: 0}, dtype_bytes=BF16)
    assert bound == {2: MODEL_BYTES, 3: MODEL_BYTES}


# --------------------------------------------------------------------------------------- the fan-out cost model
def test_phase_and_cost_arithmetic():
    links = Links(bridge=100.0, rollout_pool=1000.0, train_pool=50.0)
    a = Phase("a", "bridge", {0: 300, 1: 100}, {2: 200, 3: 400})
    b = Phase("b", "rollout_pool", {2: 400}, {3: 400})
    c = Phase("c", "bridge+rollout_pool", {0: 10}, {4: 20})
    assert a.max_moved == 400 and a.time_s(links) == 4.0
    assert b.time_s(links) == 0.4 and c.time_s(links) == 0.2
    assert Phase("g", "train_pool", {1: 100}, {0: 100}).time_s(links) == 2.0
    assert Links(1.0, 8.0).bandwidth("train_pool") == 8.0  # defaults to the rollout pool's
    cost = fanout_cost("x", (a, b), links)
    assert (cost.max_sent, cost.max_received, cost.time_s) == (400, 800, 4.4)  # rank 2 sends 400, 3 receives 800
    with pytest.raises(ValueError, match="bridge must be > 0"):
        Links(0.0, 1.0)


@pytest.mark.parametrize("bridge,pool,train_pool,winner", [
    (1e9, 1e9, 1e9, "direct"),                     # equal links: the shard-to-shard plan is fastest
    (1e9, 1e11, 1e11, "gather_broadcast"),         # fast pools: one bridge crossing per byte, the rest inside
    (1e9, 1e11, 1e8, "replica_broadcast"),         # ... but a slow training pool makes the gather expensive
])
def test_fanout_costs_by_hand_tp2_into_two_tp1_engines(bridge, pool, train_pool, winner):
    train, infer = RoleTopology(tp=2), InferLayout(tp=1, replicas=2, rank_offset=2)
    links = Links(bridge, pool, train_pool)
    costs = fanout_costs(SPEC, train, infer, links, dtype_bytes=BF16)
    direct, gather, replica = costs["direct"], costs["gather_broadcast"], costs["replica_broadcast"]
    # direct: TP rank 0 sends its only-copy bytes to both engines (the norms go to rank 1); each engine rank
    # receives the model
    assert (direct.max_sent, direct.max_received) == (2 * ONLY_TP0, MODEL_BYTES)
    assert direct.time_s == pytest.approx(2 * ONLY_TP0 / bridge)
    # (a): TP rank 1 sends its only-copy bytes to rank 0 (rank 0 holds the norms), then rank 0 -> 2 -> 3 with the
    # model: rank 2 receives and forwards it
    assert [dict(p.sent) for p in gather.phases] == [{1: ONLY_TP1}, {0: MODEL_BYTES, 2: MODEL_BYTES}]
    assert [dict(p.received) for p in gather.phases] == [{0: ONLY_TP1}, {2: MODEL_BYTES, 3: MODEL_BYTES}]
    assert gather.time_s == pytest.approx(ONLY_TP1 / train_pool + MODEL_BYTES / min(bridge, pool))
    # (b): the plan into engine 0 (rank 2 receives the model, rank 0 sends its only-copy bytes once), then 2 -> 3
    assert replica.phases[0].sent == {0: ONLY_TP0, 1: ONLY_TP1 + NORMS}
    assert replica.phases[1].sent == {2: MODEL_BYTES} and replica.phases[1].received == {3: MODEL_BYTES}
    assert replica.time_s == pytest.approx(MODEL_BYTES / bridge + MODEL_BYTES / pool)
    assert choose_fanout(costs).strategy == winner
    assert choose_fanout(costs, "replica_broadcast") is replica
    with pytest.raises(ValueError, match="sync_fanout='ring'"):
        choose_fanout(costs, "ring")


def test_one_engine_makes_replica_broadcast_the_direct_plan():
    train, infer = RoleTopology(tp=2, pp=2), InferLayout(tp=2, replicas=1, rank_offset=4)
    costs = fanout_costs(SPEC, train, infer, Links(1e9, 1e9), dtype_bytes=BF16)
    assert costs["replica_broadcast"].time_s == costs["direct"].time_s
    assert costs["replica_broadcast"].phases[1].max_moved == 0
    # (a) broadcasts the full model to each of the two inference ranks: each receives the model
    assert costs["gather_broadcast"].max_received == MODEL_BYTES


# ------------------------------------------------------------------------------ executor arguments across pools
def test_executor_refuses_ranks_outside_the_plan_and_a_receiver_without_its_wire_dtype():
    from megarl.reshard.executor import DictSink, execute_reshard

    plan = plan_reshard(SPEC, RoleTopology(tp=2), InferLayout(tp=1, replicas=2, rank_offset=2), dtype_bytes=BF16)
    with pytest.raises(ValueError, match=r"rank 4 is neither a training rank \(0..1\) nor an inference rank"):
        execute_reshard(plan, {}, None, rank=4)
    with pytest.raises(ValueError, match="rank 2 has no Megatron sources .* pass the wire dtype of the 2-byte plan"):
        execute_reshard(plan, {}, DictSink(), rank=2)
    with pytest.raises(ValueError, match="dtype=torch.float32 does not have the plan's 2-byte elements"):
        execute_reshard(plan, {}, DictSink(), rank=2, dtype=torch.float32)
    with pytest.raises(ValueError, match="rank 3 is inference TP rank 0 of the plan but has no sink"):
        execute_reshard(plan, {}, None, rank=3, dtype=torch.bfloat16)
