"""Tool-call parsers: a model turn's decoded text -> the `ToolCall`s it makes, plus one error message per malformed
call (shown to the model as an observation; a parser never raises on model output).

A parser is `fn(text) -> (tool_calls, errors)`, registered by name (`register_parser`) and looked up by the
rollout's config (`get_parser`). The ids it gives are `call_<i>`, `i` counting the turn's calls in order.

hermes (alias qwen)  the format of Hermes-style chat templates (Qwen2.5, Qwen3, NousHermes):
                     `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, any number per turn, text
                     around them. `arguments` may also be a JSON *string* holding the object (Qwen models
                     sometimes write it so); a missing `arguments` is `{}`; `parameters` is read as `arguments`.
"""

from __future__ import annotations

import json
from typing import Callable

from megarl.envs.base import ToolCall
from megarl.registry import Registry

ParseResult = tuple[list[ToolCall], list[str]]
ToolCallParser = Callable[[str], ParseResult]

PARSERS: Registry[ToolCallParser] = Registry("tool-call parser")
_SNIPPET_CHARS = 200


def register_parser(name: str, *, override: bool = False) -> Callable[[ToolCallParser], ToolCallParser]:
    """Decorator: register `fn(text) -> (tool_calls, errors)` under `name`. A taken name is an error unless
    `override=True` (one function may be registered under several names)."""
    return PARSERS.register(name, override=override)


def get_parser(name: str) -> ToolCallParser:
    """The parser registered as `name`; a KeyError lists the registered names and suggests the closest one."""
    return PARSERS.get(name)


def list_parsers() -> list[str]:
    return PARSERS.names()


def _snippet(text: str) -> str:
    text = text.strip()
    return text if len(text) <= _SNIPPET_CHARS else text[:_SNIPPET_CHARS] + "..."


HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"


_DECODER = json.JSONDecoder()


def _hermes_object(obj: object, body: str, number: int) -> tuple[ToolCall | None, str | None]:
    """A decoded `<tool_call>` body -> (call, None) or (None, error). `number` is 1-based, for the message."""
    where = f"tool call {number}"
    if not isinstance(obj, dict):
        return None, f"{where}: expected a JSON object with \"name\" and \"arguments\", got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None, f"{where}: missing \"name\" (a non-empty string): {_snippet(body)}"
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            return None, f"{where} ({name}): \"arguments\" is a string that is not JSON ({e.msg}): " \
                         f"{_snippet(arguments)}"
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return None, f"{where} ({name}): \"arguments\" must be a JSON object, got {type(arguments).__name__}"
    return ToolCall(name=name.strip(), arguments=arguments, id=f"call_{number - 1}"), None


def _hermes_block(text: str, body_start: int, number: int) -> tuple[ToolCall | None, str | None, int]:
    """The block whose body starts at `body_start` -> (call, error, where to scan on)."""
    # a JSON value followed by the closing tag: decoding first lets a string argument contain "</tool_call>"
    i = len(text) - len(text[body_start:].lstrip())
    try:
        obj, end = _DECODER.raw_decode(text, i)
    except json.JSONDecodeError:
        end = -1
    if end >= 0:
        after = len(text) - len(text[end:].lstrip())
        if text.startswith(HERMES_CLOSE, after):
            call, error = _hermes_object(obj, text[i:end], number)
            return call, error, after + len(HERMES_CLOSE)
    # otherwise the block is what lies between the tags, and the error says what is wrong with it
    close = text.find(HERMES_CLOSE, body_start)
    next_open = text.find(HERMES_OPEN, body_start)
    if close < 0 or 0 <= next_open < close:
        stop = next_open if next_open >= 0 else len(text)
        return None, (f"tool call {number}: unterminated {HERMES_OPEN} (no {HERMES_CLOSE}): "
                      f"{_snippet(text[body_start:stop])}"), stop
    body = text[body_start:close].strip()
    where = f"tool call {number}"
    try:
        obj, end = _DECODER.raw_decode(body)
    except json.JSONDecodeError as e:
        return None, f"{where}: invalid JSON ({e.msg} at char {e.pos}): {_snippet(body)}", close + len(HERMES_CLOSE)
    if body[end:].strip():
        return None, f"{where}: unexpected text after the JSON object: {_snippet(body[end:])}", \
            close + len(HERMES_CLOSE)
    call, error = _hermes_object(obj, body, number)
    return call, error, close + len(HERMES_CLOSE)


@register_parser("hermes")
def parse_hermes(text: str) -> ParseResult:
    """`<tool_call>{json}</tool_call>` blocks in `text`, in order. An opening tag with no closing tag before the
    next opening tag (or the end of the text) is an 'unterminated' error; a stray closing tag is ignored. The
    ids are `call_<i>` for the i-th block (0-based, malformed blocks counted)."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    pos = 0
    number = 0
    while (start := text.find(HERMES_OPEN, pos)) >= 0:
        number += 1
        call, error, pos = _hermes_block(text, start + len(HERMES_OPEN), number)
        if call is not None:
            calls.append(call)
        else:
            errors.append(error)
    return calls, errors


register_parser("qwen")(parse_hermes)
