"""Tools and ToolSet: schemas rendered by a real chat template, and every failure of a call an error message for
the model (never an exception), counted."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Optional

import pytest

from megarl.envs.base import ToolCall
from megarl.envs.tools import COUNT_KEYS, Tool, ToolSet, check_arguments, function_schema
from tests.unit._qwen_template import qwen_tokenizer


def lookup(city: str, units: Optional[str] = None, days: int = 1) -> str:
    """Look up the weather of a city.

    Args:
        city: The city's name.
        units: "metric" or "imperial".
        days: How many days ahead.
    """
    return f"{city}: sunny for {days} day(s)" + (f" ({units})" if units else "")


def boom(x: int) -> str:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"bad x={x}")


def slow(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    threading.Event().wait(seconds)
    return "done"


async def echo(text: str, times: int = 1) -> str:
    """Echo text.

    Args:
        text: What to echo.
        times: How many times.
    """
    await asyncio.sleep(0)
    return text * times


class Counter(Tool):
    name = "counter"

    def run(self, step: int) -> str:
        """Add to a running total.

        Args:
            step: The amount to add.
        """
        self.count("adds")
        self.counters["total"] = self.counters.get("total", 0) + step
        return str(self.counters["total"])


def call(toolset: ToolSet, name: str, **arguments) -> tuple[str, dict]:
    return asyncio.run(toolset.call(ToolCall(name, arguments)))


def counts(info: dict) -> dict:
    assert set(info) == set(COUNT_KEYS)
    return {k: v for k, v in info.items() if v}


def test_the_chat_template_renders_the_schemas_as_transformers_would_from_the_functions():
    tok = qwen_tokenizer()
    messages = [{"role": "user", "content": "weather?"}]
    tools = [lookup, Counter()]
    ours = tok.apply_chat_template(messages, tools=ToolSet(tools).schemas(), tokenize=False)
    # transformers builds the schema from a function itself; a Tool's is built from its run()
    counter_fn = Counter().run
    assert ours == tok.apply_chat_template(messages, tools=[lookup, counter_fn], tokenize=False).replace(
        '"name": "run"', '"name": "counter"')
    rendered = ours.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0].splitlines()
    schemas = [json.loads(line) for line in rendered]
    assert [s["function"]["name"] for s in schemas] == ["lookup", "counter"]
    params = schemas[0]["function"]["parameters"]
    assert params["required"] == ["city"]
    assert params["properties"]["city"] == {"type": "string", "description": "The city's name."}
    assert params["properties"]["days"]["type"] == "integer"


def test_a_function_without_a_docstring_is_refused_with_its_name():
    def nodoc(x: int) -> str:
        return ""

    with pytest.raises(TypeError, match="nodoc"):
        function_schema(nodoc)


def test_successful_calls_sync_async_and_stateful():
    counter = Counter()
    ts = ToolSet([lookup, echo, counter])
    assert ts.names() == ["lookup", "echo", "counter"] and "echo" in ts and len(ts) == 3
    content, info = call(ts, "lookup", city="Paris", units="metric")
    assert content == "Paris: sunny for 1 day(s) (metric)" and counts(info) == {"tool_calls": 1}
    assert call(ts, "echo", text="ab", times=2)[0] == "abab"
    assert call(ts, "counter", step=2)[0] == "2"
    assert call(ts, "counter", step=3)[0] == "5"
    assert ts.counters() == {"counter/adds": 2, "counter/total": 5}


def test_unknown_tool():
    content, info = call(ToolSet([lookup, echo]), "weather", city="x")
    assert content == "Error: unknown tool 'weather'; available: lookup, echo"
    assert counts(info) == {"tool_calls": 1, "tool_errors": 1, "unknown_tool": 1}


@pytest.mark.parametrize("arguments, message", [
    ({}, "missing required argument 'city'"),
    ({"city": 3}, "argument 'city' must be string, got 3"),
    ({"city": "x", "days": "2"}, "argument 'days' must be integer, got \"2\""),
    ({"city": "x", "days": True}, "argument 'days' must be integer, got true"),
    ({"city": "x", "days": 1.5}, "argument 'days' must be integer, got 1.5"),
    ({"city": "x", "country": "FR"}, "unknown argument 'country'"),
])
def test_bad_arguments(arguments, message):
    content, info = asyncio.run(ToolSet([lookup]).call(ToolCall("lookup", arguments)))
    assert content.startswith("Error: bad arguments for tool 'lookup': ") and message in content, content
    assert content.endswith("Expected: lookup(city: string, units?: string, days?: integer)")
    assert counts(info) == {"tool_calls": 1, "tool_errors": 1, "bad_arguments": 1}


def test_argument_checks_by_hand():
    schema = {"function": {"parameters": {"type": "object", "properties": {
        "n": {"type": "number"}, "tags": {"type": "array", "items": {"type": "string"}},
        "mode": {"type": "string", "enum": ["a", "b"]}, "maybe": {"type": "integer", "nullable": True},
        "either": {"type": ["integer", "string"]}}, "required": ["n"]}}}
    assert check_arguments({"n": 1, "tags": ["x"], "mode": "a", "maybe": None, "either": "s"}, schema) == []
    assert check_arguments({"n": 2.5, "either": 3}, schema) == []
    assert check_arguments([1], schema) == ["arguments must be a JSON object, got list"]
    assert check_arguments({"n": 1, "tags": ["x", 2]}, schema) == ["argument 'tags': item 1 must be string"]
    assert check_arguments({"n": 1, "mode": "c"}, schema) == ['argument \'mode\' must be one of ["a", "b"], got "c"']
    assert check_arguments({"n": None}, schema) == ["argument 'n' must be number, got null"]
    assert check_arguments({"n": 1, "either": 1.5}, schema) == ["argument 'either' must be integer | string, got 1.5"]


def test_exception_inside_the_tool():
    content, info = call(ToolSet([boom]), "boom", x=3)
    assert content == "Error: tool 'boom' failed: RuntimeError: bad x=3"
    assert counts(info) == {"tool_calls": 1, "tool_errors": 1, "tool_exceptions": 1}


def test_timeout_of_a_sync_tool():
    content, info = call(ToolSet([slow], timeout_s=0.05), "slow", seconds=0.5)
    assert content == "Error: tool 'slow' timed out after 0.05 s"
    assert counts(info) == {"tool_calls": 1, "tool_errors": 1, "tool_timeouts": 1}


def test_long_output_is_truncated_and_counted():
    ts = ToolSet([echo], max_output_chars=10)
    content, info = call(ts, "echo", text="0123456789", times=3)
    assert content == "0123456789\n... [output truncated: 20 more characters]"
    assert counts(info) == {"tool_calls": 1, "tool_truncated": 1}
    assert call(ts, "echo", text="0123456789")[0] == "0123456789"  # exactly the limit: kept whole


def test_non_string_results_are_json():
    def stats(n: int) -> dict:
        """Stats.

        Args:
            n: A number.
        """
        return {"n": n, "sq": n * n}

    assert call(ToolSet([stats]), "stats", n=3)[0] == '{"n": 3, "sq": 9}'


def test_toolset_refuses_duplicate_names_and_bad_limits():
    with pytest.raises(ValueError, match="two tools are named 'lookup'"):
        ToolSet([lookup, lookup])
    with pytest.raises(ValueError, match="max_output_chars"):
        ToolSet([lookup], max_output_chars=0)
    with pytest.raises(TypeError, match="neither a Tool nor a function"):
        ToolSet(["lookup"])
