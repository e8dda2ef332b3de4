"""The directory the vLLM engine is built from: a model config and tokenizer files, no weights needed.

The engine starts with random ("dummy") weights and receives the actor's through the reshard, so it only needs the
architecture and the tokenizer: `model.path` itself when it holds both, otherwise a small directory written under
the run directory with `config.json` (from `model.path` or the inline `model.arch`) and the files of
`model.tokenizer`.
"""

from __future__ import annotations

import json
import os
import shutil

from megarl.config.arch import spec_from_arch
from megarl.config.schema import ArchConfig, JobConfig
from megarl.models.spec import MODEL_TYPES, moe_hf_config_fields

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json")


def hf_config_for_arch(arch: ArchConfig, tokenizer_dir: str | None = None) -> dict:
    """A transformers `config.json` dict for an inline architecture (BOS/EOS/pad ids from the tokenizer)."""
    from transformers import AutoConfig

    special = {}
    if tokenizer_dir:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        special = {k: v for k, v in (("bos_token_id", tok.bos_token_id), ("eos_token_id", tok.eos_token_id),
                                      ("pad_token_id", tok.pad_token_id)) if v is not None}
    fields = dict(
        vocab_size=arch.vocab_size, hidden_size=arch.hidden_size,
        intermediate_size=arch.ffn_hidden_size, num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_attention_heads, num_key_value_heads=arch.num_query_groups,
        head_dim=arch.head_dim, max_position_embeddings=arch.max_position_embeddings, rms_norm_eps=arch.norm_eps,
        rope_theta=arch.rope_theta, tie_word_embeddings=arch.tie_word_embeddings, **special,
    )
    fields.update(moe_hf_config_fields(spec_from_arch(arch)))  # Mixtral: intermediate_size is the expert width
    cfg = AutoConfig.for_model(MODEL_TYPES[arch.architecture], **fields)
    out = cfg.to_dict()
    out["architectures"] = [arch.architecture]
    return out


def engine_model_dir(cfg: JobConfig, run_dir: str) -> str:
    """Path of a directory vLLM can build the engine from (see module docstring)."""
    model = cfg.model
    tokenizer_dir = model.tokenizer or model.path
    if tokenizer_dir is None:
        raise ValueError(
            "model.tokenizer: the rollout engine needs a tokenizer; set model.tokenizer to a HF tokenizer directory "
            "(model.path has none: an inline model.arch is used)"
        )
    if model.path is not None and (model.tokenizer in (None, model.path)):
        return model.path
    out = os.path.join(run_dir, "engine_model")
    os.makedirs(out, exist_ok=True)
    if model.path is not None:
        shutil.copy(os.path.join(model.path, "config.json"), os.path.join(out, "config.json"))
    else:
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(hf_config_for_arch(model.arch, tokenizer_dir), f, indent=2)
    copied = 0
    for name in TOKENIZER_FILES:
        src = os.path.join(tokenizer_dir, name)
        if os.path.isfile(src):
            shutil.copy(src, os.path.join(out, name))
            copied += 1
    if not copied:
        raise FileNotFoundError(
            f"model.tokenizer={tokenizer_dir!r} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:4])}, ...)"
        )
    return out
