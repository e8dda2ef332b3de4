"""`ModelSpec`: the architecture of a decoder-only LM, independent of any framework.

Built from a HuggingFace `config.json` (`ModelSpec.from_hf_config`) or written inline (tiny random models).
The Megatron provider (`megarl.models.gpt`), the checkpoint converters and the reshard layouts all read it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any, Iterator, Optional


@dataclasses.dataclass(frozen=True)
class ArchTraits:
    """What megarl knows about one supported HF architecture (a row of `ARCHITECTURES`).

    Attributes:
        model_type: HF `model_type` (config.json, `AutoConfig.for_model`).
        qkv_bias: bias on the q/k/v projections by default (Qwen2); a config.json `attention_bias` overrides it.
        qk_layernorm: RMSNorm on q and k per head (Qwen3).
        attention_bias_key: the HF config class takes `attention_bias` (written into a generated config.json).
        moe: mixture-of-experts MLPs (the `ModelSpec.num_experts` family of fields applies).
        moe_always_norm_topk: the router always renormalises the top-k probabilities (Mixtral); otherwise the
            config's `norm_topk_prob` decides (Qwen2-MoE, Qwen3-MoE).
        shared_expert: a shared expert with a sigmoid gate beside the routed ones (Qwen2-MoE).
    """

    model_type: str
    qkv_bias: bool = False
    qk_layernorm: bool = False
    attention_bias_key: bool = False
    moe: bool = False
    moe_always_norm_topk: bool = False
    shared_expert: bool = False


# The one table of supported architectures: HF class name -> `ArchTraits`. The config schema, the memory estimate,
# the role factory, the checkpoint name maps, the engine model directory and the HF config writer all read it.
ARCHITECTURES: Mapping[str, ArchTraits] = {
    "LlamaForCausalLM": ArchTraits("llama", attention_bias_key=True),
    "Qwen2ForCausalLM": ArchTraits("qwen2", qkv_bias=True),
    "Qwen3ForCausalLM": ArchTraits("qwen3", qk_layernorm=True, attention_bias_key=True),
    "MistralForCausalLM": ArchTraits("mistral"),
    "MixtralForCausalLM": ArchTraits("mixtral", moe=True, moe_always_norm_topk=True),
    "Qwen2MoeForCausalLM": ArchTraits("qwen2_moe", qkv_bias=True, moe=True, shared_expert=True),
    "Qwen3MoeForCausalLM": ArchTraits("qwen3_moe", qk_layernorm=True, attention_bias_key=True, moe=True),
}
MODEL_TYPES = {name: a.model_type for name, a in ARCHITECTURES.items()}  # HF class name -> HF `model_type`
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


# RoPE scaling types the Megatron provider reproduces exactly (`megarl.models.gpt.rope_inv_freq`): "llama3"
# (Llama-3.1/3.2) and "linear" (position interpolation: every frequency divided by `factor`). Others that
# transformers knows ("dynamic" NTK changes the frequencies with the sequence length; "yarn", "longrope" also scale
# the attention logits) are refused when the spec is built, i.e. when the config is validated.
SUPPORTED_ROPE_SCALING = ("llama3", "linear")


class UnsupportedModelError(ValueError):
    """The architecture or one of its options is not supported; the message says which and lists what is."""


class RopeScaling(Mapping):
    """A read-only, hashable view of a HF `rope_scaling` dict (`spec.rope_scaling["factor"]`, `dict(...)`).

    `ModelSpec` is frozen and hashed (the reshard planner caches plans per spec): a plain dict field made every
    spec with rope scaling unhashable. Values are kept as given (JSON scalars; lists become tuples).
    """

    __slots__ = ("_items",)

    def __init__(self, values: Mapping) -> None:
        self._items = tuple(sorted((str(k), tuple(v) if isinstance(v, list) else v) for k, v in values.items()))

    def __getitem__(self, key: str) -> Any:
        for k, v in self._items:
            if k == key:
                return v
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __repr__(self) -> str:
        return repr(dict(self._items))

    @property
    def rope_type(self) -> Optional[str]:
        """HF's `rope_type` (older configs call it `type`)."""
        return self.get("rope_type", self.get("type"))

    def to_dict(self) -> dict:
        """A plain dict (lists back as lists), e.g. for writing a config.json."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self._items}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Shape and quirks of one decoder-only transformer.

    Attributes:
        architecture: HF class name, one of `SUPPORTED_ARCHITECTURES`.
        num_layers: transformer blocks.
        hidden_size: model width.
        num_attention_heads: query heads.
        num_query_groups: key/value heads (GQA); equal to heads for MHA.
        head_dim: per-head width; may differ from hidden_size / heads (Qwen3).
        ffn_hidden_size: SwiGLU intermediate width (gate and up each have this many rows).
        vocab_size: rows of the embedding in the HF checkpoint (before Megatron's TP padding).
        max_position_embeddings: longest sequence the position encoding supports.
        rope_theta: RoPE base.
        rope_scaling: HF `rope_scaling` as a hashable `RopeScaling` mapping (a dict passed in is converted), with
            `rope_type` one of `SUPPORTED_ROPE_SCALING`; None for plain RoPE.
        norm_eps: RMSNorm epsilon.
        qkv_bias: bias on q/k/v projections (default per architecture: `ARCHITECTURES`; Qwen2).
        qk_layernorm: RMSNorm on q and k per head (per architecture: `ARCHITECTURES`; Qwen3).
        tie_word_embeddings: output layer shares the input embedding.
        num_experts: routed experts per MoE layer; 0 for dense models (every field below is then unused).
        moe_topk: experts each token is routed to (HF `num_experts_per_tok`).
        moe_ffn_hidden_size: SwiGLU width of one routed expert (HF `moe_intermediate_size`; Mixtral:
            `intermediate_size`).
        moe_norm_topk_prob: the top-k router probabilities are renormalised to sum to 1 (Mixtral always; Qwen-MoE
            `norm_topk_prob`). True is "top-k of the logits, then softmax over the k" (megatron-core's default);
            False is "softmax over all experts, then top-k" (`moe_router_pre_softmax`).
        moe_layers: per layer, True where the MLP is a MoE block (HF `decoder_sparse_step`, `mlp_only_layers`);
            dense layers use `ffn_hidden_size`. Empty for dense models.
        shared_expert_ffn_hidden_size: width of the shared expert (Qwen2-MoE `shared_expert_intermediate_size`),
            0 when there is none. Its output is scaled by sigmoid(`shared_expert_gate` . x).
        router_aux_loss_coef: the checkpoint's load-balancing loss coefficient (HF `router_aux_loss_coef`),
            informational: the actor's loss uses `actor.moe.aux_loss_coeff`.
    """

    architecture: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    norm_eps: float = 1e-6
    qkv_bias: bool = False
    qk_layernorm: bool = False
    tie_word_embeddings: bool = False
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] = ()
    shared_expert_ffn_hidden_size: int = 0
    router_aux_loss_coef: float = 0.0

    @property
    def is_moe(self) -> bool:
        """Any layer has a mixture-of-experts MLP."""
        return self.num_experts > 0 and any(self.moe_layers)

    def is_moe_layer(self, layer: int) -> bool:
        """Layer `layer` (0-based, global) has a MoE MLP."""
        return self.num_experts > 0 and bool(self.moe_layers) and self.moe_layers[layer]

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_query_groups != 0:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_query_groups={self.num_query_groups}"
            )
        if self.rope_scaling is not None:
            if not isinstance(self.rope_scaling, Mapping):
                raise UnsupportedModelError(
                    f"rope_scaling must be a mapping like {{'rope_type': 'llama3', 'factor': 8.0}}, "
                    f"got {self.rope_scaling!r}"
                )
            rope = self.rope_scaling if isinstance(self.rope_scaling, RopeScaling) else RopeScaling(self.rope_scaling)
            kind = rope.rope_type
            if kind in ("default", None):
                rope = None
            elif kind not in SUPPORTED_ROPE_SCALING:
                raise UnsupportedModelError(
                    f"unsupported rope_scaling type {kind!r} (config.json rope_scaling / rope_parameters); "
                    f"supported: {', '.join(SUPPORTED_ROPE_SCALING)} (or none). megarl reproduces only these exactly "
                    "in Megatron; convert the checkpoint or train without rope scaling"
                )
            elif "factor" not in rope:
                raise UnsupportedModelError(f"rope_scaling type {kind!r} needs a 'factor'; got {dict(rope)}")
            object.__setattr__(self, "rope_scaling", rope)
        traits = ARCHITECTURES[self.architecture]
        if traits.moe:
            if self.num_experts < 1 or not 1 <= self.moe_topk <= self.num_experts or self.moe_ffn_hidden_size < 1:
                raise UnsupportedModelError(
                    f"{self.architecture} is a mixture-of-experts model: it needs num_experts >= 1 (got "
                    f"{self.num_experts}), 1 <= moe_topk <= num_experts (got {self.moe_topk}) and "
                    f"moe_ffn_hidden_size >= 1 (got {self.moe_ffn_hidden_size})"
                )
            layers = tuple(bool(x) for x in self.moe_layers) if self.moe_layers else (True,) * self.num_layers
            if len(layers) != self.num_layers:
                raise UnsupportedModelError(
                    f"moe_layers has {len(layers)} entries for num_layers={self.num_layers}: one per layer"
                )
            object.__setattr__(self, "moe_layers", layers)
            if traits.moe_always_norm_topk and not self.moe_norm_topk_prob:
                raise UnsupportedModelError(f"{self.architecture} always renormalises the top-k router probabilities")
            if self.shared_expert_ffn_hidden_size and not traits.shared_expert:
                raise UnsupportedModelError(f"{self.architecture} has no shared expert")
        elif self.num_experts or self.moe_layers or self.shared_expert_ffn_hidden_size:
            raise UnsupportedModelError(
                f"{self.architecture} is a dense architecture: num_experts, moe_layers and "
                "shared_expert_ffn_hidden_size must be left unset"
            )

    @property
    def num_params(self) -> int:
        """Parameter count of the HF model (embedding counted once when tied)."""
        h, f, v, L = self.hidden_size, self.ffn_hidden_size, self.vocab_size, self.num_layers
        q = self.num_attention_heads * self.head_dim
        kv = self.num_query_groups * self.head_dim
        attn = (
            h * (q + 2 * kv) + q * h + (q + 2 * kv if self.qkv_bias else 0)
            + (2 * self.head_dim if self.qk_layernorm else 0)
        )
        per_layer = attn + 2 * h
        total = 0
        for layer in range(L):
            if self.is_moe_layer(layer):
                shared = self.shared_expert_ffn_hidden_size
                mlp = self.num_experts * (3 * h * self.moe_ffn_hidden_size + h) + (3 * h * shared + h if shared else 0)
            else:
                mlp = 3 * h * f
            total += per_layer + mlp
        return total + v * h * (1 if self.tie_word_embeddings else 2) + h

    @property
    def num_active_params(self) -> int:
        """Parameters a token passes through (routed experts: only `moe_topk` of them); `num_params` when dense."""
        if not self.is_moe:
            return self.num_params
        per_expert = 3 * self.hidden_size * self.moe_ffn_hidden_size
        inactive = (self.num_experts - self.moe_topk) * per_expert * sum(self.moe_layers)
        return self.num_params - inactive

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelSpec":
        """Build from a parsed HF `config.json`. Raises `UnsupportedModelError` naming the problem."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else cfg.get("architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            head_dim = cfg.get("head_dim") or hidden // heads
            text = dict(
                architecture=arch,
                num_layers=int(cfg["num_hidden_layers"]),
                hidden_size=hidden,
                num_attention_heads=heads,
                num_query_groups=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                ffn_hidden_size=int(cfg["intermediate_size"]),
                vocab_size=int(cfg["vocab_size"]),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            )
        except KeyError as e:
            raise UnsupportedModelError(f"config.json is missing required key {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise UnsupportedModelError(f"config.json has a malformed value ({e})") from None
        rope_theta = cfg.get("rope_theta")
        rope_params = cfg.get("rope_parameters") or {}
        if rope_theta is None:
            rope_theta = rope_params.get("rope_theta", 10000.0)
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling is None and rope_params.get("rope_type") not in (None, "default"):
            rope_scaling = dict(rope_params)
        if isinstance(rope_scaling, dict) and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        traits = ARCHITECTURES[arch]
        if traits.moe:
            text.update(_moe_fields(cfg, traits, text["num_layers"], text["ffn_hidden_size"]))
        return cls(
            **text,
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            qkv_bias=bool(cfg.get("attention_bias", traits.qkv_bias)),
            qk_layernorm=traits.qk_layernorm,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )

    @classmethod
    def from_hf_dir(cls, path: str) -> "ModelSpec":
        """Read `path/config.json` only (no weights)."""
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"{cfg_path} not found: model.path must be a HuggingFace model directory")
        try:
            with open(cfg_path) as f:
                cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise UnsupportedModelError(f"{cfg_path} is not valid JSON (line {e.lineno}): {e.msg}") from None
        return cls.from_hf_config(cfg)


def _moe_fields(cfg: dict[str, Any], traits: ArchTraits, num_layers: int, intermediate_size: int) -> dict[str, Any]:
    """The `ModelSpec` MoE fields from a HF MoE config.json (Mixtral, Qwen2-MoE, Qwen3-MoE key names)."""
    try:
        num_experts = int(cfg.get("num_experts") or cfg["num_local_experts"])
        topk = int(cfg["num_experts_per_tok"])
    except KeyError as e:
        raise UnsupportedModelError(f"MoE config.json is missing required key {e.args[0]!r}") from None
    # Mixtral's experts use intermediate_size; the Qwen MoE families give the expert width separately.
    moe_ffn = int(cfg.get("moe_intermediate_size") or intermediate_size)
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense_only = set(cfg.get("mlp_only_layers") or ())
    layers = tuple(layer not in dense_only and (layer + 1) % step == 0 for layer in range(num_layers))
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if traits.shared_expert else 0
    return dict(
        num_experts=num_experts,
        moe_topk=topk,
        moe_ffn_hidden_size=moe_ffn,
        moe_norm_topk_prob=True if traits.moe_always_norm_topk else bool(cfg.get("norm_topk_prob", False)),
        moe_layers=layers,
        shared_expert_ffn_hidden_size=shared,
        router_aux_loss_coef=float(cfg.get("router_aux_loss_coef") or 0.0),
    )


def moe_hf_config_fields(spec: ModelSpec) -> dict[str, Any]:
    """The HF config.json keys of `spec`'s MoE fields, in its family's spelling (inverse of `_moe_fields`).

    Mixtral: `num_local_experts`, the expert width as `intermediate_size`, every layer MoE. Qwen2-/Qwen3-MoE:
    `num_experts`, `moe_intermediate_size`, `norm_topk_prob`, dense layers as `mlp_only_layers` with
    `decoder_sparse_step` 1; Qwen2-MoE adds `shared_expert_intermediate_size`. {} for a dense spec.
    """
    traits = ARCHITECTURES[spec.architecture]
    if not traits.moe:
        return {}
    out: dict[str, Any] = {"num_experts_per_tok": spec.moe_topk, "router_aux_loss_coef": spec.router_aux_loss_coef}
    if spec.architecture == "MixtralForCausalLM":
        if not all(spec.moe_layers):
            raise UnsupportedModelError("MixtralForCausalLM has a MoE MLP in every layer (moe_layers all true)")
        out.update(num_local_experts=spec.num_experts, intermediate_size=spec.moe_ffn_hidden_size)
        return out
    out.update(
        num_experts=spec.num_experts, moe_intermediate_size=spec.moe_ffn_hidden_size,
        norm_topk_prob=spec.moe_norm_topk_prob, decoder_sparse_step=1,
        mlp_only_layers=[i for i, moe in enumerate(spec.moe_layers) if not moe],
    )
    if traits.shared_expert:
        out["shared_expert_intermediate_size"] = spec.shared_expert_ffn_hidden_size
    return out
