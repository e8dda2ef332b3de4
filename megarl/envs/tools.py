"""Tools: plain Python functions (or stateful `Tool` objects) that an environment runs for the model's tool calls.

Schemas: a tool's JSON schema is transformers' own `get_json_schema` of the function (type hints + a Google-style
docstring with an `Args:` section), the dict that the chat template's `tools=` receives — the same schema
`tokenizer.apply_chat_template(..., tools=[fn])` builds from the function itself.

`ToolSet.call` never raises on what the model wrote: an unknown tool, arguments that do not fit the schema
(missing required keys, unknown keys, wrong JSON types, values outside an enum), an exception inside the tool and a
tool that misses its deadline each become an "Error: ..." string, the observation the model reads, and are counted
in the call's info (`COUNT_KEYS`). Output longer than `max_output_chars` is cut, with a marker saying how much was
dropped.

Where tools run: an `async` tool on the event loop, concurrently with the episodes' generation; a blocking (sync)
tool on the bounded tool thread pool (`tool_pool()`, `rollout.tool_threads` threads, shared by every episode of the
process; a call waits for a free thread within its deadline).

Deadlines: an `async` tool is cancelled at `timeout_s`; a sync tool is *abandoned* at `timeout_s` (a thread cannot
be interrupted: it finishes in the background, holding one of the pool's threads until then, and its result is
dropped; counted in `ToolPool.abandoned`). The pool's threads are daemon threads: an abandoned call holds neither the
event loop's shutdown nor the process's exit. Tools that can block for long should time themselves out.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import json
import queue
import threading
from typing import Any, Callable, Iterable, Optional, Union

from transformers.utils import get_json_schema

from megarl.envs.base import ToolCall

# the counts of one call's info dict; every key is present (0 or 1), so infos sum key by key
COUNT_KEYS = ("tool_calls", "tool_errors", "unknown_tool", "bad_arguments", "tool_exceptions", "tool_timeouts",
              "tool_truncated")

_JSON_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,), "number": (int, float),
                                             "boolean": (bool,), "array": (list, tuple), "object": (dict,),
                                             "null": (type(None),)}


DEFAULT_TOOL_THREADS = 16


class ToolPool:
    """A bounded pool of daemon threads for blocking tool calls: at most `threads` run at once, the rest queue.

    Unlike `concurrent.futures.ThreadPoolExecutor` (whose threads the interpreter joins at exit, and which
    `asyncio.run` waits for), a call that never returns here holds one thread and nothing else."""

    def __init__(self, threads: int = DEFAULT_TOOL_THREADS) -> None:
        if threads < 1:
            raise ValueError(f"the tool thread pool needs >= 1 thread (rollout.tool_threads), got {threads}")
        self.threads = threads
        self.abandoned = 0  # calls given up at their deadline (their thread busy until they return)
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._started: list[threading.Thread] = []
        self._lock = threading.Lock()

    def submit(self, fn: Callable, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((future, functools.partial(fn, *args, **kwargs)))
        with self._lock:
            if len(self._started) < self.threads:
                t = threading.Thread(target=self._work, name=f"megarl-tool-{len(self._started)}", daemon=True)
                self._started.append(t)
                t.start()
        return future

    def _work(self) -> None:
        while True:
            future, call = self._queue.get()
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while queued (its deadline passed before a thread was free)
            try:
                future.set_result(call())
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
                future.set_exception(e)

    async def run(self, fn: Callable, timeout_s: Optional[float], **arguments: Any) -> Any:
        """`fn(**arguments)` on a pool thread, awaited within `timeout_s` (asyncio.TimeoutError past it: a queued
        call is dropped, a running one abandoned)."""
        future = self.submit(fn, **arguments)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except asyncio.TimeoutError:
            if not future.cancel():
                self.abandoned += 1
            raise


_POOL: Optional[ToolPool] = None
_POOL_LOCK = threading.Lock()


def tool_pool() -> ToolPool:
    """The process's tool thread pool (created on first use with `DEFAULT_TOOL_THREADS`, or `set_tool_threads`)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ToolPool()
        return _POOL


def set_tool_threads(threads: int) -> None:
    """Size the process's tool thread pool (`rollout.tool_threads`); calls already running keep their threads."""
    global _POOL
    pool = ToolPool(threads)
    with _POOL_LOCK:
        _POOL = pool


def function_schema(fn: Callable, name: Optional[str] = None) -> dict:
    """`transformers.utils.get_json_schema(fn)`, renamed to `name` when given. A TypeError names the function when
    transformers cannot build the schema (no docstring, an argument without a type hint or a description)."""
    try:
        schema = get_json_schema(fn)
    except Exception as e:  # transformers raises TypeError / DocstringParsingException
        raise TypeError(f"cannot build the tool schema of {getattr(fn, '__qualname__', fn)!r}: {e}") from e
    if name is not None:
        schema = {**schema, "function": {**schema["function"], "name": name}}
    return schema


class Tool:
    """A tool that may keep state across the calls of one episode (a new instance per episode).

    Subclasses set `name` and implement `run(self, <arguments>) -> str` with type hints and a Google-style
    docstring (the schema is built from it), or override `__call__` and set `schema` themselves. `counters` holds
    what the tool counts (e.g. {"searches": 3}); environments report them in the episode's final info.
    """

    name: str = ""

    def __init__(self) -> None:
        self.counters: dict[str, int] = {}
        self._schema: Optional[dict] = None

    @property
    def schema(self) -> dict:
        """The JSON schema passed to the chat template's `tools=` ({"type": "function", "function": {...}})."""
        if self._schema is None:
            self._schema = function_schema(self.run, name=self.name)
        return self._schema

    @schema.setter
    def schema(self, value: dict) -> None:
        self._schema = value

    @property
    def is_async(self) -> bool:
        """True when calling the tool returns an awaitable (it then runs on the event loop, not on a thread)."""
        return inspect.iscoroutinefunction(self.run)

    def count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    def run(self, **arguments: Any) -> str:
        raise NotImplementedError(f"{type(self).__name__} implements neither run() nor __call__()")

    def __call__(self, **arguments: Any) -> Any:
        return self.run(**arguments)


class FunctionTool(Tool):
    """A plain function (sync or async) as a tool: name = the function's name, schema = its `get_json_schema`."""

    def __init__(self, fn: Callable, name: Optional[str] = None) -> None:
        super().__init__()
        self.fn = fn
        self.name = name or fn.__name__
        self._schema = function_schema(fn, name=self.name)

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)

    def __call__(self, **arguments: Any) -> Any:
        return self.fn(**arguments)


def as_tool(tool: Union[Tool, Callable]) -> Tool:
    """`tool` itself when it is a `Tool`, else the function wrapped in a `FunctionTool`."""
    if isinstance(tool, Tool):
        return tool
    if callable(tool):
        return FunctionTool(tool)
    raise TypeError(f"{tool!r} is neither a Tool nor a function")


def _signature(schema: dict) -> str:
    """'search(query: string, k?: integer)' from a schema, for error messages."""
    fn = schema.get("function", {})
    params = fn.get("parameters", {})
    required = set(params.get("required", []))
    args = [f"{k}{'' if k in required else '?'}: {_type_name(v)}" for k, v in params.get("properties", {}).items()]
    return f"{fn.get('name', '?')}({', '.join(args)})"


def _type_name(spec: dict) -> str:
    types = spec.get("type", "any")
    return " | ".join(types) if isinstance(types, list) else str(types)


def _type_ok(value: Any, spec: dict) -> bool:
    types = spec.get("type")
    if types is None:
        return True
    types = list(types) if isinstance(types, list) else [types]
    if spec.get("nullable"):
        types.append("null")
    for t in types:
        allowed = _JSON_TYPES.get(t)
        if allowed is None:
            return True  # a type this check does not know: leave it to the tool
        if isinstance(value, bool) and t != "boolean":
            continue  # JSON true is not a number
        if isinstance(value, allowed):
            return True
    return False


def check_arguments(arguments: Any, schema: dict) -> list[str]:
    """What is wrong with `arguments` against the tool's `schema` (one message per problem; [] when they fit):
    not an object, missing required keys, keys the schema does not name (unless `additionalProperties`), a value of
    the wrong JSON type (an array's items too), a value outside an `enum`."""
    if not isinstance(arguments, dict):
        return [f"arguments must be a JSON object, got {type(arguments).__name__}"]
    params = schema.get("function", {}).get("parameters", {}) or {}
    properties: dict = params.get("properties", {}) or {}
    problems = [f"missing required argument {k!r}" for k in params.get("required", []) if k not in arguments]
    for key, value in arguments.items():
        spec = properties.get(key)
        if spec is None:
            if not params.get("additionalProperties", False):
                problems.append(f"unknown argument {key!r}")
            continue
        if not _type_ok(value, spec):
            problems.append(f"argument {key!r} must be {_type_name(spec)}, got {json.dumps(value)[:50]}")
            continue
        if "enum" in spec and value not in spec["enum"]:
            problems.append(f"argument {key!r} must be one of {json.dumps(spec['enum'])}, got {json.dumps(value)}")
        items = spec.get("items")
        if isinstance(value, (list, tuple)) and isinstance(items, dict):
            bad = [i for i, item in enumerate(value) if not _type_ok(item, items)]
            if bad:
                problems.append(f"argument {key!r}: item {bad[0]} must be {_type_name(items)}")
    return problems


def _as_text(result: Any) -> str:
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(result)


class ToolSet:
    """The tools of one environment, by name.

    tools: `Tool` objects or plain functions (wrapped with `FunctionTool`); names must be unique.
    max_output_chars: a tool's output beyond this many characters is cut (and counted as `tool_truncated`).
    timeout_s: each call's deadline in seconds (None: none).
    """

    def __init__(self, tools: Iterable[Union[Tool, Callable]], *, max_output_chars: int = 4000,
                 timeout_s: Optional[float] = 30.0) -> None:
        if max_output_chars < 1:
            raise ValueError(f"max_output_chars must be >= 1, got {max_output_chars}")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s}")
        self.tools: dict[str, Tool] = {}
        for t in tools:
            tool = as_tool(t)
            if not tool.name:
                raise ValueError(f"tool {tool!r} has no name")
            if tool.name in self.tools:
                raise ValueError(f"two tools are named {tool.name!r}")
            self.tools[tool.name] = tool
        self.max_output_chars = max_output_chars
        self.timeout_s = timeout_s

    def __getitem__(self, name: str) -> Tool:
        return self.tools[name]

    def __contains__(self, name: object) -> bool:
        return name in self.tools

    def __len__(self) -> int:
        return len(self.tools)

    def names(self) -> list[str]:
        return list(self.tools)

    def schemas(self) -> list[dict]:
        """The tools' JSON schemas, in the order given (the chat template's `tools=`)."""
        return [tool.schema for tool in self.tools.values()]

    def counters(self) -> dict[str, int]:
        """Every tool's counters as {"<tool>/<counter>": n}."""
        return {f"{name}/{k}": v for name, tool in self.tools.items() for k, v in tool.counters.items()}

    async def call(self, call: ToolCall) -> tuple[str, dict]:
        """Run one tool call. Returns (content, info): content is the tool's output (cut to `max_output_chars`) or
        an "Error: ..." message; info holds every `COUNT_KEYS` count (0 or 1) of this call."""
        info = dict.fromkeys(COUNT_KEYS, 0)
        info["tool_calls"] = 1

        def error(kind: str, message: str) -> tuple[str, dict]:
            info[kind] = 1
            info["tool_errors"] = 1
            return f"Error: {message}", info

        tool = self.tools.get(call.name)
        if tool is None:
            available = ", ".join(self.tools) or "(none)"
            return error("unknown_tool", f"unknown tool {call.name!r}; available: {available}")
        problems = check_arguments(call.arguments, tool.schema)
        if problems:
            return error("bad_arguments", f"bad arguments for tool {call.name!r}: {'; '.join(problems)}. "
                                          f"Expected: {_signature(tool.schema)}")
        try:
            if tool.is_async:
                result = await asyncio.wait_for(tool(**call.arguments), self.timeout_s)
            else:
                result = await tool_pool().run(tool, self.timeout_s, **call.arguments)
        except asyncio.TimeoutError:
            return error("tool_timeouts", f"tool {call.name!r} timed out after {self.timeout_s:g} s")
        except Exception as e:
            return error("tool_exceptions", f"tool {call.name!r} failed: {type(e).__name__}: {e}")
        content = _as_text(result)
        if len(content) > self.max_output_chars:
            dropped = len(content) - self.max_output_chars
            content = f"{content[:self.max_output_chars]}\n... [output truncated: {dropped} more characters]"
            info["tool_truncated"] = 1
        return content, info
