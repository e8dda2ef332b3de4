"""`RolloutRouter`: the controller's `RolloutClient` over the request servers of every rollout replica.

    router = megarl.controller.serving.start_serving(rollout_group)        # every replica's EngineServer + a router
    out = await router.generate(GenerationRequest(...), session_id=episode_uid)

Routing: a request of a new session goes to the least-loaded live replica (requests in flight; ties: the lowest
index); every later request of that session goes to the same replica, whose prefix cache still holds the session's
earlier turns (a session whose replica died fails with `ReplicaDied`: its cache is gone with it and the run stops).
`session_id=None`: a session of its own (least-loaded, not remembered). `sticky_sessions=False` routes every request
as a new session (least-loaded, nothing remembered): the comparison without stickiness (benchmarks/prefix_cache.py).
`priority` travels with the request: requests reaching a replica in the same round enter its engine lowest value
first (`megarl.rollout.engine_server`). The requests made in one turn of the caller's event loop (e.g. a single-turn
batch started with `gather`) go to each replica as one submit and enter its engine in the same round, in the order
they were made.

Results: one collector thread per replica long-polls it (`ReplicaHandle.poll(max_wait_s)`, a bounded wait) and
resolves the waiting coroutines' futures on their event loops (`call_soon_threadsafe`). A replica whose poll raises
(its actor died: Ray raises; or it did not answer within the poll's bound) is dead: every request on it fails with
`ReplicaDied` naming it within one poll, and new sessions avoid it.

Nothing here imports Ray: a replica is a `ReplicaHandle` (`megarl.controller.serving.RayReplica` over a worker
group's rank; an in-process one over an `EngineServer` for tests and benchmarks).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
from typing import Any, Optional, Protocol, Sequence

from megarl.rollout.client import ReplicaDied, RolloutTimeout
from megarl.rollout.engine import GenerationOutput, GenerationRequest
from megarl.rollout.engine_server import RequestResult, settle_future

logger = logging.getLogger("megarl.rollout")


class ReplicaHandle(Protocol):
    """How the router reaches one replica's request server (its first TP rank)."""

    name: str  # "replica 1 (rank 2)": what messages name

    def submit(self, entries: Sequence[tuple[GenerationRequest, int]]) -> None:
        """Queue (request, priority) pairs without waiting; problems surface through `poll`."""
        ...

    def abort(self, request_ids: Sequence[str]) -> None:
        """Queue an abort without waiting; the aborted requests are answered `aborted` through `poll`."""
        ...

    def poll(self, max_wait_s: float) -> dict[str, Any]:
        """{"results": [RequestResult], "metrics": {...}} answered since the last poll, waiting up to `max_wait_s`
        for one; raises `ReplicaDied` naming the replica when it is gone or does not answer within its bound."""
        ...


@dataclasses.dataclass
class _Waiter:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    replica: int


class RolloutRouter:
    """`RolloutClient` over several replicas (see the module docstring).

    replicas: one handle per replica, in replica order. default_timeout_s: the bound of a `generate` whose
    `timeout_s` is None (seconds). poll_wait_s: how long one long-poll waits for results (a dead replica is noticed
    within about this plus the handle's own bound). weight_version: the engines' weights version (set by pushes).
    sticky_sessions: True (the default): a session's later requests go to the replica of its first; False: every
    request goes to the least-loaded live replica, whatever its session (for measuring what stickiness buys: the
    prefix-cache hit rate of multi-turn sessions, benchmarks/prefix_cache.py)."""

    def __init__(self, replicas: Sequence[ReplicaHandle], *, default_timeout_s: float = 600.0,
                 poll_wait_s: float = 0.5, weight_version: Optional[int] = 0, sticky_sessions: bool = True) -> None:
        if not replicas:
            raise ValueError("RolloutRouter: no replicas to route to")
        self._handles = list(replicas)
        self.replicas = len(self._handles)
        self.default_timeout_s = default_timeout_s
        self.poll_wait_s = poll_wait_s
        self.sticky_sessions = sticky_sessions
        self._weight_version = weight_version
        self._lock = threading.Lock()
        self._sessions: dict[str, int] = {}  # session id -> replica
        self._load = [0] * self.replicas  # requests in flight per replica
        self._waiters: dict[str, _Waiter] = {}  # request id -> who awaits it
        self._dead: dict[int, str] = {}  # replica -> why
        self._server_metrics: list[dict[str, float]] = [{} for _ in self._handles]
        self.counts: collections.Counter = collections.Counter(
            requests=0, finished=0, aborted=0, failed=0, tokens=0, sessions=0)
        self.routed: collections.Counter = collections.Counter()  # replica -> requests routed to it
        self._outbox: dict[int, list] = collections.defaultdict(list)  # replica -> (request, priority) to send
        self._flush_scheduled = False
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._collect, args=(i,), name=f"megarl-router-{i}", daemon=True)
                         for i in range(self.replicas)]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------------------------------- client protocol
    @property
    def weight_version(self) -> Optional[int]:
        return self._weight_version

    @weight_version.setter
    def weight_version(self, version: Optional[int]) -> None:
        self._weight_version = version

    def replica_of(self, session_id: str) -> Optional[int]:
        """The replica a session is bound to (None: no request of it yet)."""
        with self._lock:
            return self._sessions.get(session_id)

    def forget_session(self, session_id: str) -> None:
        """Drop a finished session's binding (its next request, if any, is routed as a new session)."""
        with self._lock:
            self._sessions.pop(session_id, None)

    async def generate(self, request: GenerationRequest, *, session_id: Optional[str] = None, priority: int = 0,
                       timeout_s: Optional[float] = None) -> GenerationOutput:
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        rid = request.request_id
        with self._lock:
            if self._stop.is_set():  # the phase ended: no collector would deliver it (it would wait out its bound)
                raise ReplicaDied(f"request {rid!r}: the router is closed (its serving phase ended); no replica "
                                  "takes requests until the next phase's router starts")
            if rid in self._waiters:
                raise ValueError(f"RolloutRouter: request id {rid!r} is already in flight; request ids must be "
                                 "unique among the requests in flight")
            replica = self._pick(session_id)
            self._waiters[rid] = _Waiter(loop, future, replica)
            self._load[replica] += 1
            self.counts["requests"] += 1
            self.routed[replica] += 1
        handle = self._handles[replica]
        self._queue_submit(loop, replica, request, priority)
        bound = self.default_timeout_s if timeout_s is None else timeout_s
        try:
            return await asyncio.wait_for(future, bound)
        except asyncio.TimeoutError:
            self._release(rid)
            self._abort_quietly(replica, [rid])
            raise RolloutTimeout(f"request {rid!r} on {handle.name}: no finished output within {bound} s (waited "
                                 "for the engine to finish generating it; aborted)") from None
        except asyncio.CancelledError:
            if self._release(rid) is not None:
                self._abort_quietly(replica, [rid])
            raise

    async def abort(self, request_ids: Sequence[str]) -> int:
        by_replica: dict[int, list[str]] = collections.defaultdict(list)
        with self._lock:
            for rid in request_ids:
                w = self._waiters.get(rid)
                if w is not None:
                    by_replica[w.replica].append(rid)
        for replica, ids in by_replica.items():
            self._abort_quietly(replica, ids)
        return sum(len(v) for v in by_replica.values())

    def metrics(self) -> dict[str, float]:
        """`rollout/server/...`: requests routed, finished, aborted, failed, tokens generated, sessions bound, the
        requests in flight (all and per replica), dead replicas, the requests each replica's engine took
        (`submitted/replica_i`, its server's count at the last poll), the engines' counters summed over replicas
        (`engine_steps`, `engine_rounds`, `round_broadcasts`) and vLLM's prefix-cache lookups (`prefix_cache_queries`
        / `_hits`: prompt tokens looked up / found cached, `prefix_cache_hit_rate` = hits / queries, per replica
        `prefix_cache_hits/replica_i`; counted over the engines' lives)."""
        with self._lock:
            out = {f"rollout/server/{k}": float(v) for k, v in self.counts.items()}
            out["rollout/server/in_flight"] = float(sum(self._load))
            for i, n in enumerate(self._load):
                out[f"rollout/server/in_flight/replica_{i}"] = float(n)
            out["rollout/server/replicas_dead"] = float(len(self._dead))
            for key, name in (("steps", "engine_steps"), ("rounds", "engine_rounds"),
                              ("broadcasts", "round_broadcasts")):
                out[f"rollout/server/{name}"] = float(sum(m.get(key, 0.0) for m in self._server_metrics))
            for i, m in enumerate(self._server_metrics):  # what each engine took (its server's count)
                out[f"rollout/server/submitted/replica_{i}"] = float(m.get("submitted", 0.0))
                out[f"rollout/server/prefix_cache_hits/replica_{i}"] = float(m.get("prefix_cache_hits", 0.0))
            queries = sum(m.get("prefix_cache_queries", 0.0) for m in self._server_metrics)
            hits = sum(m.get("prefix_cache_hits", 0.0) for m in self._server_metrics)
            out["rollout/server/prefix_cache_queries"] = float(queries)
            out["rollout/server/prefix_cache_hits"] = float(hits)
            out["rollout/server/prefix_cache_hit_rate"] = hits / queries if queries else 0.0
        return out

    def begin_close(self) -> None:
        """Let the collector threads end after the long-poll each has in flight, without waiting for them (`close`
        waits). A caller that stops the replicas' servers next (`megarl.controller.serving.stop_serving`) calls this
        first: a stopping server answers its poll at once, so `close` then returns without a poll's wait."""
        self._stop.set()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the collector threads (each within one poll); requests still awaited fail with `ReplicaDied`."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout_s)
        alive = [t.name for t in self._threads if t.is_alive()]
        with self._lock:
            left = list(self._waiters)
        for rid in left:
            w = self._release(rid)
            if w is not None:
                _fail(w, ReplicaDied(f"request {rid!r}: the router was closed while it was in flight"))
        if alive:
            raise TimeoutError(f"RolloutRouter.close: collector threads {alive} did not end within {timeout_s} s "
                               "(each waits for one long-poll)")

    # ------------------------------------------------------------------------------------------- internals
    def _pick(self, session_id: Optional[str]) -> int:
        """The replica of a request (under the lock): its session's, or the least-loaded live one."""
        if not self.sticky_sessions:
            session_id = None
        if session_id is not None and session_id in self._sessions:
            replica = self._sessions[session_id]
            if replica in self._dead:
                raise ReplicaDied(f"session {session_id!r} is bound to {self._handles[replica].name}, which died: "
                                  f"{self._dead[replica]}")
            return replica
        live = [i for i in range(self.replicas) if i not in self._dead]
        if not live:
            raise ReplicaDied("every rollout replica died: " + "; ".join(self._dead.values()))
        replica = min(live, key=lambda i: (self._load[i], i))
        if session_id is not None:
            self._sessions[session_id] = replica
            self.counts["sessions"] += 1
        return replica

    def _queue_submit(self, loop: asyncio.AbstractEventLoop, replica: int, request: GenerationRequest,
                      priority: int) -> None:
        """Put a request into its replica's outbox; the outboxes go out at the event loop's next turn, one
        `submit` per replica: the requests of every coroutine that submitted in the same turn (a single-turn batch
        started with `gather`) reach the replica in one call and enter its engine in the same round, in the order
        they were made -- as a batch `generate` adds its prompts."""
        with self._lock:
            self._outbox[replica].append((request, priority))
            first = not self._flush_scheduled
            self._flush_scheduled = True
        if first:
            loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Send every outbox (see `_queue_submit`); a replica whose submit raises fails the requests sent to it."""
        with self._lock:
            boxes, self._outbox = self._outbox, collections.defaultdict(list)
            self._flush_scheduled = False
            # a request cancelled or timed out before its turn came is not sent at all
            boxes = {r: [e for e in entries if e[0].request_id in self._waiters] for r, entries in boxes.items()}
        for replica, entries in boxes.items():
            if not entries:
                continue
            try:
                self._handles[replica].submit(entries)
            except Exception as e:  # noqa: BLE001 -- each request's caller gets the failure
                for request, _ in entries:
                    w = self._release(request.request_id)
                    if w is not None:
                        _fail(w, ReplicaDied(f"request {request.request_id!r}: its submit to "
                                             f"{self._handles[replica].name} failed: {e!r}"))

    def _has_waiters(self, replica: int) -> bool:
        with self._lock:
            return self._load[replica] > 0

    def _release(self, rid: str) -> Optional[_Waiter]:
        with self._lock:
            w = self._waiters.pop(rid, None)
            if w is not None:
                self._load[w.replica] -= 1
        return w

    def _abort_quietly(self, replica: int, ids: list[str]) -> None:
        if replica in self._dead:
            return
        try:
            self._handles[replica].abort(ids)
        except Exception as e:  # the replica is going away: its collector reports it
            logger.warning("RolloutRouter: abort of %s on %s failed: %r", ids, self._handles[replica].name, e)

    def _collect(self, replica: int) -> None:
        handle = self._handles[replica]
        while not self._stop.is_set():
            try:
                got = handle.poll(self.poll_wait_s)
            except Exception as e:  # noqa: BLE001 -- any failure of the long-poll ends the replica
                if self._stop.is_set() and not self._has_waiters(replica):  # its server stopped under a last poll
                    return  # (the end of a serving phase: `begin_close`, then the servers stop)
                if isinstance(e, ReplicaDied):
                    self._replica_died(replica, str(e))
                    return
                self._replica_died(replica, f"{handle.name}: its long-poll failed: {e!r}")
                return
            self._server_metrics[replica] = dict(got.get("metrics", {}))
            for result in got["results"]:
                self._deliver(result)

    def _deliver(self, result: RequestResult) -> None:
        w = self._release(result.request_id)
        if w is None:  # timed out or cancelled meanwhile
            return
        with self._lock:
            if result.status == "finished":
                self.counts["finished"] += 1
                self.counts["tokens"] += sum(len(c.token_ids) for c in result.output.completions)
            elif result.status == "aborted":
                self.counts["aborted"] += 1
            else:
                self.counts["failed"] += 1
        if result.status == "died":
            result = dataclasses.replace(result, error=f"{self._handles[w.replica].name}: {result.error}")
        try:
            w.loop.call_soon_threadsafe(settle_future, w.future, result)
        except RuntimeError:  # the caller's loop closed
            pass

    def _replica_died(self, replica: int, why: str) -> None:
        name = self._handles[replica].name
        message = why if name in why else f"{name}: {why}"
        logger.error("RolloutRouter: %s", message)
        with self._lock:
            self._dead[replica] = message
            ids = [rid for rid, w in self._waiters.items() if w.replica == replica]
        for rid in ids:
            w = self._release(rid)
            if w is not None:
                self.counts["failed"] += 1
                _fail(w, ReplicaDied(f"request {rid!r}: {message}"))


def _fail(waiter: _Waiter, error: BaseException) -> None:
    def set_error(fut: asyncio.Future = waiter.future) -> None:
        if not fut.done():
            fut.set_exception(error)

    try:
        waiter.loop.call_soon_threadsafe(set_error)
    except RuntimeError:  # the caller's loop closed
        pass
