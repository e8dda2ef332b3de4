"""The OpenAI chat / completions protocol over a `RolloutClient`, without HTTP: validate a request body, render it
with the chat template, run it as one engine request, build the OpenAI response, record its tokens.

    api = OpenAIProtocol(client, tokenizer, parser=get_parser("hermes"), model_name="policy",
                         limits=ServeLimits(max_model_len=2048))
    response = await api.chat_completion(body)          # body: the decoded JSON object; raises ApiError (4xx/5xx)
    api.recorder.records()                              # every response's prompt ids, token ids, log-probs

Requests are validated before the engine sees them; a bad one raises `ApiError(status, message, param)`, which the
HTTP adapter (`megarl.serving.openai_api`) returns as OpenAI's error body
`{"error": {"message", "type": "invalid_request_error", "param": "messages[1].role", "code"}}`.

Chat requests are rendered by `megarl.envs.episode.ChatRenderer` (the tokenizer's chat template, the tools' schemas
passed as `tools=`, encoded without added special tokens: the template alone decides them), as the episodes render
theirs. An assistant message that carries OpenAI `tool_calls` is given to a template that reads `tool_calls` as is
(arguments as objects, as transformers' templates expect); for a template that renders only `content` (megarl's
ChatML templates), the calls are written into the content in the tool-call parser's own format (hermes/qwen:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one per line). A tool message's `name` is the name of
the call its `tool_call_id` answers.

Responses: the completion's ids are decoded (special tokens skipped) for `content`; with tools and `tool_choice`
"auto" the text (special tokens kept, the end-of-turn token left out: what the episodes parse) goes through the tool
parser (`rollout.tool_parser`), each call returned as `{"id", "type": "function", "function": {"name", "arguments":
JSON string}}`, the calls' blocks cut from `content`, finish_reason "tool_calls". `tool_choice` "none" renders the
tools but parses nothing. `logprobs: true` returns the engine's log-probs of the sampled tokens (raw model
log-probs, before temperature and top-p: what the trainer's importance ratios use); `top_logprobs` > 0 is refused.

Extension (vLLM's `return_token_ids`): `"return_token_ids": true` in the body adds `prompt_token_ids` to the response
and `token_ids` (and `token_logprobs`) to each choice. Every response is recorded anyway (`ResponseRecorder`): the
request id, the prompt ids the engine got, and per choice the ids, log-probs, per-token weight versions and finish
reason, so a trainer can build trajectories from the engine's tokens and never from re-tokenized text.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import re
import time
import uuid
from typing import Any, AsyncIterator, Callable, Optional

from megarl.envs.episode import ChatRenderer
from megarl.envs.tool_calls import HERMES_CLOSE, HERMES_OPEN
from megarl.rollout.client import ReplicaDied, RequestDropped, RolloutTimeout
from megarl.rollout.engine import GenerationOutput, GenerationRequest, SamplingSettings

logger = logging.getLogger("megarl.serving")

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP_STRINGS = 4  # OpenAI's own bound on `stop`


class ApiError(Exception):
    """A request the server answers with an error: HTTP `status`, a message saying what is wrong and what to do,
    the offending field (`param`, e.g. "messages[2].role"; None when no field is to blame), OpenAI's error `type`
    and `code`."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 type: str = "invalid_request_error", code: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        """OpenAI's error body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class ServeLimits:
    """What one request may ask for, and what the server holds at once.

    max_model_len: the engine's context (prompt + completion tokens).
    max_n: choices per request (`n`). max_tokens: completion tokens per choice a request may ask for (None: up to
        the context). default_max_tokens: a request's completion budget when it names none (capped by the context).
    max_in_flight: requests admitted at once; one more is answered 429 (back-pressure, not a queue that grows).
    max_body_bytes: the largest request body (413 past it).
    request_timeout_s: the bound of one request in the engine (504 past it, the request aborted).
    """

    max_model_len: int
    max_n: int = 8
    max_tokens: Optional[int] = None
    default_max_tokens: int = 1024
    max_in_flight: int = 64
    max_body_bytes: int = 1 << 20
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_n", "default_max_tokens", "max_in_flight", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServeLimits.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"ServeLimits.max_tokens must be >= 1 or None, got {self.max_tokens}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"ServeLimits.request_timeout_s must be > 0 seconds, got {self.request_timeout_s}")


@dataclasses.dataclass(frozen=True)
class ChoiceRecord:
    """One choice as the engine produced it: token_ids [T], log_probs [T] (raw model log-probs), versions [T] (the
    weights version that sampled each token; None where the client reports none), finish_reason."""

    token_ids: list[int]
    log_probs: list[float]
    versions: Optional[list[int]]
    finish_reason: str


@dataclasses.dataclass(frozen=True)
class ResponseRecord:
    """One answered request: its id (the response's `id`, also the engine request's), the endpoint ("chat" or
    "completions"), the prompt ids the engine got, its choices, the messages it rendered (chat) or None."""

    request_id: str
    endpoint: str
    prompt_ids: list[int]
    choices: list[ChoiceRecord]
    messages: Optional[list[dict]] = None


class ResponseRecorder:
    """The last `max_records` responses, in the order they finished (a bounded deque: a long-running server keeps
    a window, a trainer drains what it needs with `take`)."""

    def __init__(self, max_records: int = 10_000) -> None:
        if max_records < 1:
            raise ValueError(f"ResponseRecorder: max_records must be >= 1, got {max_records}")
        self._records: collections.deque[ResponseRecord] = collections.deque(maxlen=max_records)

    def add(self, record: ResponseRecord) -> None:
        self._records.append(record)

    def records(self) -> list[ResponseRecord]:
        return list(self._records)

    def take(self) -> list[ResponseRecord]:
        """The records so far, removed from the recorder."""
        out = list(self._records)
        self._records.clear()
        return out

    def get(self, request_id: str) -> ResponseRecord:
        for r in reversed(self._records):
            if r.request_id == request_id:
                return r
        raise KeyError(f"no recorded response with id {request_id!r} (the recorder keeps the last "
                       f"{self._records.maxlen})")


def format_hermes_calls(calls: list[dict]) -> str:
    """OpenAI tool calls (`{"function": {"name", "arguments": dict}}`) as the hermes/qwen parser reads them."""
    return "\n".join(HERMES_OPEN + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
                     + HERMES_CLOSE for c in calls)


# How a template that renders only `content` gets an assistant message's tool calls: the parser's own format.
CALL_FORMATTERS: dict[str, Callable[[list[dict]], str]] = {"hermes": format_hermes_calls, "qwen": format_hermes_calls}
_HERMES_BLOCK = re.compile(re.escape(HERMES_OPEN) + r".*?" + re.escape(HERMES_CLOSE), re.DOTALL)


# ------------------------------------------------------------------------------------------------- validation
def _type_name(value: Any) -> str:
    return "null" if value is None else {bool: "boolean", int: "integer", float: "number", str: "string",
                                         list: "array", dict: "object"}.get(type(value), type(value).__name__)


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def _get(body: dict, name: str, kinds: tuple, default: Any = None, what: str = "") -> Any:
    """body[name] if it has one of `kinds` (bool is not a number here), else a 400 naming the field."""
    value = body.get(name, default)
    if value is None:
        return default
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if not ok:
        raise _bad(name, f"expected {what or ' or '.join(_type_name(k()) for k in kinds)}, got "
                         f"{_type_name(value)} {json.dumps(value)[:80]}")
    return value


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = float(_get(body, name, (int, float), default, "a number"))
    if value < low or value > high or (low_open and value == low):
        raise _bad(name, f"must be in {'(' if low_open else '['}{low}, {high}], got {value}")
    return value


def _text_content(content: Any, param: str) -> str:
    """A message's content: a string, null, or a list of text parts ({"type": "text", "text": ...})."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"{param}[{j}]", "only text parts ({\"type\": \"text\", \"text\": \"...\"}) are "
                                            f"supported, got {json.dumps(part)[:80]}")
            texts.append(part["text"])
        return "".join(texts)
    raise _bad(param, f"expected a string, null or an array of text parts, got {_type_name(content)}")


def _tool_calls(calls: Any, param: str) -> list[dict]:
    """An assistant message's OpenAI tool calls -> [{"id", "type": "function", "function": {"name", "arguments":
    dict}}] (arguments decoded from their JSON string)."""
    if not isinstance(calls, list):
        raise _bad(param, f"expected an array of tool calls, got {_type_name(calls)}")
    out = []
    for j, call in enumerate(calls):
        where = f"{param}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(where, "expected {\"id\", \"type\": \"function\", \"function\": {\"name\": string, "
                              "\"arguments\": JSON string}}")
        arguments = fn.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                raise _bad(f"{where}.function.arguments", f"not valid JSON ({e.msg})") from None
        if not isinstance(arguments, dict):
            raise _bad(f"{where}.function.arguments", f"expected a JSON object, got {_type_name(arguments)}")
        out.append({"id": str(call.get("id", f"call_{j}")), "type": "function",
                    "function": {"name": fn["name"], "arguments": arguments}})
    return out


def template_messages(messages: Any, template_reads_tool_calls: bool, call_format: Callable[[list[dict]], str]
                      ) -> list[dict]:
    """OpenAI chat messages -> the messages the chat template renders (see the module docstring); a 400 names the
    first bad field ("messages[2].role")."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "expected a non-empty array of messages, got "
                               f"{_type_name(messages) if isinstance(messages, list) is False else 'an empty array'}")
    out: list[dict] = []
    names: dict[str, str] = {}  # tool_call_id -> function name
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(where, f"expected an object with \"role\" and \"content\", got {_type_name(m)}")
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"{where}.role", f"unknown role {json.dumps(role)}; expected one of {', '.join(ROLES)}")
        content = _text_content(m.get("content"), f"{where}.content")
        message: dict = {"role": "system" if role == "developer" else role, "content": content}
        if role == "assistant" and m.get("tool_calls"):
            calls = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
            names.update((c["id"], c["function"]["name"]) for c in calls)
            if template_reads_tool_calls:
                message["tool_calls"] = calls
            else:
                message["content"] = content + ("\n" if content else "") + call_format(calls)
        elif role == "tool":
            call_id = m.get("tool_call_id")
            if call_id is not None and not isinstance(call_id, str):
                raise _bad(f"{where}.tool_call_id", f"expected a string, got {_type_name(call_id)}")
            name = m.get("name") or names.get(call_id or "")
            if name:
                message["name"] = name
            if call_id:
                message["tool_call_id"] = call_id
        elif m.get("name") is not None:
            message["name"] = m["name"]
        out.append(message)
    return out


def _stream_options(body: dict) -> dict:
    """`stream` and `stream_options.include_usage` of a request body (validated)."""
    stream = bool(_get(body, "stream", (bool,), False))
    extra = _get(body, "stream_options", (dict,), None) or {}
    include_usage = extra.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise _bad("stream_options.include_usage", f"expected a boolean, got {_type_name(include_usage)}")
    return {"stream": stream, "include_usage": stream and include_usage}


def _tools(body: dict) -> Optional[list[dict]]:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools", f"expected an array of {{\"type\": \"function\", \"function\": {{...}}}}, got "
                            f"{_type_name(tools)}")
    for j, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "function") != "function" or \
                not isinstance(t.get("function"), dict) or not isinstance(t["function"].get("name"), str):
            raise _bad(f"tools[{j}]", "expected {\"type\": \"function\", \"function\": {\"name\": string, "
                                      "\"description\", \"parameters\"}}")
    return tools or None


# ------------------------------------------------------------------------------------------------- the protocol
class OpenAIProtocol:
    """OpenAI chat completions / completions over a `RolloutClient` (see the module docstring).

    client: a `RolloutClient`. tokenizer: the model's (chat template, decode). parser: the tool-call parser
    (`megarl.envs.tool_calls.get_parser(rollout.tool_parser)`); parser_name picks the format assistant tool calls
    are written in for a template that renders only content. model_name: the id `/v1/models` lists (requests may
    name any model: one model is served). chat_template: a Jinja template instead of the tokenizer's.
    """

    def __init__(self, client: Any, tokenizer: Any, parser: Callable[[str], tuple], *, model_name: str,
                 limits: ServeLimits, parser_name: str = "hermes", chat_template: Optional[str] = None,
                 recorder: Optional[ResponseRecorder] = None) -> None:
        if parser_name not in CALL_FORMATTERS:
            raise ValueError(f"OpenAIProtocol: no tool-call format for parser {parser_name!r}; known: "
                             f"{sorted(CALL_FORMATTERS)}")
        self.client, self.tokenizer, self.parser = client, tokenizer, parser
        self.model_name, self.limits, self.chat_template = model_name, limits, chat_template
        self.call_format = CALL_FORMATTERS[parser_name]
        source = chat_template or getattr(tokenizer, "chat_template", None) or ""
        self.template_reads_tool_calls = "tool_calls" in source
        self.recorder = recorder or ResponseRecorder()
        self.sessions: dict[str, ResponseRecorder] = {}  # session id -> its requests' records (`open_session`)
        self.created = int(time.time())
        end = getattr(tokenizer, "eos_token_id", None)
        self.end_ids = {end} if end is not None else set()

    # ------------------------------------------------------------------------------------------- sessions
    def open_session(self, session_id: str) -> None:
        """Open session `session_id`: requests sent to it (`chat_completion(body, session=session_id)`, over HTTP
        /sessions/{session_id}/v1/...) are recorded in its own recorder, in the order they finish, until
        `close_session`. A session id already open is an error."""
        if not isinstance(session_id, str) or not session_id or "/" in session_id:
            raise ValueError(f"a session id is a non-empty string without '/', got {session_id!r}")
        if session_id in self.sessions:
            raise ValueError(f"session {session_id!r} is already open")
        self.sessions[session_id] = ResponseRecorder()

    def close_session(self, session_id: str) -> list[ResponseRecord]:
        """Close session `session_id` and return its records (a request to it afterwards gets 404)."""
        return self.sessions.pop(session_id).take()

    def session_recorder(self, session_id: Optional[str]) -> ResponseRecorder:
        """The recorder of `session_id` (None: the server's own); an unknown session is a 404 naming it."""
        if session_id is None:
            return self.recorder
        recorder = self.sessions.get(session_id)
        if recorder is None:
            raise ApiError(404, f"unknown session {session_id!r}: this server has no open session of that id (it "
                                "was never opened, or its episode has ended); use the base URL the episode was given",
                           param="session_id", code="session_not_found")
        return recorder

    # ------------------------------------------------------------------------------------------- public
    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "megarl", "max_model_len": self.limits.max_model_len}]}

    def check_chat(self, body: Any) -> tuple[list[int], list[dict], Optional[list], SamplingSettings, dict]:
        """Validate a chat request body and render it: (prompt ids, template messages, tools, sampling, options).
        Raises ApiError naming the field."""
        body = self._object(body)
        if not (self.chat_template or getattr(self.tokenizer, "chat_template", None)):
            raise _bad("messages", f"model {self.model_name!r} has no chat template (its tokenizer_config.json names "
                                   "none): send the prompt text to /v1/completions instead")
        tools = _tools(body)
        tool_choice = body.get("tool_choice", "auto" if tools else "none")
        if tool_choice not in ("auto", "none"):
            raise _bad("tool_choice", f"only \"auto\" and \"none\" are supported, got {json.dumps(tool_choice)[:80]}")
        messages = template_messages(body.get("messages"), self.template_reads_tool_calls, self.call_format)
        renderer = ChatRenderer(self.tokenizer, tools, self.chat_template)
        try:
            prompt = renderer.prompt(messages)
        except Exception as e:  # a template that raises on these messages (e.g. it refuses a role order)
            raise _bad("messages", f"the chat template cannot render these messages: {e}") from None
        if _get(body, "logprobs", (bool,), False) and _get(body, "top_logprobs", (int,), 0):
            raise _bad("top_logprobs", "only 0 is supported (the engine returns the sampled tokens' log-probs)")
        max_tokens = body.get("max_completion_tokens")
        name = "max_completion_tokens"
        if max_tokens is None:
            name = "max_tokens"
        sampling = self._sampling(body, prompt, name, "messages")
        options = {"tools": bool(tools) and tool_choice == "auto", "logprobs": bool(body.get("logprobs")),
                   "return_token_ids": bool(_get(body, "return_token_ids", (bool,), False)),
                   "stop": sampling.stop, **_stream_options(body)}
        return prompt, messages, tools, sampling, options

    async def chat_completion(self, body: Any, session: Optional[str] = None) -> dict:
        """A chat request body -> OpenAI's chat.completion object (raises ApiError); recorded in `session`'s
        recorder (None: the server's own; an unknown session is a 404)."""
        recorder = self.session_recorder(session)
        prompt, messages, _, sampling, options = self.check_chat(body)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        out = await self._generate(request_id, prompt, sampling)
        record = self._record(request_id, "chat", out, messages, recorder)
        choices = [self._chat_choice(i, c, options) for i, c in enumerate(record.choices)]
        response = {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                    "model": self.model_name, "choices": choices, "usage": self._usage(record)}
        if options["return_token_ids"]:
            response["prompt_token_ids"] = record.prompt_ids
        return response

    def check_completion(self, body: Any) -> tuple[list[int], SamplingSettings, dict]:
        body = self._object(body)
        prompt = body.get("prompt")
        if isinstance(prompt, str):  # with the tokenizer's special tokens (a BOS), as vLLM's /v1/completions and
            ids = list(self.tokenizer(prompt)["input_ids"])  # megarl's data.chat_template "none" encode text
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                         for t in prompt):
            ids = list(prompt)
            vocab = self._vocab_rows()
            bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
            if bad:
                raise _bad("prompt", f"token ids must be in [0, {vocab}), got {bad[:5]}")
        elif isinstance(prompt, list):
            raise _bad("prompt", "a batch of prompts is not supported (send one request per prompt); expected a "
                                 "string or a non-empty array of token ids")
        else:
            raise _bad("prompt", f"expected a string or an array of token ids, got {_type_name(prompt)}")
        if not ids:
            raise _bad("prompt", "the prompt encodes to no tokens")
        if _get(body, "echo", (bool,), False):
            raise _bad("echo", "echo is not supported")
        logprobs = _get(body, "logprobs", (int,), None)
        if logprobs is not None and logprobs != 0 and logprobs != 1:
            raise _bad("logprobs", f"only 0 or 1 (the sampled tokens' log-probs) is supported, got {logprobs}")
        sampling = self._sampling(body, ids, "max_tokens", "prompt", default_max_tokens=16)
        options = {"logprobs": logprobs is not None, "tools": False, "stop": sampling.stop,
                   "return_token_ids": bool(_get(body, "return_token_ids", (bool,), False)), **_stream_options(body)}
        return ids, sampling, options

    async def completion(self, body: Any, session: Optional[str] = None) -> dict:
        """A completions request body -> OpenAI's text_completion object (raises ApiError); recorded as
        `chat_completion` records."""
        recorder = self.session_recorder(session)
        prompt, sampling, options = self.check_completion(body)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        out = await self._generate(request_id, prompt, sampling)
        record = self._record(request_id, "completions", out, None, recorder)
        choices = [self._completion_choice(i, c, options) for i, c in enumerate(record.choices)]
        response = {"id": request_id, "object": "text_completion", "created": int(time.time()),
                    "model": self.model_name, "choices": choices, "usage": self._usage(record)}
        if options["return_token_ids"]:
            response["prompt_token_ids"] = record.prompt_ids
        return response

    def open_stream(self, endpoint: str, body: Any, session: Optional[str] = None) -> AsyncIterator[dict]:
        """A `stream: true` request (endpoint "chat" or "completions"), validated now (raises ApiError naming the
        field, before any byte is sent), as an async iterator of OpenAI's chunk objects (chat.completion.chunk /
        text_completion), incremental where the client hands partial outputs (`client.streams_progress`: the
        in-process engine client; the router of a training run answers finished requests, so its stream comes at
        the end). Chat: a role chunk per choice first; then content deltas as tokens arrive; at the end the rest
        of the content, the tool calls (OpenAI's `tool_calls` deltas, `index` per call) and the finish reason.
        The concatenated deltas of a choice equal the non-streamed answer's text: a delta only ever holds text
        that is a prefix of the final text (held back: a trailing incomplete UTF-8 character, trailing whitespace,
        the last len(longest stop) - 1 characters, and with tools everything from the first "<", where a tool
        call may begin). Log-probs and, with `return_token_ids`, `token_ids` come with the deltas of the tokens
        they describe; `stream_options.include_usage`: a last chunk with empty choices and the usage. The request
        is recorded as a non-streamed one when it finishes. Raises ApiError while iterated (a 5xx/504 after the
        stream began); closing or cancelling the iterator aborts the engine request."""
        recorder = self.session_recorder(session)
        if endpoint == "chat":
            prompt, messages, _, sampling, options = self.check_chat(body)
            request_id = f"chatcmpl-{uuid.uuid4().hex}"
        else:
            prompt, sampling, options = self.check_completion(body)
            messages, request_id = None, f"cmpl-{uuid.uuid4().hex}"
        return self._stream(endpoint, request_id, prompt, messages, sampling, options, recorder)

    async def _stream(self, endpoint: str, request_id: str, prompt: list[int], messages: Optional[list],
                      sampling: SamplingSettings, options: dict, recorder: ResponseRecorder) -> AsyncIterator[dict]:
        chat = endpoint == "chat"
        base = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_name}
        if options["include_usage"]:
            base["usage"] = None

        def chunk(index: int, text: Optional[str], ids: list[int], log_probs: list[float],
                  finish_reason: Optional[str] = None, delta: Optional[dict] = None) -> dict:
            choice: dict = {"index": index, "logprobs": self._logprobs(chat, ids, log_probs)
                            if options["logprobs"] and ids else None, "finish_reason": finish_reason}
            if chat:
                choice["delta"] = delta if delta is not None else ({} if text is None else {"content": text})
            else:
                choice["text"] = text or ""
            if options["return_token_ids"]:
                choice["token_ids"] = ids
            return {**base, "choices": [choice]}

        queue: asyncio.Queue = asyncio.Queue()
        streams = getattr(self.client, "streams_progress", False)
        task = asyncio.ensure_future(self._generate(request_id, prompt, sampling,
                                                    on_progress=queue.put_nowait if streams else None))
        task.add_done_callback(lambda _: queue.put_nowait(None))
        sent_text: dict[int, str] = collections.defaultdict(str)  # sample index -> text sent
        sent_ids: dict[int, int] = collections.defaultdict(int)  # sample index -> tokens described
        try:
            if chat:
                for i in range(sampling.samples_per_prompt):
                    first = chunk(i, None, [], [], delta={"role": "assistant", "content": ""})
                    if options["return_token_ids"]:
                        first["prompt_token_ids"] = list(prompt)
                    yield first
            while True:
                partial = await queue.get()  # bounded: `task` ends within limits.request_timeout_s, then None is put
                if partial is None:
                    break
                for c in partial.completions:
                    i = c.sample_index
                    safe = self._safe_prefix(list(c.token_ids), options, chat)
                    if len(safe) > len(sent_text[i]) and safe.startswith(sent_text[i]):
                        n = len(c.token_ids)
                        yield chunk(i, safe[len(sent_text[i]):], list(c.token_ids[sent_ids[i]:n]),
                                    list(c.log_probs[sent_ids[i]:n]))
                        sent_text[i], sent_ids[i] = safe, n
            out = task.result()  # raises its ApiError
            record = self._record(request_id, endpoint if chat else "completions", out, messages, recorder)
            for i, c in enumerate(record.choices):
                final = self._chat_choice(i, c, options) if chat else self._completion_choice(i, c, options)
                text = (final["message"]["content"] or "") if chat else final["text"]
                if not text.startswith(sent_text[i]):  # a tokenizer whose decode of a prefix is not a prefix
                    logger.warning("stream %s choice %d: the text sent (%r) is not a prefix of the answer (%r)",
                                   request_id, i, sent_text[i][-40:], text[-40:])
                rest = text[len(sent_text[i]):] if text.startswith(sent_text[i]) else ""
                if rest or sent_ids[i] < len(c.token_ids):
                    yield chunk(i, rest, c.token_ids[sent_ids[i]:], c.log_probs[sent_ids[i]:])
                calls = final["message"].get("tool_calls") if chat else None
                if calls:
                    yield chunk(i, None, [], [], delta={"tool_calls": [dict(call, index=k)
                                                                        for k, call in enumerate(calls)]})
                yield chunk(i, None, [], [], finish_reason=final["finish_reason"])
            if options["include_usage"]:
                yield {**base, "choices": [], "usage": self._usage(record)}
        finally:  # also when the consumer stops (a client that disconnected): the engine request is aborted
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, ApiError):
                    await task

    def _safe_prefix(self, ids: list[int], options: dict, chat: bool) -> str:
        """The text of a partial completion `ids` that the final answer's text is sure to start with (see
        `open_stream`)."""
        body = ids[:-1] if chat and ids and ids[-1] in self.end_ids else ids
        text = self.tokenizer.decode(body, skip_special_tokens=True).rstrip("\ufffd")
        stops = options["stop"]
        cut = self._cut_at_stop(text, stops)
        if cut != text:
            text = cut
        elif stops:
            text = text[:max(0, len(text) - (max(len(s) for s in stops) - 1))]
        if chat and options["tools"]:
            if text[:1].isspace():  # a content stripped once a call is cut from it: nothing is sure yet
                return ""
            text = text.split("<", 1)[0]
        return text.rstrip()

    def _logprobs(self, chat: bool, ids: list[int], log_probs: list[float]) -> dict:
        """The `logprobs` field of a chat choice (content entries) or a completion choice for these tokens."""
        if chat:
            return {"content": [{"token": self.tokenizer.decode([t]), "logprob": lp,
                                 "bytes": list(self.tokenizer.decode([t]).encode("utf-8")), "top_logprobs": []}
                                for t, lp in zip(ids, log_probs)]}
        return {"tokens": [self.tokenizer.decode([t]) for t in ids], "token_logprobs": list(log_probs),
                "top_logprobs": None, "text_offset": None}

    # ------------------------------------------------------------------------------------------- internals
    @staticmethod
    def _object(body: Any) -> dict:
        if not isinstance(body, dict):
            raise ApiError(400, f"the request body must be a JSON object, got {_type_name(body)}")
        return body

    def _vocab_rows(self) -> Optional[int]:
        try:
            return len(self.tokenizer)
        except TypeError:
            return None

    def _sampling(self, body: dict, prompt: list[int], tokens_field: str, prompt_field: str,
                  default_max_tokens: Optional[int] = None) -> SamplingSettings:
        limits = self.limits
        room = limits.max_model_len - len(prompt)
        if room < 1:
            raise ApiError(400, f"{prompt_field}: the prompt is {len(prompt)} tokens; this model's context is "
                                f"{limits.max_model_len} tokens (prompt + completion), so the prompt must be at most "
                                f"{limits.max_model_len - 1}; shorten it", param=prompt_field,
                           code="context_length_exceeded")
        n = _get(body, "n", (int,), 1)
        if not 1 <= n <= limits.max_n:
            raise _bad("n", f"must be in [1, {limits.max_n}] (the server's --max-n), got {n}")
        max_tokens = _get(body, tokens_field, (int,), None)
        if max_tokens is not None:
            cap = min(room, limits.max_tokens or room)
            if not 1 <= max_tokens <= cap:
                why = (f"the prompt is {len(prompt)} of the context's {limits.max_model_len} tokens" if cap == room
                       else f"the server's --max-tokens is {limits.max_tokens}")
                raise ApiError(400, f"{tokens_field}: must be in [1, {cap}] ({why}), got {max_tokens}",
                               param=tokens_field, code="context_length_exceeded" if cap == room else None)
        else:
            max_tokens = min(room, limits.max_tokens or room, default_max_tokens or limits.default_max_tokens)
        temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
        top_p = _number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)
        seed = _get(body, "seed", (int,), None)
        stop = body.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or \
                len(stop) > MAX_STOP_STRINGS:
            raise _bad("stop", f"expected a non-empty string or an array of at most {MAX_STOP_STRINGS} of them, got "
                               f"{json.dumps(body.get('stop'))[:80]}")
        for name in ("frequency_penalty", "presence_penalty"):
            if _number(body, name, 0.0, -2.0, 2.0) != 0.0:
                raise _bad(name, "not supported (the engine samples from the policy's own distribution); omit it "
                                 "or send 0")
        if body.get("logit_bias"):
            raise _bad("logit_bias", "not supported (the engine samples from the policy's own distribution)")
        ignore_eos = _get(body, "ignore_eos", (bool,), False)
        return SamplingSettings(samples_per_prompt=n, temperature=temperature, top_p=top_p, max_new_tokens=max_tokens,
                                stop=tuple(stop), seed=seed, ignore_eos=ignore_eos, max_prompt_tokens=len(prompt))

    async def _generate(self, request_id: str, prompt: list[int], sampling: SamplingSettings,
                        on_progress: Optional[Callable[[GenerationOutput], None]] = None) -> GenerationOutput:
        request = GenerationRequest(request_id, prompt, sampling, seed_index=0)
        extra = {} if on_progress is None else {"on_progress": on_progress}
        try:
            out = await self.client.generate(request, session_id=request_id, timeout_s=self.limits.request_timeout_s,
                                             **extra)
        except RolloutTimeout as e:
            raise ApiError(504, f"the request did not finish within {self.limits.request_timeout_s} s and was "
                                f"aborted: {e}", type="timeout") from None
        except ReplicaDied as e:
            raise ApiError(503, f"the engine is not running: {e}", type="server_error") from None
        except RequestDropped as e:
            raise ApiError(400, f"the engine dropped the request: {e}", param="messages") from None
        except ValueError as e:  # refused by the engine
            raise ApiError(400, f"the engine refused the request: {e}") from None
        if not out.finished or len(out.completions) != sampling.samples_per_prompt:
            raise ApiError(500, f"request {request_id}: the engine answered {len(out.completions)} completions "
                                f"({'finished' if out.finished else 'unfinished'}), expected "
                                f"{sampling.samples_per_prompt} finished", type="server_error")
        return out

    def _record(self, request_id: str, endpoint: str, out: GenerationOutput, messages: Optional[list],
                recorder: Optional[ResponseRecorder] = None) -> ResponseRecord:
        choices = [ChoiceRecord(list(c.token_ids), list(c.log_probs),
                                None if c.versions is None else list(c.versions), c.finish_reason or "length")
                   for c in sorted(out.completions, key=lambda c: c.sample_index)]
        record = ResponseRecord(request_id, endpoint, list(out.prompt_ids), choices, messages)
        (recorder or self.recorder).add(record)
        return record

    @staticmethod
    def _usage(record: ResponseRecord) -> dict:
        completion = sum(len(c.token_ids) for c in record.choices)
        return {"prompt_tokens": len(record.prompt_ids), "completion_tokens": completion,
                "total_tokens": len(record.prompt_ids) + completion}

    @staticmethod
    def _cut_at_stop(text: str, stop: tuple) -> str:
        """The text before the first stop string (vLLM's ids end with the token that completed it)."""
        cuts = [text.find(s) for s in stop if s in text]
        return text[:min(cuts)] if cuts else text

    def _chat_choice(self, index: int, c: ChoiceRecord, options: dict) -> dict:
        ids = c.token_ids
        body = ids[:-1] if ids and ids[-1] in self.end_ids else ids  # the end-of-turn token left out
        content = self._cut_at_stop(self.tokenizer.decode(body, skip_special_tokens=True), options["stop"])
        message: dict = {"role": "assistant", "content": content}
        finish = c.finish_reason
        if options["tools"]:
            raw = self.tokenizer.decode(body, skip_special_tokens=False)
            calls, _errors = self.parser(raw)  # a malformed call stays in the content, as text
            if calls:
                message["tool_calls"] = [
                    {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                     "function": {"name": call.name, "arguments": json.dumps(call.arguments)}} for call in calls]
                message["content"] = _HERMES_BLOCK.sub("", content).strip() or None
                finish = "tool_calls" if finish == "stop" else finish
        choice = {"index": index, "message": message, "finish_reason": finish, "logprobs": None}
        if options["logprobs"]:
            choice["logprobs"] = self._logprobs(True, ids, c.log_probs)
        if options["return_token_ids"]:
            choice["token_ids"] = ids
            choice["token_logprobs"] = c.log_probs
        return choice

    def _completion_choice(self, index: int, c: ChoiceRecord, options: dict) -> dict:
        text = self._cut_at_stop(self.tokenizer.decode(c.token_ids, skip_special_tokens=True), options["stop"])
        choice = {"index": index, "text": text, "finish_reason": c.finish_reason, "logprobs": None}
        if options["logprobs"]:
            choice["logprobs"] = self._logprobs(False, c.token_ids, c.log_probs)
        if options["return_token_ids"]:
            choice["token_ids"] = c.token_ids
        return choice
