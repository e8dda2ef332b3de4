"""Tool-call parsers: the Hermes/Qwen parser reads back exactly the calls the Qwen2.5 chat template renders, and
turns malformed calls into error messages (never exceptions)."""

from __future__ import annotations

import pytest

from megarl.envs.base import ToolCall
from megarl.envs.tool_calls import get_parser, list_parsers, parse_hermes, register_parser
from tests.unit._qwen_template import qwen_tokenizer


def _assistant_text(rendered: str) -> str:
    """The last assistant message's body in a ChatML rendering (what the model would have sampled)."""
    body = rendered.rsplit("<|im_start|>assistant", 1)[1]
    return body.split("<|im_end|>", 1)[0]


CALLS = [
    {"name": "calculator", "arguments": {"expression": "2 * (3 + 4) / 7"}},
    {"name": "search", "arguments": {"query": "the \"Eiffel\" tower </tool_call> height", "k": 3,
                                     "filters": {"lang": ["en", "fr"], "year": None}, "exact": False}},
    {"name": "no_args", "arguments": {}},
    {"name": "unicode", "arguments": {"text": "naïve café — 東京\nsecond line"}},
]


@pytest.mark.parametrize("content", ["", "Let me compute that first."])
def test_reads_back_the_calls_the_qwen_template_renders(content):
    tok = qwen_tokenizer()
    messages = [{"role": "user", "content": "What is 2 * (3 + 4) / 7?"},
                {"role": "assistant", "content": content,
                 "tool_calls": [{"type": "function", "function": c} for c in CALLS]}]
    text = _assistant_text(tok.apply_chat_template(messages, tokenize=False))
    assert text.count("<tool_call>") == len(CALLS)  # the template rendered them all
    calls, errors = parse_hermes(text)
    assert errors == []
    assert [(c.name, c.arguments) for c in calls] == [(c["name"], c["arguments"]) for c in CALLS]
    assert [c.id for c in calls] == ["call_0", "call_1", "call_2", "call_3"]


def test_arguments_rendered_as_a_json_string_are_read_as_the_object():
    # OpenAI-style messages carry arguments as a JSON string; the template's `tojson` writes it as a string,
    # the form Qwen models sometimes emit themselves
    tok = qwen_tokenizer()
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": "",
                 "tool_calls": [{"type": "function",
                                 "function": {"name": "calculator", "arguments": '{"expression": "1 + 1"}'}}]}]
    text = _assistant_text(tok.apply_chat_template(messages, tokenize=False))
    assert '"arguments": "{\\"expression\\": \\"1 + 1\\"}"' in text
    assert parse_hermes(text) == ([ToolCall("calculator", {"expression": "1 + 1"}, "call_0")], [])


def test_model_output_with_text_around_and_several_calls():
    text = ("I'll look both up.\n<tool_call>\n{\"name\": \"search\", \"arguments\": {\"query\": \"Paris\"}}\n"
            "</tool_call>\nand\n<tool_call>{\"name\":\"open\",\"arguments\":{\"doc_id\":\"7\"}}</tool_call>"
            " then answer.<|im_end|>")
    calls, errors = parse_hermes(text)
    assert errors == []
    assert calls == [ToolCall("search", {"query": "Paris"}, "call_0"), ToolCall("open", {"doc_id": "7"}, "call_1")]


def test_plain_answer_has_no_calls():
    assert parse_hermes("The answer is 42. </tool_call> stray closer ignored") == ([], [])


@pytest.mark.parametrize("body, expected", [
    ('{"name": "f", "arguments": {"x": 1,}}', "tool call 1: invalid JSON"),
    ('{"arguments": {"x": 1}}', 'tool call 1: missing "name"'),
    ('{"name": "", "arguments": {}}', 'tool call 1: missing "name"'),
    ('["f", {"x": 1}]', "expected a JSON object"),
    ('{"name": "f", "arguments": [1, 2]}', '"arguments" must be a JSON object, got list'),
    ('{"name": "f", "arguments": "{not json"}', '"arguments" is a string that is not JSON'),
    ('{"name": "f", "arguments": "[1]"}', '"arguments" must be a JSON object, got list'),
    ('{"name": "f", "arguments": {}}}', "unexpected text after the JSON object"),
    ("", "invalid JSON"),
])
def test_malformed_call_is_an_error_message(body, expected):
    calls, errors = parse_hermes(f"thinking...\n<tool_call>\n{body}\n</tool_call>")
    assert calls == []
    assert len(errors) == 1 and expected in errors[0], errors


def test_unterminated_call_is_an_error_and_the_next_call_still_parses():
    text = ('<tool_call>\n{"name": "f", "arguments": {"x": 1\n'
            '<tool_call>\n{"name": "g", "arguments": {"y": 2}}\n</tool_call>\n'
            '<tool_call>\n{"name": "h", "arguments": {}')  # cut off by the length limit
    calls, errors = parse_hermes(text)
    assert calls == [ToolCall("g", {"y": 2}, "call_1")]  # ids number the blocks, failed ones included
    assert len(errors) == 2
    assert errors[0].startswith("tool call 1: unterminated <tool_call>") and '"name": "f"' in errors[0]
    assert errors[1].startswith("tool call 3: unterminated <tool_call>")


def test_missing_arguments_is_empty_and_parameters_is_accepted():
    text = '<tool_call>{"name": "now"}</tool_call><tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>'
    assert parse_hermes(text) == ([ToolCall("now", {}, "call_0"), ToolCall("f", {"a": 1}, "call_1")], [])


def test_long_bodies_are_cut_in_error_messages():
    calls, errors = parse_hermes("<tool_call>{" + "x" * 5000 + "</tool_call>")
    assert calls == [] and len(errors[0]) < 400


def test_registry():
    assert get_parser("hermes") is parse_hermes and get_parser("qwen") is parse_hermes
    assert {"hermes", "qwen"} <= set(list_parsers())
    with pytest.raises(KeyError, match="unknown tool-call parser 'hermse'.*did you mean 'hermes'"):
        get_parser("hermse")
    with pytest.raises(ValueError, match="already registered"):
        register_parser("hermes")(lambda text: ([], []))
