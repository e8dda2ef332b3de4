"""The OpenAI protocol (`megarl.serving.openai_protocol`) through the real `openai` client and the real FastAPI app
(over httpx's in-process ASGI transport), with a scripted `RolloutClient` that writes what a policy which has learned
the calculator task samples: a tool call, then the tool's answer. The real engine behind the app runs in
tests/distributed/test_openai_api.py (a random model never writes a tool call, so the parse direction is here)."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from megarl.data.chat_bpe import build_chat_bpe_tokenizer
from megarl.data.tool_task import tool_call_text
from megarl.envs.tool_calls import get_parser
from megarl.rollout.engine import Completion, GenerationOutput
from megarl.serving.openai_api import check_bind, create_app
from megarl.serving.openai_protocol import OpenAIProtocol, ServeLimits

TOK = build_chat_bpe_tokenizer()
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression.",
                                           "parameters": {"type": "object", "properties": {
                                               "expression": {"type": "string"}}, "required": ["expression"]}}}]


class CalculatorPolicy:
    """A `RolloutClient`: a tool call for the question, the tool's result once the prompt holds one; each reply's
    canonical ids + <|im_end|>, log-probs -0.25 per token. Records every request it got."""

    replicas = 1
    weight_version = 7

    def __init__(self):
        self.requests = []

    async def generate(self, request, *, session_id=None, priority=0, timeout_s=None):
        self.requests.append(request)
        await asyncio.sleep(0)
        text = TOK.decode(list(request.prompt_ids), skip_special_tokens=False)
        if "<|im_start|>tool\n" in text:
            reply = text.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0]
        else:
            reply = tool_call_text(text.rsplit("<|im_start|>user\n", 1)[1].split("=")[0])
        ids = TOK(reply, add_special_tokens=False)["input_ids"] + [TOK.eos_token_id]
        completions = [Completion(k, ids, [-0.25] * len(ids), "stop", [7] * len(ids))
                       for k in range(request.sampling.samples_per_prompt)]
        return GenerationOutput(request.request_id, list(request.prompt_ids), completions, True)

    async def abort(self, request_ids):
        return 0

    def metrics(self):
        return {}


def _rendered(conversation, tools=TOOLS):
    """transformers' rendering of the conversation with the generation prompt, encoded without added tokens: the
    prompt the engine must get (independent of the server's renderer)."""
    text = TOK.apply_chat_template(conversation, tools=tools, tokenize=False, add_generation_prompt=True)
    return TOK(text, add_special_tokens=False)["input_ids"]


def scripted_app(policy):
    """(protocol, app): the endpoint over `policy` with the hermes parser and a 1024-token context."""
    protocol = OpenAIProtocol(policy, TOK, get_parser("hermes"), model_name="policy",
                              limits=ServeLimits(max_model_len=1024))
    return protocol, create_app(protocol)


def app_client(app):
    """The real `openai` async client talking to `app` in-process (httpx's ASGI transport, no socket)."""
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http, max_retries=0)


def test_a_tool_call_round_trip_through_the_openai_client():
    """The policy's tool call comes back in OpenAI's `tool_calls` (finish_reason tool_calls, no content); the agent
    sends it back with the tool's result, and the engine's next prompt is exactly transformers' rendering of the
    conversation with the call in the model's own format; the recorded tokens are the engine's."""
    policy = CalculatorPolicy()
    protocol, app = scripted_app(policy)

    async def agent():
        client = app_client(app)
        messages = [{"role": "user", "content": "12*34="}]
        first = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                     extra_body={"return_token_ids": True})
        call = first.choices[0].message.tool_calls[0]
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "408"}]
        second = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, logprobs=True)
        await client.close()  # and its httpx client
        return first, second

    first, second = asyncio.run(agent())
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("function", "calculator", {"expression": "12*34"})]
    assert first.prompt_token_ids == _rendered([{"role": "user", "content": "12*34="}])
    assert choice.token_ids == TOK(tool_call_text("12*34"), add_special_tokens=False)["input_ids"] + [2]
    conversation = [{"role": "user", "content": "12*34="}, {"role": "assistant", "content": tool_call_text("12*34")},
                    {"role": "tool", "name": "calculator", "content": "408"}]
    assert list(policy.requests[1].prompt_ids) == _rendered(conversation)
    answer = second.choices[0]
    assert answer.message.content == "408" and answer.finish_reason == "stop" and not answer.message.tool_calls
    assert [x.logprob for x in answer.logprobs.content] == [-0.25] * len(TOK("408")["input_ids"] + [2])
    records = protocol.recorder.records()
    assert [r.request_id for r in records] == [first.id, second.id]
    assert records[1].prompt_ids == _rendered(conversation)
    assert records[1].choices[0].token_ids == TOK("408", add_special_tokens=False)["input_ids"] + [2]
    assert records[1].choices[0].versions == [7] * len(records[1].choices[0].token_ids)


def test_tool_choice_none_parses_nothing_and_a_stream_carries_the_tool_calls():
    policy = CalculatorPolicy()
    app = create_app(OpenAIProtocol(policy, TOK, get_parser("hermes"), model_name="policy",
                                    limits=ServeLimits(max_model_len=1024)))

    async def agent():
        client = app_client(app)
        messages = [{"role": "user", "content": "7*8="}]
        plain = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                     tool_choice="none")
        stream = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, stream=True)
        chunks = [c async for c in stream]
        await client.close()  # and its httpx client
        return plain, chunks

    plain, chunks = asyncio.run(agent())
    assert plain.choices[0].message.content == tool_call_text("7*8") and plain.choices[0].finish_reason == "stop"
    calls = [call for c in chunks for ch in c.choices for call in (ch.delta.tool_calls or [])]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [("calculator", {"expression": "7*8"})]
    assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == ["tool_calls"]


def test_a_non_loopback_bind_needs_a_bearer_token():
    check_bind("127.0.0.1", None)
    check_bind("localhost", None)
    check_bind("::1", None)
    with pytest.raises(ValueError, match=r"--host 0.0.0.0 is not a loopback address.*pass --api-key TOKEN"):
        check_bind("0.0.0.0", None)
    check_bind("0.0.0.0", "secret")


def test_megarl_serve_refuses_a_public_host_without_a_token_before_loading_anything(tmp_path, capsys):
    from megarl.cli import main

    assert main(["serve", str(tmp_path), "--host", "0.0.0.0"]) == 2  # tmp_path holds no model: nothing was loaded
    assert "--host 0.0.0.0 is not a loopback address" in capsys.readouterr().err


def test_a_session_chains_into_token_exact_segments_and_a_rewrite_starts_a_new_one():
    """Through the app with the scripted policy: turn 1 (tool call), turn 2 (with the tool result) extend each other
    exactly; an agent that then drops the tool exchange (rewrites history) starts a second segment. Expected values:
    the trajectory is transformers' rendering of the final conversation (the policy's ids are canonical), the loss
    mask covers exactly the engine's ids, the log-probs are the engine's."""
    from megarl.serving.segments import chain_segments

    policy = CalculatorPolicy()
    protocol, app = scripted_app(policy)

    async def agent():
        client = app_client(app)
        messages = [{"role": "user", "content": "12*34="}]
        first = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        call = first.choices[0].message.tool_calls[0]
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "408"}]
        await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        rewritten = [{"role": "user", "content": "Compute this with the calculator, step by step: " * 8 + "7*8="}]
        await client.chat.completions.create(model="policy", messages=rewritten, tools=TOOLS)  # longer, not an
        # extension: a new segment
        await client.close()  # and its httpx client

    asyncio.run(agent())
    first, second = chain_segments(protocol.recorder.records())
    conversation = [{"role": "user", "content": "12*34="}, {"role": "assistant", "content": tool_call_text("12*34")},
                    {"role": "tool", "name": "calculator", "content": "408"}, {"role": "assistant", "content": "408"}]
    text = TOK.apply_chat_template(conversation, tools=TOOLS, tokenize=False)
    assert TOK.decode(first.token_ids, skip_special_tokens=False) == text[:-1]  # all but the final separator
    trained = [t for t, m in zip(first.token_ids, first.loss_mask) if m]
    assert trained == (TOK(tool_call_text("12*34"), add_special_tokens=False)["input_ids"] + [2]
                       + TOK("408", add_special_tokens=False)["input_ids"] + [2])
    assert [lp for lp, m in zip(first.log_probs, first.loss_mask) if m] == [-0.25] * len(trained)
    assert [v for v, m in zip(first.versions, first.loss_mask) if m] == [7] * len(trained)
    assert len(first.request_ids) == 2 and len(second.request_ids) == 1
    assert len(second) > len(first)  # longer than the first, yet not its extension
    assert TOK.decode(second.token_ids, skip_special_tokens=False).startswith("<|im_start|>system\nTools: calculator")


class TokenByTokenPolicy(CalculatorPolicy):
    """`CalculatorPolicy` that streams (`streams_progress`, as `InProcessClient`): before its answer it hands a
    partial output per token (each completion's ids so far), yielding to the event loop between tokens; the replies
    carry text before the tool call and characters split over several byte tokens ("≈", "é")."""

    streams_progress = True

    def __init__(self, replies):
        super().__init__()
        self.replies = replies  # one per request, in order

    async def generate(self, request, *, session_id=None, priority=0, timeout_s=None, on_progress=None):
        self.requests.append(request)
        ids = TOK(self.replies[len(self.requests) - 1], add_special_tokens=False)["input_ids"] + [TOK.eos_token_id]
        n = request.sampling.samples_per_prompt
        for k in range(1, len(ids) if on_progress is not None else 0):
            on_progress(GenerationOutput(request.request_id, list(request.prompt_ids),
                                         [Completion(j, ids[:k], [-0.25] * k, None, [7] * k) for j in range(n)],
                                         False))
            await asyncio.sleep(0)
        completions = [Completion(j, ids, [-0.25] * len(ids), "stop", [7] * len(ids)) for j in range(n)]
        return GenerationOutput(request.request_id, list(request.prompt_ids), completions, True)


def test_a_stream_sends_deltas_token_by_token_that_add_up_to_the_plain_answer():
    """With a client that hands partial outputs, `stream=True` (chat and completions) sends the text as it grows:
    several content chunks before the finish chunk, never half a character, and the deltas concatenated equal the
    non-streamed answer to the same request (expected: the plain response, and the reply text written here); the
    tool call arrives as OpenAI's `tool_calls` delta, the log-probs and token ids of the deltas add up to the
    engine's, `stream_options.include_usage` adds the usage chunk (and without it there is none)."""
    with_call = "Result ≈ café. " + tool_call_text("12*34")
    plain_text = "Result ≈ 408 café"
    policy = TokenByTokenPolicy([with_call, with_call, plain_text, plain_text, plain_text, plain_text])
    protocol, app = scripted_app(policy)
    messages = [{"role": "user", "content": "12*34="}]

    async def agent():
        client = app_client(app)
        out = {"plain_call": await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)}
        stream = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, stream=True,
                                                      logprobs=True, stream_options={"include_usage": True},
                                                      extra_body={"return_token_ids": True})
        out["call_chunks"] = [c async for c in stream]
        out["plain"] = await client.chat.completions.create(model="policy", messages=messages)
        out["chunks"] = [c async for c in await client.chat.completions.create(model="policy", messages=messages,
                                                                               stream=True)]
        out["plain_cmpl"] = await client.completions.create(model="policy", prompt="12*34=", stop=[" caf"])
        out["cmpl_chunks"] = [c async for c in await client.completions.create(model="policy", prompt="12*34=",
                                                                               stop=[" caf"], stream=True)]
        await client.close()
        return out

    out = asyncio.run(agent())
    ids_with_call = TOK(with_call, add_special_tokens=False)["input_ids"] + [TOK.eos_token_id]

    def content_deltas(chunks):
        return [ch.delta.content for c in chunks for ch in c.choices if ch.delta.content]

    # the tool-call turn: the text before the call streams, the call comes whole at the end
    chunks = out["call_chunks"]
    deltas = content_deltas(chunks)
    assert "".join(deltas) == out["plain_call"].choices[0].message.content == "Result ≈ café."
    assert len(deltas) >= 3 and not any("\ufffd" in d for d in deltas)
    finish_at = next(k for k, c in enumerate(chunks) if c.choices and c.choices[0].finish_reason)
    assert chunks[finish_at].choices[0].finish_reason == "tool_calls"
    assert max(k for k, c in enumerate(chunks) if c.choices and c.choices[0].delta.content) < finish_at
    calls = [call for c in chunks for ch in c.choices for call in (ch.delta.tool_calls or [])]
    assert [(c.index, c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [(0, "calculator", {"expression": "12*34"})]
    streamed_ids = [t for c in chunks for ch in c.choices for t in (ch.model_extra.get("token_ids") or [])]
    assert streamed_ids == ids_with_call
    assert [x.logprob for c in chunks for ch in c.choices if ch.logprobs for x in ch.logprobs.content] == \
        [-0.25] * len(ids_with_call)
    assert chunks[0].model_extra["prompt_token_ids"] == _rendered(messages)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids_with_call)
    assert chunks[-1].usage == out["plain_call"].usage
    # a plain answer, no tools, no usage asked for
    deltas = content_deltas(out["chunks"])
    assert "".join(deltas) == out["plain"].choices[0].message.content == plain_text and len(deltas) >= 3
    assert not any("\ufffd" in d for d in deltas) and all(c.usage is None for c in out["chunks"])
    # completions with a stop string: nothing past it is ever sent
    texts = [ch.text for c in out["cmpl_chunks"] for ch in c.choices if ch.text]
    assert "".join(texts) == out["plain_cmpl"].choices[0].text == "Result ≈ 408" and len(texts) >= 2
    # streamed requests are recorded as the plain ones
    records = protocol.recorder.records()
    assert [r.choices[0].token_ids for r in records[:2]] == [ids_with_call, ids_with_call]
