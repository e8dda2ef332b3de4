"""The architecture of a model config: the inline `arch` block, or the numbers in a HF checkpoint's config.json.

Only config.json is read (no weights, no transformers import), so validation stays fast and works on a login
node that cannot see the weights' storage format.
"""

from __future__ import annotations

import json
import os

from megarl.config.errors import ConfigError
from megarl.config.schema import ArchConfig, ModelConfig
from megarl.models.spec import ARCHITECTURES, ModelSpec, UnsupportedModelError

# The mixture-of-experts fields ArchConfig and ModelSpec share (defaults: a dense model).
MOE_FIELDS = ("num_experts", "moe_topk", "moe_ffn_hidden_size", "moe_norm_topk_prob", "moe_layers",
              "shared_expert_ffn_hidden_size")


def arch_from_hf_config(hf: dict, where: str) -> ArchConfig:
    """ArchConfig from the contents of a HF config.json (`where` names the file in errors).

    The parsing rules (GQA defaults, explicit head_dim, rope settings) live in `ModelSpec.from_hf_config`.
    """
    try:
        spec = ModelSpec.from_hf_config(hf)
    except UnsupportedModelError as e:
        raise ConfigError(f"{where}: {e}") from None
    return ArchConfig(
        architecture=spec.architecture,
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        head_dim=spec.head_dim,
        ffn_hidden_size=spec.ffn_hidden_size,
        vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        rope_theta=spec.rope_theta,
        norm_eps=spec.norm_eps,
        **{k: getattr(spec, k) for k in MOE_FIELDS},
    )


def spec_from_arch(arch: ArchConfig, key: str = "model") -> ModelSpec:
    """An inline architecture as a `ModelSpec`; the architecture's quirks (qkv bias, qk layernorm) follow its HF
    class (`megarl.models.spec.ARCHITECTURES`), as for a checkpoint."""
    traits = ARCHITECTURES[arch.architecture]
    moe = {k: getattr(arch, k) for k in MOE_FIELDS}
    if not traits.moe and any(moe[k] != ArchConfig.__dataclass_fields__[k].default for k in MOE_FIELDS):
        raise ConfigError(
            f"{key}.arch: {arch.architecture} is a dense architecture; leave the MoE fields ({', '.join(MOE_FIELDS)}) "
            "unset or pick a MoE architecture (MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM)"
        )
    try:
        return ModelSpec(
            architecture=arch.architecture, num_layers=arch.num_layers, hidden_size=arch.hidden_size,
            num_attention_heads=arch.num_attention_heads, num_query_groups=arch.num_query_groups,
            head_dim=arch.head_dim, ffn_hidden_size=arch.ffn_hidden_size, vocab_size=arch.vocab_size,
            max_position_embeddings=arch.max_position_embeddings, rope_theta=arch.rope_theta, norm_eps=arch.norm_eps,
            qkv_bias=traits.qkv_bias, qk_layernorm=traits.qk_layernorm, tie_word_embeddings=arch.tie_word_embeddings,
            **(moe if traits.moe else {}),
        )
    except UnsupportedModelError as e:
        raise ConfigError(f"{key}.arch: {e}") from None


def resolve_arch(model: ModelConfig, key: str = "model") -> ArchConfig:
    """The architecture of `model` (config key `key`, used in error messages)."""
    if (model.path is None) == (model.arch is None):
        raise ConfigError(
            f"{key}: set exactly one of '{key}.path' (a HF checkpoint directory) or '{key}.arch' "
            f"(an inline architecture); got {'both' if model.path else 'neither'}"
        )
    if model.arch is not None:
        spec_from_arch(model.arch, key)  # the architecture's own rules (MoE fields, rope), named by key
        return model.arch
    config_json = os.path.join(model.path, "config.json")
    try:
        with open(config_json, encoding="utf-8") as f:
            hf = json.load(f)
    except FileNotFoundError:
        raise ConfigError(
            f"{key}.path: no config.json in {model.path!r} (expected {config_json}; "
            "point it at a HuggingFace checkpoint directory or use an inline arch)"
        ) from None
    except OSError as e:
        raise ConfigError(f"{key}.path: cannot read {config_json}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{key}.path: {config_json} is not valid JSON (line {e.lineno}: {e.msg})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{key}.path: {config_json} must hold a JSON object")
    return arch_from_hf_config(hf, f"{key}.path: {config_json}")
