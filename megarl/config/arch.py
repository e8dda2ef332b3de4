"""The architecture of a model config: the inline `arch` block, or the numbers in a HF checkpoint's config.json.

Only config.json is read (no weights, no transformers import), so validation stays fast and works on a login
node that cannot see the weights' storage format.
"""

from __future__ import annotations

import json
import os

from megarl.config.errors import ConfigError
from megarl.config.schema import SUPPORTED_ARCHITECTURES, ArchConfig, ModelConfig


def arch_from_hf_config(hf: dict, where: str) -> ArchConfig:
    """ArchConfig from the contents of a HF config.json (`where` names the file in errors)."""
    architectures = hf.get("architectures") or []
    architecture = architectures[0] if architectures else None
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"{where}: architecture {architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    try:
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        return ArchConfig(
            architecture=architecture,
            num_layers=int(hf["num_hidden_layers"]),
            hidden_size=hidden,
            num_attention_heads=heads,
            num_query_groups=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            ffn_hidden_size=int(hf["intermediate_size"]),
            vocab_size=int(hf["vocab_size"]),
            max_position_embeddings=int(hf["max_position_embeddings"]),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope_theta=float(hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        )
    except KeyError as e:
        raise ConfigError(f"{where}: missing field {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: malformed value ({e})") from None


def resolve_arch(model: ModelConfig, key: str = "model") -> ArchConfig:
    """The architecture of `model` (config key `key`, used in error messages)."""
    if (model.path is None) == (model.arch is None):
        raise ConfigError(
            f"{key}: set exactly one of '{key}.path' (a HF checkpoint directory) or '{key}.arch' "
            f"(an inline architecture); got {'both' if model.path else 'neither'}"
        )
    if model.arch is not None:
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
