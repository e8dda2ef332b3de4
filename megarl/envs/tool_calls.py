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

from megarl.config.errors import did_you_mean
from megarl.envs.base import ToolCall

ParseResult = tuple[list[ToolCall], list[str]]
ToolCallParser = Callable[[str], ParseResult]

_REGISTRY: dict[str, ToolCallParser] = {}
_SNIPPET_CHARS = 200


def register_parser(name: str, *, override: bool = False) -> Callable[[ToolCallParser], ToolCallParser]:
    """Decorator: register `fn(text) -> (tool_calls, errors)` under `name`. A taken name is an error unless
    `override=True` (one function may be registered under several names)."""

    def deco(fn: ToolCallParser) -> ToolCallParser:
        if not callable(fn):
            raise TypeError(f"tool-call parser {name!r}: {fn!r} is not callable")
        if name in _REGISTRY and not override and _REGISTRY[name] is not fn:
            raise ValueError(f"tool-call parser {name!r} is already registered (pass override=True to replace it)")
        _REGISTRY[name] = fn
        return fn

    return deco


def get_parser(name: str) -> ToolCallParser:
    """The parser registered as `name`; a KeyError lists the registered names."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(
            f"unknown tool-call parser {name!r}{did_you_mean(name, _REGISTRY)}; registered: {sorted(_REGISTRY)}"
        ) from None


def list_parsers() -> list[str]:
    return sorted(_REGISTRY)


def _snippet(text: str) -> str:
    text = text.strip()
    return text if len(text) <= _SNIPPET_CHARS else text[:_SNIPPET_CHARS] + "..."


HERMES_OPEN = "<tool_call>"
HERMES_CLOSE = "</tool_call>"


def _hermes_call(body: str, number: int) -> tuple[ToolCall | None, str | None]:
    """One `<tool_call>` body -> (call, None) or (None, error). `number` is 1-based, for the message."""
    where = f"tool call {number}"
    body = body.strip()
    try:
        obj, end = json.JSONDecoder().raw_decode(body)
    except json.JSONDecodeError as e:
        return None, f"{where}: invalid JSON ({e.msg} at char {e.pos}): {_snippet(body)}"
    if body[end:].strip():
        return None, f"{where}: unexpected text after the JSON object: {_snippet(body[end:])}"
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


@register_parser("hermes")
def parse_hermes(text: str) -> ParseResult:
    """`<tool_call>{json}</tool_call>` blocks in `text`, in order. An opening tag with no closing tag before the
    next opening tag (or the end of the text) is an 'unterminated' error; a stray closing tag is ignored."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    pos = 0
    number = 0
    while True:
        start = text.find(HERMES_OPEN, pos)
        if start < 0:
            break
        number += 1
        body_start = start + len(HERMES_OPEN)
        close = text.find(HERMES_CLOSE, body_start)
        next_open = text.find(HERMES_OPEN, body_start)
        if close < 0 or 0 <= next_open < close:
            stop = next_open if next_open >= 0 else len(text)
            errors.append(f"tool call {number}: unterminated {HERMES_OPEN} (no {HERMES_CLOSE}): "
                          f"{_snippet(text[body_start:stop])}")
            pos = stop
            continue
        call, error = _hermes_call(text[body_start:close], number)
        if call is not None:
            # ids count every call of the turn, failed ones included, so call_<i> is the i-th block
            calls.append(call)
        else:
            errors.append(error)
        pos = close + len(HERMES_CLOSE)
    return calls, errors


register_parser("qwen")(parse_hermes)
