"""Rank-order co-design (`megarl.reshard.rank_order`): the chosen orders and their bytes, from written theory.

Model: Llama, h=128, 8 heads = 8 KV heads of d=16, ffn=256, vocab 1024 (a multiple of 128*8 and of 64, so neither
Megatron's nor vLLM's vocab padding adds rows), 4 layers, bf16. Every TP-sharded tensor is then cut into equal
contiguous fractions on both sides: Megatron TP shard s of T holds [s/T, (s+1)/T) of it, inference TP rank j of t
needs [j/t, (j+1)/t). Bytes (2 per element):
  A = sharded bytes of one layer = (q 128x128 + k 128x128 + v 128x128 + o 128x128 + gate, up 256x128 + down 128x256)*2
  E = embedding = lm_head = 1024*128*2;  N = the two norms of one layer = 2*128*2;  F = final norm = 128*2.
Inference blocks are consecutive ranks (vLLM's external launcher); the rank at position j of a block is inference
TP rank j. A rank receives what its inference rank needs minus what it holds.
"""

import pytest

from megarl.models.spec import ModelSpec
from megarl.parallel.topology import RoleTopology, TopologyError
from megarl.reshard.planner import lower_bound_bytes, plan_reshard
from megarl.reshard.rank_order import choose_rank_order, order_from, resolve_rank_order

SPEC = ModelSpec(
    architecture="LlamaForCausalLM", num_layers=4, hidden_size=128, num_attention_heads=8, num_query_groups=8,
    head_dim=16, ffn_hidden_size=256, vocab_size=1024, max_position_embeddings=256,
)
A = (4 * 128 * 128 + 3 * 256 * 128) * 2
E = 1024 * 128 * 2
N = 2 * 128 * 2
F = 128 * 2
X = 4 * A + E + E  # everything TP-sharded, the whole model on one stage (pp=1)


def _check(topo_natural, infer_tp, want_natural, want_best, devices_per_node=None):
    choice = choose_rank_order(SPEC, topo_natural, infer_tp, devices_per_node=devices_per_node)
    assert choice.natural_received == want_natural
    assert choice.received == want_best
    # the planner, planning with the chosen coordinates, receives exactly that (and that is its lower bound)
    plan = plan_reshard(SPEC, choice.topology, infer_tp)
    assert {s.rank: s.bytes_received for s in plan.stats} == want_best
    assert lower_bound_bytes(SPEC, choice.topology, infer_tp, plan.infer_rank_of) == want_best
    return choice


def _shard_of(topo):
    return {c.rank: c.tp for c in topo.coords()}


def test_tp4_to_tp2():
    # Natural: rank r holds quarter r. Block {0,1}: rank 0 (inference 0) needs quarters 0,1, holds 0, receives 1;
    # rank 1 (inference 1) needs quarters 2,3 and holds neither: receives half. Block {2,3} mirrors it.
    # Co-designed: ranks at positions 0 and 2 hold quarters of half 0, positions 1 and 3 quarters of half 1: each
    # rank holds one of the two quarters it needs and receives the other, X/4. Norms are held everywhere.
    choice = _check(RoleTopology(tp=4), 2, {0: X // 4, 1: X // 2, 2: X // 2, 3: X // 4}, {r: X // 4 for r in range(4)})
    assert choice.tp_perm == (0, 2, 1, 3)  # first optimum in lexicographic order (ties keep the earlier)
    assert choice.topology.groups("tp") == [[0, 2, 1, 3]]  # TP rank 1 on global rank 2, TP rank 2 on rank 1
    assert choice.max_bytes * 2 == choice.natural_max_bytes


def test_tp4_dp2_to_tp2_the_issue_example():
    # Two DP replicas, each like test_tp4_to_tp2: natural max X/2 (ranks 1, 2, 5, 6), co-designed X/4 everywhere.
    natural = {0: X // 4, 1: X // 2, 2: X // 2, 3: X // 4}
    natural.update({r + 4: v for r, v in natural.items()})
    choice = _check(RoleTopology(tp=4, dp=2), 2, natural, {r: X // 4 for r in range(8)}, devices_per_node=8)
    assert choice.topology.groups("tp") == [[0, 2, 1, 3], [4, 6, 5, 7]]
    assert choice.topology.groups("dp") == [[0, 4], [2, 6], [1, 5], [3, 7]]  # by TP coordinate


def test_tp8_to_tp4():
    # Inference rank j needs Megatron shards 2j, 2j+1 (X/4). Natural: block {0..3} holds shards 0..3, so rank 0
    # holds one of its two (receives X/8), ranks 1-3 none (X/4); block {4..7} holds 4..7: ranks 4-6 none, rank 7
    # (inference 3, shards 6,7) one. Co-designed: position p holds shard (p%4)*2 + p//4 = [0,2,4,6,1,3,5,7]: every
    # rank holds one of its two and receives X/8.
    natural = {0: X // 8, 1: X // 4, 2: X // 4, 3: X // 4, 4: X // 4, 5: X // 4, 6: X // 4, 7: X // 8}
    choice = _check(RoleTopology(tp=8), 4, natural, {r: X // 8 for r in range(8)})
    assert _shard_of(choice.topology) == dict(enumerate([0, 2, 4, 6, 1, 3, 5, 7]))


def test_tp8_to_tp2():
    # Inference rank j needs shards 4j..4j+3 (X/2). Natural: even ranks (inference 0) hold shard r: ranks 0, 2 hold
    # one of theirs (receive 3X/8), ranks 4, 6 none (X/2); odd ranks (inference 1): 1, 3 none (X/2), 5, 7 one
    # (3X/8). Co-designed [0,4,1,5,2,6,3,7]: every rank holds one of its four, receives 3X/8.
    natural = {0: 3 * X // 8, 1: X // 2, 2: 3 * X // 8, 3: X // 2, 4: X // 2, 5: 3 * X // 8, 6: X // 2, 7: 3 * X // 8}
    choice = _check(RoleTopology(tp=8), 2, natural, {r: 3 * X // 8 for r in range(8)})
    assert _shard_of(choice.topology) == dict(enumerate([0, 4, 1, 5, 2, 6, 3, 7]))
    assert sum(choice.received.values()) == 3 * X and sum(choice.natural_received.values()) == 7 * X // 2


def test_tp2_pp2_to_tp4():
    # One inference replica over all 4 ranks; inference rank j needs quarter j of every sharded tensor of both
    # stages (stage 0: layers 0-1 (2A) + embedding, stage 1: layers 2-3 (2A) + lm_head), all 8 norms and the final
    # norm. A rank lacks the other stage entirely: its quarter of the other stage's layers (2A/4), of its vocab
    # tensor (E/4), the other stage's norms (2N), and F when it is on stage 0.
    # Natural: rank0 (pp0,tp0), rank1 (pp0,tp1), rank2 (pp1,tp0), rank3 (pp1,tp1). Rank 1 needs quarter 1 (in
    # half 0) but holds half 1 of stage 0: it receives its quarter of stage 0 too: 2A/4 + 2A/4 + E/4 + E/4 + 2N + F.
    # Co-designed: pp varies fastest: rank0 (pp0,tp0), rank1 (pp1,tp0), rank2 (pp0,tp1), rank3 (pp1,tp1): inference
    # ranks 0,1 need half 0 (both hold half 0 of their stage), 2,3 half 1. Every rank holds its quarter of its own
    # stage: pp0 ranks receive 2A/4 + E/4 + 2N + F, pp1 ranks 2A/4 + E/4 + 2N. TP groups [0,2], [1,3] (inside a
    # 4-device node).
    natural = {
        0: 2 * A // 4 + E // 4 + 2 * N + F,
        1: A + E // 2 + 2 * N + F,
        2: A + E // 2 + 2 * N,
        3: 2 * A // 4 + E // 4 + 2 * N,
    }
    best = {0: A // 2 + E // 4 + 2 * N + F, 1: A // 2 + E // 4 + 2 * N,
            2: A // 2 + E // 4 + 2 * N + F, 3: A // 2 + E // 4 + 2 * N}
    choice = _check(RoleTopology(tp=2, pp=2), 4, natural, best, devices_per_node=4)
    assert choice.topology.groups("tp") == [[0, 2], [1, 3]]
    assert choice.topology.groups("pp") == [[0, 1], [2, 3]]
    # With 2 devices per node the TP groups must stay {0,1}, {2,3}: no TP permutation helps, the natural order stays.
    kept = choose_rank_order(SPEC, RoleTopology(tp=2, pp=2), 4, devices_per_node=2)
    assert kept.topology.rank_order is None and kept.received == natural


def test_tp4_pp2_to_tp2():
    # Four inference replicas (blocks of 2); inference rank j needs half j of both stages' sharded tensors, all
    # norms, F. Stage s has 2A of layer bytes plus E (embedding on stage 0, lm_head on stage 1).
    # Natural: stage 0 on ranks 0-3 (shard = rank), stage 1 on 4-7. Rank 1 (inference 1, half 1) holds shard 1 (in
    # half 0): it receives half of stage 0 (A + E/2) and half of stage 1 (A + E/2) + 2N + F, as does rank 2.
    # Ranks 0, 3 hold a quarter of their half: (2A + E)/4 + A + E/2 + 2N + F. Stage 1 likewise without F.
    # Co-designed: TP order [0,2,1,3] per stage: every rank holds one quarter of its needed half of its own stage:
    # stage-0 ranks receive (2A + E)/4 + A + E/2 + 2N + F, stage-1 ranks the same without F.
    own_quarter = (2 * A + E) // 4 + A + E // 2 + 2 * N
    nothing = 2 * A + E + 2 * N
    natural = {0: own_quarter + F, 1: nothing + F, 2: nothing + F, 3: own_quarter + F,
               4: own_quarter, 5: nothing, 6: nothing, 7: own_quarter}
    best = {r: own_quarter + (F if r < 4 else 0) for r in range(8)}
    choice = _check(RoleTopology(tp=4, pp=2), 2, natural, best, devices_per_node=4)
    assert choice.tp_perm == (0, 2, 1, 3) and choice.dim_order[0] == "tp"
    assert choice.topology.groups("tp") == [[0, 2, 1, 3], [4, 6, 5, 7]]


def test_natural_kept_when_nothing_is_better():
    # TP2 -> TP2: every rank holds exactly what it needs (receives 0); no candidate is strictly better.
    choice = choose_rank_order(SPEC, RoleTopology(tp=2, dp=2), 2)
    assert choice.topology.rank_order is None and set(choice.received.values()) == {0}


def test_tp_wider_than_node_keeps_dim_order():
    # TP4 on 2-device nodes: TP groups cannot be inside a node; only TP permutations of the natural dim order are
    # tried (they move no group to another node). TP4 -> TP2 then still gets [0,2,1,3].
    choice = choose_rank_order(SPEC, RoleTopology(tp=4, dp=2), 2, devices_per_node=2)
    assert choice.dim_order[0] == "tp" and choice.topology.groups("tp") == [[0, 2, 1, 3], [4, 6, 5, 7]]


def test_topology_with_rank_order_is_consistent():
    topo = order_from(RoleTopology(tp=2, pp=2, dp=2, rank_offset=8), ("pp", "tp", "dp", "cp"), (1, 0))
    for c in topo.coords():
        assert topo.rank_of(tp=c.tp, cp=c.cp, dp=c.dp, pp=c.pp) == c.rank
    assert len({(c.tp, c.cp, c.dp, c.pp) for c in topo.coords()}) == 8  # every coordinate on exactly one rank
    assert topo.coord(8).pp == 0 and topo.coord(8).tp == 1 and topo.coord(9).pp == 1  # pp fastest, TP reversed
    assert topo.groups("tp")[0] == [10, 8]  # group rank order = TP coordinate
    assert RoleTopology(tp=2, rank_order=(0, 1)).rank_order is None  # the natural order has one spelling
    with pytest.raises(TopologyError, match="permutation of 0..3"):
        RoleTopology(tp=4, rank_order=(0, 1, 2, 2))


def test_resolve_modes():
    topo = RoleTopology(tp=4)
    assert resolve_rank_order("natural", SPEC, topo, 2) == topo
    assert resolve_rank_order("reshard", SPEC, topo, 2).rank_order == (0, 2, 1, 3)
    with pytest.raises(ValueError, match="natural"):
        resolve_rank_order("strided", SPEC, topo, 2)


QUICKSTART_TP4 = ["resources.pools.default.devices_per_node=4", "actor.parallel.tp=4", "reference.parallel.tp=4",
                  "model.arch.num_query_groups=4"]


def test_dry_run_shows_the_order_and_both_orders_bytes():
    from megarl.cli import dry_run_report
    from megarl.config import load_config

    # quickstart model at TP4 -> rollout TP2, fp32: h=128, 4 heads of 32 (q, o 128x128), 4 KV groups (k, v 128x128),
    # ffn 256 (gate, up 256x128, down 128x256), vocab 512 (a multiple of 128*4 and 64: no padding), 2 layers,
    # untied. TP-sharded bytes X = (2 * (4*128*128 + 3*256*128) + 2 * 512*128) * 4 = 1792 KiB. Natural order: max
    # X/2 = 896 KiB, mean (X/4 + X/2 + X/2 + X/4)/4 = 3X/8 = 672 KiB; co-designed: X/4 = 448 KiB on every rank.
    cfg = load_config("yaml_configs/cpu_quickstart.yaml", QUICKSTART_TP4 + ["actor.parallel.rank_order=reshard"])
    report = dry_run_report(cfg)
    assert "actor.parallel.rank_order: reshard; TP groups [[0, 2, 1, 3]]" in report
    assert "natural order: max 896.00 KiB, mean 672.00 KiB" in report
    assert "* co-designed order: max 448.00 KiB, mean 448.00 KiB" in report
    table = report.split("# placement")[1]  # the last section
    actor_rows = [line.split() for line in table.splitlines() if line.startswith("actor ")]
    assert [(row[1], row[4]) for row in actor_rows] == [("0", "0"), ("1", "2"), ("2", "1"), ("3", "3")]
    natural = dry_run_report(load_config("yaml_configs/cpu_quickstart.yaml", QUICKSTART_TP4))
    assert "actor.parallel.rank_order: natural; TP groups [[0, 1, 2, 3]]" in natural
    assert "* natural order: max 896.00 KiB" in natural


def test_rank_order_is_refused_outside_the_actor():
    from megarl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="reference.parallel.rank_order: 'reshard' is for the actor"):
        load_config("yaml_configs/cpu_quickstart.yaml", ["reference.parallel.rank_order=reshard"])


def test_factory_builds_the_actor_in_the_configured_order():
    from megarl.config import load_config
    from megarl.config.placement import role_topology
    from megarl.roles.factory import actor_topology_in_order

    cfg = load_config("yaml_configs/cpu_quickstart.yaml", QUICKSTART_TP4 + ["actor.parallel.rank_order=reshard"])
    assert actor_topology_in_order(cfg, role_topology(cfg, "actor")).groups("tp") == [[0, 2, 1, 3]]
    natural = load_config("yaml_configs/cpu_quickstart.yaml", QUICKSTART_TP4)
    assert actor_topology_in_order(natural, role_topology(natural, "actor")).rank_order is None
