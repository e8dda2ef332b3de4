"""The reshard planner, pure: every needed byte covered exactly once, local first, balanced sources, bytes received
equal to the lower bound and below the naive gather."""

from collections import defaultdict

import pytest

from megarl.models.spec import ModelSpec
from megarl.parallel.topology import RoleTopology
from megarl.reshard.layouts import megatron_holdings, piece_bytes, vllm_needs, vllm_padded_vocab
from megarl.reshard.planner import choose_mapping, plan_reshard

SPEC = ModelSpec(
    architecture="LlamaForCausalLM", num_layers=4, hidden_size=128, num_attention_heads=4, num_query_groups=2,
    head_dim=32, ffn_hidden_size=256, vocab_size=300, max_position_embeddings=256,
)
QWEN_TIED = ModelSpec(
    architecture="Qwen2ForCausalLM", num_layers=2, hidden_size=128, num_attention_heads=4, num_query_groups=2,
    head_dim=32, ffn_hidden_size=256, vocab_size=300, max_position_embeddings=256, qkv_bias=True,
    tie_word_embeddings=True,
)
LAYOUTS = [  # (tp, pp, dp, infer_tp): every pair that fits in 4 ranks
    (1, 1, 1, 1), (2, 1, 1, 1), (2, 1, 1, 2), (1, 2, 1, 1), (1, 2, 1, 2), (1, 1, 2, 1), (1, 1, 2, 2),
    (2, 2, 1, 1), (2, 2, 1, 2), (2, 1, 2, 2), (1, 2, 2, 2), (1, 1, 4, 4),
]


def _runs_by_param(ops, dst):
    runs = defaultdict(list)
    for op in ops:
        if op.dst == dst:
            runs[(op.dst_param, op.piece.hf_name)].append((op.dst_offset, op.piece.start, op.piece.stop))
    return runs


@pytest.mark.parametrize("spec", [SPEC, QWEN_TIED], ids=["llama", "qwen2-tied"])
@pytest.mark.parametrize("tp,pp,dp,infer_tp", LAYOUTS)
def test_plan_covers_every_need_exactly_once(spec, tp, pp, dp, infer_tp):
    train = RoleTopology(tp=tp, pp=pp, dp=dp)
    plan = plan_reshard(spec, train, infer_tp, dtype_bytes=2)
    for rank in train.ranks:
        needs = vllm_needs(spec, infer_tp, plan.infer_rank_of[rank])
        runs = _runs_by_param(plan.ops, rank)
        for need in needs:
            got = sorted(
                r for r in runs[(need.param, need.piece.hf_name)] if need.piece.start <= r[1] < need.piece.stop
            )
            # contiguous, non-overlapping, exactly the needed run, at the right destination offsets
            assert got[0][1] == need.piece.start and got[-1][2] == need.piece.stop, (need, got)
            for (_o1, _s1, e1), (_o2, s2, _e2) in zip(got, got[1:]):
                assert e1 == s2, f"gap or overlap in {need}: {got}"
            for off, s, _ in got:
                assert off == need.offset + (s - need.piece.start)


@pytest.mark.parametrize("tp,pp,dp,infer_tp", LAYOUTS)
def test_received_bytes_equal_lower_bound_and_beat_naive(tp, pp, dp, infer_tp):
    train = RoleTopology(tp=tp, pp=pp, dp=dp)
    plan = plan_reshard(SPEC, train, infer_tp, dtype_bytes=2)
    for s in plan.stats:
        assert s.bytes_received == s.bytes_lower_bound
        assert s.bytes_received <= s.bytes_naive
        if infer_tp > 1 and s.bytes_naive > 0:
            # an inference shard is a part of the model: strictly fewer bytes than gathering all of it.
            # (At infer_tp=1 every rank needs the whole model, so no plan can beat the gather.)
            assert s.bytes_received < s.bytes_naive
    # what is received is what was sent
    assert sum(s.bytes_received for s in plan.stats) == sum(s.bytes_sent for s in plan.stats)


def test_matching_tp_moves_only_the_vocab_padding_difference():
    plan = plan_reshard(SPEC, RoleTopology(tp=2), 2, dtype_bytes=4)
    remote = [op for op in plan.ops if op.src != op.dst]
    assert {op.piece.hf_name for op in remote} == {"model.embed_tokens.weight", "lm_head.weight"}
    # Megatron: rank 0 holds vocab rows 0..255 (300 padded to 512); vLLM rank 1 needs rows 160..299 (padded to 320)
    assert vllm_padded_vocab(300) == 320
    for op in remote:
        assert (op.src, op.dst, op.piece.start, op.piece.stop) == (0, 1, 160, 256)
    assert plan.stats[0].bytes_received == 0
    assert plan.stats[1].bytes_received == 2 * 96 * 128 * 4


def test_sources_are_balanced_across_data_parallel_replicas():
    # PP=2 x DP=2 -> 4 inference replicas of TP1: every rank needs the other stage, held by two replicas
    train = RoleTopology(pp=2, dp=2)
    plan = plan_reshard(SPEC, train, 1, dtype_bytes=2)
    sent = [s.bytes_sent for s in plan.stats]
    assert min(sent) > 0
    assert max(sent) - min(sent) <= 0.25 * max(sent), sent


def test_mapping_keeps_natural_order_when_it_is_best():
    assert choose_mapping(SPEC, RoleTopology(tp=2, pp=2), 2) == {0: 0, 1: 1, 2: 0, 3: 1}
    assert plan_reshard(SPEC, RoleTopology(tp=2, pp=2), 2).natural_mapping


def test_rollout_tp_must_divide_actor_ranks():
    with pytest.raises(ValueError, match="rollout tp=4 must divide the actor's 2 ranks"):
        plan_reshard(SPEC, RoleTopology(tp=2), 4)


def test_holdings_follow_pipeline_stages_and_tied_copy():
    train = RoleTopology(pp=2)
    last = {p.piece.hf_name for p in megatron_holdings(QWEN_TIED, train, 1)}
    assert "model.embed_tokens.weight" in last  # tied output layer copy on the last stage
    assert not any(n.startswith("model.layers.0.") for n in last)
    first = {p.piece.hf_name for p in megatron_holdings(QWEN_TIED, train, 0)}
    assert "model.norm.weight" not in first


def test_piece_bytes_counts_other_dims():
    need = [p for p in vllm_needs(SPEC, 2, 0) if p.param.endswith("o_proj.weight")][0]
    assert (need.piece.dim, need.piece.length) == (1, 64)
    assert piece_bytes(SPEC, need.piece, 2) == 64 * 128 * 2


# ------------------------------------------------------------------ the lower bound, independent of the plan
MORE_LAYOUTS = LAYOUTS + [  # 8-rank layouts (pure planner: no processes)
    (2, 2, 2, 2), (2, 2, 2, 4), (1, 2, 4, 2), (2, 1, 4, 4), (1, 4, 2, 4), (2, 2, 1, 4), (1, 1, 8, 4), (2, 1, 2, 4),
]


@pytest.mark.parametrize("search", [False, True], ids=["natural", "searched"])
@pytest.mark.parametrize("spec,tp,pp,dp,infer_tp", [
    pytest.param(spec, *layout, id=f"{name}-{layout}") for name, spec in (("llama", SPEC), ("qwen2-tied", QWEN_TIED))
    for layout in MORE_LAYOUTS if spec.num_layers % layout[1] == 0  # QWEN_TIED's 2 layers do not split over pp=4
])
def test_received_equals_the_bound_computed_from_layouts_alone(spec, tp, pp, dp, infer_tp, search):
    train = RoleTopology(tp=tp, pp=pp, dp=dp)
    plan = plan_reshard(spec, train, infer_tp, dtype_bytes=2, search_mapping=search)
    for s in plan.stats:
        assert s.bytes_received == s.bytes_lower_bound, (s.rank, s.bytes_received, s.bytes_lower_bound)
        assert s.bytes_plan_remote == s.bytes_received


@pytest.mark.parametrize("tp,pp,dp,infer_tp", [(1, 1, 2, 2), (1, 1, 2, 1), (2, 1, 2, 2), (1, 2, 2, 2), (2, 2, 2, 4)])
def test_a_plan_ignoring_local_shards_is_caught_by_the_bound(tp, pp, dp, infer_tp):
    # With DP replicas every needed piece a rank holds is also held by another replica: the worse plan fetches it.
    train = RoleTopology(tp=tp, pp=pp, dp=dp)
    worse = plan_reshard(SPEC, train, infer_tp, dtype_bytes=2, _prefer_local=False)
    good = plan_reshard(SPEC, train, infer_tp, dtype_bytes=2)
    assert [s.bytes_lower_bound for s in worse.stats] == [s.bytes_lower_bound for s in good.stats]
    assert all(s.bytes_local == 0 for s in worse.stats)
    # the plan's own figure cannot see it (it is needed minus the plan's local copies) ...
    assert all(s.bytes_plan_remote == s.bytes_received for s in worse.stats)
    # ... the independent bound does, on every rank
    assert all(s.bytes_received > s.bytes_lower_bound for s in worse.stats), [
        (s.bytes_received, s.bytes_lower_bound) for s in worse.stats]


def test_theory_tp2pp2_to_infer_tp2_receives_a_quarter_of_the_sharded_bytes():
    # Llama, untied, vocab 512 so Megatron's padding (multiple of 128*tp = 256) and vLLM's (64) agree: both cut the
    # vocabulary at row 256. Megatron TP rank t and vLLM TP rank t then hold the same half of every sharded weight
    # of the layers they share; a rank holds its stage's half of the model and needs its TP half of all of it, so
    # it receives half of the other stage's sharded bytes = 1/4 of all sharded bytes, plus the other stage's norms.
    spec = ModelSpec(architecture="LlamaForCausalLM", num_layers=4, hidden_size=128, num_attention_heads=4,
                     num_query_groups=2, head_dim=32, ffn_hidden_size=256, vocab_size=512,
                     max_position_embeddings=256)
    h, ffn = 128, 256
    per_layer = (4 * 32 * h) + 2 * (2 * 32 * h) + h * (4 * 32) + 3 * (ffn * h)  # q, k+v, o, gate+up+down
    assert per_layer == 147456
    sharded = 4 * per_layer + 2 * 512 * h  # + embed_tokens and lm_head
    layer_norms = 2 * h  # input + post-attention layernorm
    bf16 = 2
    plan = plan_reshard(spec, RoleTopology(tp=2, pp=2), 2, dtype_bytes=bf16)
    expected = {  # ranks 0, 1 = stage 0 (layers 0-1, embedding); ranks 2, 3 = stage 1 (layers 2-3, norm, lm_head)
        0: sharded // 4 + 2 * layer_norms + h, 1: sharded // 4 + 2 * layer_norms + h,
        2: sharded // 4 + 2 * layer_norms, 3: sharded // 4 + 2 * layer_norms,
    }
    assert {s.rank: s.bytes_received for s in plan.stats} == {r: e * bf16 for r, e in expected.items()}
    assert {s.rank: s.bytes_lower_bound for s in plan.stats} == {r: e * bf16 for r, e in expected.items()}


def test_theory_tp8pp2_to_infer_tp8_receives_a_sixteenth_of_the_model():
    # 8 heads and 8 KV heads (one of each per TP rank), vocab 1024 = Megatron's padding multiple at tp 8 (128*8)
    # and a multiple of vLLM's 64: both sides cut 128 rows per rank. Each rank holds 1/8 of its stage (1/16 of
    # the model) and needs 1/8 of the model: it receives 1/16 of the model, plus the other stage's norms.
    spec = ModelSpec(architecture="LlamaForCausalLM", num_layers=4, hidden_size=256, num_attention_heads=8,
                     num_query_groups=8, head_dim=32, ffn_hidden_size=512, vocab_size=1024,
                     max_position_embeddings=256)
    h, ffn = 256, 512
    per_layer = 4 * (h * h) + 3 * (ffn * h)  # q, k, v, o are h x h here; gate, up, down
    model_without_norms = 4 * per_layer + 2 * 1024 * h
    assert model_without_norms == 3145728
    layer_norms = 2 * h
    plan = plan_reshard(spec, RoleTopology(tp=8, pp=2), 8, dtype_bytes=2)
    for s in plan.stats:
        stage = s.rank // 8  # megatron-core's rank order tp-cp-ep-dp-pp: ranks 0-7 are stage 0
        norms = 2 * layer_norms + (h if stage == 0 else 0)  # the other stage's layer norms (+ final norm)
        assert s.bytes_received == s.bytes_lower_bound == (model_without_norms // 16 + norms) * 2, s


def test_searched_mapping_can_differ_from_what_vllm_realises_and_is_refused():
    from megarl.reshard.planner import check_engine_mapping

    # TP2PP2 -> infer TP4: block = ranks 0..3 = (tp0,s0), (tp1,s0), (tp0,s1), (tp1,s1). Megatron tp0 holds quarters
    # 0-1 of each sharded weight, tp1 quarters 2-3; keeping most bytes local puts rank 1 on quarter 2, rank 2 on 1.
    searched = plan_reshard(SPEC, RoleTopology(tp=2, pp=2), 4, search_mapping=True)
    assert searched.infer_rank_of == {0: 0, 1: 2, 2: 1, 3: 3}
    natural = plan_reshard(SPEC, RoleTopology(tp=2, pp=2), 4)
    assert natural.infer_rank_of == {0: 0, 1: 1, 2: 2, 3: 3} and natural.natural_mapping
    # vLLM's external launcher: TP rank = position in the block
    for rank in range(4):
        check_engine_mapping(natural, rank, engine_tp_rank=rank % 4)
    with pytest.raises(RuntimeError, match="rank 1: the plan writes inference TP rank 2's shards, the vLLM engine "
                                           "there is TP rank 1"):
        check_engine_mapping(searched, 1, engine_tp_rank=1)
