"""A byte-level BPE chat tokenizer, trained here with the `tokenizers` library: what real models' vocabularies do
(GPT-2 / Llama-3 / Qwen style), small enough for CPU tests and examples.

Unlike the character tokenizer (`megarl.data.chat_chars`), text has many encodings: "1776" may be one merged token
or "17" + "76" or four bytes, and `tokenizer(text)` returns only the canonical (greedy-merge) one. A model samples any
of them, so sampled ids often do not re-encode to themselves; multi-turn rollouts must keep them as sampled
(`megarl.envs.episode`), and tests of that need such a vocabulary.

Ids: 0 <|endoftext|> (pad), 1 <|im_start|>, 2 <|im_end|> (EOS: a turn ends with it), then the 256 byte tokens and the
merges learned from `corpus()` (the tool task's conversations rendered with the ChatML template plus plain English
sentences), `vocab_size` ids in all. The chat template is `megarl.data.chat_chars.CHAT_TEMPLATE` (ChatML, lists
tools, only appends).

    tok = build_chat_bpe_tokenizer("out/tokenizer", vocab_size=400)
"""

from __future__ import annotations

import random

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
DEFAULT_VOCAB_SIZE = 400

_SENTENCES = (
    "The calculator returns the product of two numbers.", "Call the tool when you cannot compute the answer.",
    "I will compute it with the calculator.", "The answer is the number the tool returned.",
    "Let me check the result once more.", "Multiply the first number by the second one.",
)


def corpus(n_problems: int = 2000, seed: int = 0) -> list[str]:
    """The training text: tool-task conversations (user question, tool call, tool result, answer) in ChatML, and
    English sentences, deterministic for a seed."""
    from megarl.data.tool_task import problems, tool_call_text

    rng = random.Random(seed)
    texts = []
    for p in problems(seed)[:n_problems]:
        expr = p["prompt"].rstrip("=")
        texts.append(f"<|im_start|>user\n{p['prompt']}<|im_end|>\n<|im_start|>assistant\n{tool_call_text(expr)}"
                     f"<|im_end|>\n<|im_start|>tool\n{p['answer']}<|im_end|>\n<|im_start|>assistant\n"
                     f"{p['answer']}<|im_end|>\n")
        texts.append(" ".join(rng.sample(_SENTENCES, 3)))
    return texts


def build_chat_bpe_tokenizer(out_dir: str | None = None, vocab_size: int = DEFAULT_VOCAB_SIZE):
    """Train the tokenizer (a `PreTrainedTokenizerFast`, loadable by AutoTokenizer and vLLM) with `vocab_size` ids
    (>= 259: the specials and the 256 bytes); saved to `out_dir` when given. Deterministic."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from megarl.data.chat_chars import CHAT_TEMPLATE

    if vocab_size < len(SPECIALS) + 256:
        raise ValueError(f"vocab_size={vocab_size}: a byte-level BPE needs at least {len(SPECIALS) + 256} ids "
                         "(3 special tokens and the 256 bytes)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[AddedToken(s, special=True)
                                                                         for s in SPECIALS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"], clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        fast.save_pretrained(out_dir)
    return fast
