"""Tiny random HF checkpoints that vLLM and transformers both load: used by rollout tests and benchmarks.

No hub access is needed: the model is built from a `LlamaConfig` with random weights and the tokenizer is a
WordLevel tokenizer over a fixed vocabulary (built with the `tokenizers` library), both saved with
`save_pretrained` so `vllm.LLM(model=dir)` and `AutoModelForCausalLM.from_pretrained(dir)` read the same files.
"""

from __future__ import annotations

from typing import Any

from megarl.checkpoint.tiny import build_tiny_llama  # noqa: F401  (its home; re-exported for the tests)


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
