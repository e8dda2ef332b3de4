"""The tool-use quickstart's task: two-digit multiplication, which a ~0.3M-parameter model cannot do alone but can
through the calculator tool (`megarl quickstart --task tools`, `megarl.trainer.tool_quickstart`).

Task. Every pair (a, b) with 10 <= a, b <= 99, shuffled with a fixed seed; the first `n_val` are held out. A record
is {"prompt": "37*48=", "answer": "1776"}. The reward (`exact_match`) is 1 when the final answer equals the product.

An episode (the `calculator` environment, `megarl.envs`; rendered by the ChatML template of
`megarl.data.chat_chars`):

    user       37*48=
    assistant  <tool_call>{"name": "calculator", "arguments": {"expression": "37*48"}}</tool_call>
    tool       1776
    assistant  1776

`megarl.trainer.tool_quickstart.demonstration` builds that conversation as a trajectory (the SFT warm-up's data).

    python -m megarl.data.tool_task OUT_DIR        # writes OUT_DIR/{train,val}.jsonl, OUT_DIR/init_model/
"""

from __future__ import annotations

import argparse
import json
import os
import random

from megarl.data.arithmetic import MODEL_VOCAB

LOW, HIGH = 10, 99
# 2 layers, hidden 128 as the addition quickstart, with positions for a whole episode (~170 tokens).
MODEL_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, max_position_embeddings=256)
# Embedding rows past the BPE tokenizer's vocabulary (tokenizer="bpe").
BPE_PADDED_ROWS = 16


def tool_call_text(expression: str) -> str:
    """The assistant turn that calls the calculator (Hermes format, what `megarl.envs.tool_calls` parses)."""
    return '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>' % expression


def problems(seed: int = 0) -> list[dict]:
    pairs = [(a, b) for a in range(LOW, HIGH + 1) for b in range(LOW, HIGH + 1)]
    random.Random(seed).shuffle(pairs)
    return [{"prompt": f"{a}*{b}=", "answer": str(a * b)} for a, b in pairs]


def build_init_model(out_dir: str, seed: int = 0, fill_vocab: bool = False, tokenizer: str = "chars") -> str:
    """A random HF Llama of `MODEL_SHAPE` with a chat tokenizer, in `out_dir`. tokenizer "chars": the character
    tokenizer (`megarl.data.chat_chars`) and MODEL_VOCAB embedding rows (`fill_vocab`: the tokenizer filled to them,
    `build_chat_char_tokenizer(fill_to=...)`); "bpe": the byte-level BPE one (`megarl.data.chat_bpe`) and its
    vocabulary plus BPE_PADDED_ROWS rows (ids a model can sample that the tokenizer cannot decode, as real models'
    padded embeddings have)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if tokenizer == "chars":
        from megarl.data.chat_chars import build_chat_char_tokenizer

        tok = build_chat_char_tokenizer(out_dir, fill_to=MODEL_VOCAB if fill_vocab else None)
        rows = MODEL_VOCAB
    elif tokenizer == "bpe":
        from megarl.data.chat_bpe import build_chat_bpe_tokenizer

        tok = build_chat_bpe_tokenizer(out_dir)
        rows = len(tok) + BPE_PADDED_ROWS
    else:
        raise ValueError(f"tokenizer must be 'chars' or 'bpe', got {tokenizer!r}")
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=rows, tie_word_embeddings=False, bos_token_id=None,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, rms_norm_eps=1e-5,
                         **MODEL_SHAPE)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def build_tool_task(out_dir: str, n_val: int = 200, seed: int = 0, fill_vocab: bool = False,
                    tokenizer: str = "chars") -> dict[str, str]:
    """Write train.jsonl, val.jsonl and init_model/ (`build_init_model`) under `out_dir`; return their paths."""
    os.makedirs(out_dir, exist_ok=True)
    records = problems(seed)
    paths = {"train": os.path.join(out_dir, "train.jsonl"), "val": os.path.join(out_dir, "val.jsonl")}
    for split, rows in (("val", records[:n_val]), ("train", records[n_val:])):
        with open(paths[split], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    paths["model"] = build_init_model(os.path.join(out_dir, "init_model"), seed, fill_vocab, tokenizer)
    return paths


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--n-val", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    print(build_tool_task(a.out_dir, a.n_val, a.seed))
