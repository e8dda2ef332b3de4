"""Tiny random HF checkpoints that vLLM and transformers both load: used by rollout tests and benchmarks.

No hub access is needed: the model is built from a `LlamaConfig` with random weights and the tokenizer is a
WordLevel tokenizer over a fixed vocabulary (built with the `tokenizers` library), both saved with
`save_pretrained` so `vllm.LLM(model=dir)` and `AutoModelForCausalLM.from_pretrained(dir)` read the same files.
"""

from __future__ import annotations

import os
from typing import Any


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
    by vLLM itself, e.g. for benchmarks of large shapes). Token ids: 0 <unk>, 1 <s> (BOS), 2 </s> (EOS), 3.. words "w3", "w4", ...
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


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations from transformers (fp32, no EOS stop), one prompt at a time."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, attention_mask=torch.ones_like(ids))
            out.append(gen[0, len(p):].tolist())
    return out


def hf_token_log_probs(path_or_model: Any, prompt: list[int], response: list[int]) -> list[float]:
    """log softmax(logits) of each response token given the prompt and earlier response tokens (fp32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = path_or_model
    if isinstance(path_or_model, str):
        model = AutoModelForCausalLM.from_pretrained(path_or_model, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    return lp[pos, torch.tensor(response)].tolist()
