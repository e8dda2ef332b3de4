"""PromptEncoder: chat_template modes ('none', {prompt} templates, the tokenizer's, Jinja), decoding, errors."""

from __future__ import annotations

import os
import re

import pytest

from megarl.data.tokenization import PromptEncoder

TOKENIZER = os.path.join(os.path.dirname(__file__), "..", "..", "data", "quickstart", "tokenizer")
JINJA = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}w9{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER)


def test_none_encodes_raw_text_and_decode_drops_eos():
    enc = PromptEncoder(TOKENIZER, "none")
    assert enc.encode("w5 w17 w3") == [5, 17, 3]
    assert enc.encode_batch(["w5", "w6 w7"]) == [[5], [6, 7]]
    assert enc.decode([5, 6, 2]) == "w5 w6" and enc.decode_batch([[2], [7]]) == ["", "w7"]
    assert enc.decode([5, 2], skip_special_tokens=False) == "w5 </s>"
    assert (enc.eos_token_id, enc.pad_token_id) == (2, 0)


def test_format_template_replaces_only_prompt(tok):
    enc = PromptEncoder(tok, "<s> w4 {prompt} w9")
    assert enc.render("w5 w6") == "<s> w4 w5 w6 w9"
    assert enc.encode("w5 w6") == [1, 4, 5, 6, 9]


def test_hf_mode_uses_the_tokenizers_template(tok):
    tok = type(tok).from_pretrained(TOKENIZER)
    tok.chat_template = JINJA
    for mode in (None, "hf"):
        enc = PromptEncoder(tok, mode)
        assert enc.render("w5") == "user w5 w9"  # a string prompt becomes one user message
        assert enc.encode([{"role": "user", "content": "w5 w6"}]) == [0, 5, 6, 9]  # 'user' is <unk> in this vocab


def test_jinja_template_string_overrides(tok):
    enc = PromptEncoder(tok, JINJA.replace("w9", "w10"))
    messages = [{"role": "system", "content": "w3"}, {"role": "user", "content": "w4"}]
    assert enc.render(messages) == "system w3 user w4 w10"


def test_errors(tok):
    with pytest.raises(
        ValueError, match=re.escape("chat_template='hf' uses the tokenizer's chat template, but tokenizer")
    ):
        PromptEncoder(tok, "hf")
    with pytest.raises(
        ValueError, match=re.escape("chat_template 'User: ' is not one of 'none', 'hf' (or null), a template")
    ):
        PromptEncoder(tok, "User: ")
    enc = PromptEncoder(tok, "none")
    with pytest.raises(ValueError, match=re.escape(
            "chat_template='none' formats string prompts, but this prompt is a chat message list")):
        enc.encode([{"role": "user", "content": "w5"}])
    with pytest.raises(ValueError, match=re.escape("prompt '' encodes to no tokens")):
        enc.encode("")
    with pytest.raises(ValueError, match=re.escape("cannot load the tokenizer from '/nonexistent/tok'")):
        PromptEncoder("/nonexistent/tok", "none")
