"""What an episode talks to: a `RolloutClient`, one request at a time, from any number of coroutines at once.

    out = await client.generate(GenerationRequest(request_id, prompt_ids, sampling, seed_index), session_id=uid)
    out.completions[0].token_ids, .log_probs, .versions     # the weights version that sampled each token

The request-level server (`megarl.rollout.engine_server`, one engine loop per rollout replica) and the controller-side
router (`megarl.rollout.router`: least-loaded replica for a new session, the same replica for the session's later
requests, so its prefix stays cached) implement it. Every episode is its own coroutine (`megarl.envs.episode`): it
awaits its own requests and nobody else's, so a slow tool call or a long turn holds only its own episode.

Contract:
- `generate` returns when the request has finished (every completion has a finish reason). Request ids are the
  caller's and unique among the requests in flight.
- Waits are bounded: `timeout_s` (None: the client's default) expires with `RolloutTimeout` naming the request, its
  replica and what it waited for; a replica that died fails its requests with `ReplicaDied` naming it, in seconds.
- Cancelling the awaiting coroutine aborts the request on its engine (no request is left in flight).
- A request in flight across a weight push keeps its tokens: the push pauses the engine, the request continues on the
  new weights, and `Completion.versions` records per token the version that sampled it.

Nothing here imports vLLM, Ray or the HTTP stack.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, Sequence

from megarl.rollout.engine import GenerationOutput, GenerationRequest


class RolloutTimeout(TimeoutError):
    """A request (or a wait for one) did not finish within its bound; the message names the request, the replica and
    the bound."""


class RequestDropped(ValueError):
    """The prompt policy dropped a request (rollout.overlong_prompt: drop; its prompt is longer than its
    max_prompt_tokens): it produced no output."""


class ReplicaDied(RuntimeError):
    """A rollout replica stopped answering (its process died or its engine loop failed); the message names it."""


class RolloutClient(Protocol):
    """Request-level, asynchronous access to the rollout engines (see the module docstring)."""

    replicas: int  # engine replicas behind the client

    @property
    def weight_version(self) -> Optional[int]:
        """The version of the weights the engines hold now (0: initial; None before any push)."""
        ...

    async def generate(self, request: GenerationRequest, *, session_id: Optional[str] = None, priority: int = 0,
                       timeout_s: Optional[float] = None) -> GenerationOutput:
        """Run one request to its end and return its finished output. `session_id`: requests of one session go to
        one replica (its prefix cache); None = a session of its own. `priority`: lower runs first where the engine
        has to choose (a batch's stragglers can be ordered or aborted). Raises `RolloutTimeout` / `ReplicaDied`;
        a request the prompt policy dropped raises `RequestDropped` (a ValueError) naming it, one the engine refused a
        `ValueError` with its reason."""
        ...

    async def abort(self, request_ids: Sequence[str]) -> int:
        """Abort requests in flight (their `generate` calls raise `asyncio.CancelledError`); returns how many were."""
        ...

    def metrics(self) -> dict[str, float]:
        """Counters under `rollout/server/...` (requests, tokens, per-replica load, prefix-cache hits where the
        engine reports them)."""
        ...


class WatchedClient:
    """A `RolloutClient` that passes every call to `client` and calls `finished(request, output)` the moment a
    request finishes, on the caller's event loop before the awaiting coroutine resumes (the batch producer scores a
    group there while the rest of the batch generates, `megarl.trainer.producer`). Requests that fail or are aborted
    are not reported."""

    def __init__(self, client: Any, finished: Callable[[GenerationRequest, GenerationOutput], None]) -> None:
        self.client, self.finished = client, finished
        self.replicas = getattr(client, "replicas", 1)

    @property
    def weight_version(self) -> Optional[int]:
        return getattr(self.client, "weight_version", None)

    async def generate(self, request: GenerationRequest, **options: Any) -> GenerationOutput:
        out = await self.client.generate(request, **options)
        self.finished(request, out)
        return out

    async def abort(self, request_ids: Sequence[str]) -> int:
        return await self.client.abort(request_ids)

    def metrics(self) -> dict[str, float]:
        return self.client.metrics()
