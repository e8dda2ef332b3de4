"""Causal core attention through `torch.nn.functional.scaled_dot_product_attention`, for the local layer spec.

megatron-core 0.16.1's local spec (no Transformer Engine: the CPU path) puts `DotProductAttention` in the layer's
`core_attention` slot: GQA keys and values copied per head (`repeat_interleave`), a `baddbmm` into a global buffer,
a causal mask built and applied with `masked_fill`, a separate softmax, dropout, a `bmm`, a permute: each a kernel
and a saved activation, on [b, heads, s, s]. `SdpaCoreAttention` computes the same thing in one fused call (GQA
without the copies, `enable_gqa=True`; PyTorch's CPU flash kernel forward and backward). Measured on the 0.72M-param
Llama of `benchmarks/vs_trl.py` (32 rows x ~26 tokens a rank, fp32, one thread): see that benchmark's results page.

Where it applies (`sdpa_applies`): causal self-attention with no attention mask at call time (megarl's engine feeds
right-padded rows with `attention_mask=None`: the padded tail is invisible to real tokens), no context parallelism
(`megarl.models.context_parallel` has its own), vanilla softmax, no sliding window, no attention dropout, no
query-key layer scaling. Anything else keeps megatron-core's `DotProductAttention` (the spec is left as it is).

Same constructor and forward signature as `DotProductAttention`. In: query [s, b, heads/tp, d], key and value
[s, b, groups/tp, d] (d of the value may differ: MLA). Out: [s, b, heads/tp * d_v]. Softmax over float32 scores for
fp32 inputs; for bf16/fp16 inputs PyTorch's kernels accumulate in float32 (megatron's `attention_softmax_in_fp32`).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch


def _core_attention_base():
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


def sdpa_applies(config: Any) -> bool:
    """Whether `SdpaCoreAttention` computes what megatron-core's `DotProductAttention` would for `config` (a
    `TransformerConfig`): see the module docstring."""
    return (getattr(config, "context_parallel_size", 1) == 1
            and getattr(config, "softmax_type", "vanilla") == "vanilla"
            and getattr(config, "window_size", None) is None
            and not getattr(config, "attention_dropout", 0.0)
            and not getattr(config, "apply_query_key_layer_scaling", False))


class SdpaCoreAttention(_core_attention_base()):
    """Causal core attention in one `scaled_dot_product_attention` call (see the module docstring)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None) -> None:
        from megatron.core.transformer.enums import AttnMaskType

        super().__init__(config=config)
        if not sdpa_applies(config):
            raise ValueError("SdpaCoreAttention: this config needs megatron-core's DotProductAttention (context "
                             "parallelism, a sliding window, attention dropout, another softmax or query-key layer "
                             "scaling); use megarl.models.sdpa_attention.use_sdpa_attention only where "
                             "sdpa_applies(config)")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"SdpaCoreAttention runs without attention dropout, got {dropout}")
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SdpaCoreAttention is causal self-attention only, got {attn_mask_type}")
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        self.tp_group = pg_collection.tp  # MegatronModule.sharded_state_dict reads it
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("packed sequences / attention bias need Transformer Engine's attention")
        if attention_mask is not None:
            raise NotImplementedError("SdpaCoreAttention is causal with no attention mask (megarl's engine passes "
                                      "None: rows are right-padded)")
        s, b = query.shape[0], query.shape[1]
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        context = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=s > 1, scale=self.softmax_scale, enable_gqa=self.heads != self.groups)
        return context.permute(2, 0, 1, 3).reshape(s, b, self.heads * value.shape[-1])


def use_sdpa_attention(layer_spec) -> None:
    """Put `SdpaCoreAttention` into the core-attention slot of a local layer spec (a `ModuleSpec`) or of every layer
    of a decoder block spec (`layer_specs`) whose slot holds megatron-core's `DotProductAttention`."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    layers = getattr(layer_spec, "layer_specs", None) or [layer_spec]
    for layer in layers:
        attn = getattr(layer.submodules, "self_attention", None)
        sub = getattr(attn, "submodules", None)
        if sub is not None and getattr(sub, "core_attention", None) is DotProductAttention:
            sub.core_attention = SdpaCoreAttention
