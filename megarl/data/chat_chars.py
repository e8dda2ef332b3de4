"""A character-level chat tokenizer with a ChatML template that lists tools: small models can hold multi-turn,
tool-using conversations on CPU (tests, the tool-use example).

Ids: 0 <unk> (also pad), 1 <|im_start|>, 2 <|im_end|> (EOS: a turn ends with it), 3 "\\n", then the printable ASCII
characters 32..126. Every character is one token, so text re-encodes to the same ids (the delta rule of
`megarl.envs.episode` holds exactly for any sampled turn without special tokens inside).

The template (`CHAT_TEMPLATE`), prefix-stable by construction (it only appends):

    [<|im_start|>system\\nTools: <name>, <name><|im_end|>\\n]          when tools are given
    <|im_start|>{role}\\n{content}<|im_end|>\\n                        per message (a tool result: role "tool")
    <|im_start|>assistant\\n                                          add_generation_prompt
"""

from __future__ import annotations

SPECIALS = ("<unk>", "<|im_start|>", "<|im_end|>")
CHARS = ("\n",) + tuple(chr(c) for c in range(32, 127))
VOCAB = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}

CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: "
    "{%- for t in tools %} {{ t['function']['name'] }}{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_chat_char_tokenizer(out_dir: str | None = None, fill_to: int | None = None):
    """The tokenizer (a `PreTrainedTokenizerFast`, loadable by AutoTokenizer and vLLM), saved to `out_dir` when
    given. `fill_to`: add filler characters (U+0100 onwards, one per id) until the vocabulary has this many ids, so
    that every id a model of that many embedding rows can sample decodes to a character that re-encodes to it (a
    random model then never breaks the delta rule with an id the tokenizer does not know)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = dict(VOCAB)
    for k in range(max(0, (fill_to or 0) - len(vocab))):
        vocab[chr(0x100 + k)] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                   pad_token="<unk>", additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        fast.save_pretrained(out_dir)
    return fast
