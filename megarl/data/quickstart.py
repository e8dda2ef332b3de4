"""The CPU quickstart task: a synthetic prompt set a tiny random Llama improves on within ~20 GRPO steps.

The task ("speak the prompt's vocabulary"). The vocabulary is the WordLevel one of
`megarl.checkpoint.tiny.build_tiny_llama`: ids 0 <unk> (also pad), 1 <s> (BOS), 2 </s> (EOS), then words "w3",
"w4", ... The *target words* are the first vocab_size // 8 words (w3 .. w66 for vocab 512). Each prompt is 4 to 8
target words drawn at random; its answer is the space-separated list of all target words. The reward
(`token_fraction`) is the fraction of the response's words that are target words, in [0, 1]: a random model
scores ~1/8 (its next-token distribution is near uniform), and a policy that only uses target words scores 1.

Why this task: a 2-layer random model cannot learn to read a prompt in 20 steps (conditional variants — "use
the class of words named in the prompt", "repeat the target word" — stayed at their chance level in a
transformers re-implementation of the quickstart's GRPO step), but a dense reward on a fixed eighth of the
vocabulary gives every GRPO group reward variance from the first step and is learnt quickly: in that
re-implementation (8 prompts x 4 samples, 32 new tokens, temperature 1, 2 AdamW steps per RL step) the mean
reward went 0.13 -> 0.40 over 20 steps at lr 1e-3 and 0.13 -> 0.99 at lr 3e-3 (no learning at 1e-4).

Files written to `out_dir` (deterministic for the arguments; regenerate with
``python -m megarl.data.quickstart data/quickstart``):
  train.jsonl, val.jsonl   {"prompt": "w17 w40 w5 w33", "answer": "w3 w4 ... w66"}
  tokenizer/               tokenizer.json + tokenizer_config.json (PreTrainedTokenizerFast; BOS <s>, EOS </s>,
                           pad <unk>); prompts are encoded with chat_template 'none' (no BOS is added).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile

from megarl.checkpoint.tiny import build_tiny_llama

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MIN_PROMPT_WORDS, MAX_PROMPT_WORDS = 4, 8


def target_words(vocab_size: int) -> list[str]:
    """The words the reward asks for: the first vocab_size // 8 words, "w3" onwards."""
    return [f"w{i}" for i in range(3, 3 + vocab_size // 8)]


def _records(rng: random.Random, n: int, targets: list[str]) -> list[dict[str, str]]:
    answer = " ".join(targets)
    out = []
    for _ in range(n):
        k = rng.randint(MIN_PROMPT_WORDS, MAX_PROMPT_WORDS)
        out.append({"prompt": " ".join(rng.choice(targets) for _ in range(k)), "answer": answer})
    return out


def _write_jsonl(path: str, records: list[dict[str, str]]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def build_quickstart(
    out_dir: str, vocab_size: int = 512, n_train: int = 256, n_val: int = 32, seed: int = 0
) -> dict[str, str]:
    """Write the quickstart dataset and tokenizer to `out_dir`; return their paths (keys train, val, tokenizer)."""
    if vocab_size < 3 + 8:
        raise ValueError(f"vocab_size must be >= 11 (3 special tokens + at least one target word), got {vocab_size}")
    if n_train < 1 or n_val < 1:
        raise ValueError(f"n_train and n_val must be >= 1, got {n_train}, {n_val}")
    os.makedirs(out_dir, exist_ok=True)
    targets = target_words(vocab_size)
    rng = random.Random(seed)
    paths = {"train": os.path.join(out_dir, "train.jsonl"), "val": os.path.join(out_dir, "val.jsonl"),
             "tokenizer": os.path.join(out_dir, "tokenizer")}
    _write_jsonl(paths["train"], _records(rng, n_train, targets))
    _write_jsonl(paths["val"], _records(rng, n_val, targets))

    # The tokenizer of the tiny test models (config.json, also written there, is not part of the dataset).
    os.makedirs(paths["tokenizer"], exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        build_tiny_llama(tmp, vocab_size=vocab_size, weights=False)
        for name in TOKENIZER_FILES:
            shutil.copyfile(os.path.join(tmp, name), os.path.join(paths["tokenizer"], name))
    return paths


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Write the CPU quickstart dataset (train/val jsonl + tokenizer).")
    p.add_argument("out_dir", nargs="?", default="data/quickstart")
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--n-train", type=int, default=256)
    p.add_argument("--n-val", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    for k, v in build_quickstart(a.out_dir, a.vocab_size, a.n_train, a.n_val, a.seed).items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
