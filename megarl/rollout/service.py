"""What the trainer talks to for rollouts: a `RolloutService`, wherever the engines run.

    with service.serving() as client: ...   the request-level path: a `RolloutClient` (a router over the replicas'
                                            request servers) for one phase
    service.push_weights(version)           the actor's weights after update `version` into the engines (0: the
                                            initial weights)

Every schedule (`megarl.trainer.producer.BatchProducer`), validation and the quickstarts' evaluations generate through
`serving()` (`megarl.envs.episode`: one coroutine per episode, single-turn its one-turn case); there is no batch
`generate` at this level (it was deleted with issue 31: one path for every mode).

`ColocatedRollout`: the engines live in the actor's processes (`megarl.workers.HybridWorker`), serve for a phase
(woken at its start, put back to sleep at its end) and a weight push is the local reshard (`sync_weights`).
`PoolRollout`: the engines on a pool of their own, serving for one phase or, in the async schedule, the whole run.

Nothing here imports vLLM, Ray or the controller: a service holds a worker group and calls its methods.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any, Callable, ContextManager, Iterator, Optional, Protocol

logger = logging.getLogger("megarl.rollout")


class RolloutService(Protocol):
    """The rollouts of the synchronous step (see the module docstring)."""

    weight_version: Optional[int]  # the update whose weights the engines hold (0: initial); None before any push

    def push_weights(self, version: int) -> list[dict[str, float]]:
        """Make the engines hold the actor's current weights, those after update `version`; returns each weight
        receiver's metrics (bytes, seconds), in rank order."""
        ...

    def serving(self) -> ContextManager[Any]:
        """A context manager yielding a `megarl.rollout.client.RolloutClient` over every replica: the engines serve
        requests inside it (their tokens labelled with `weight_version`)."""
        ...


class ColocatedRollout:
    """`RolloutService` over the actor pool's `HybridWorker` group (see the module docstring).

    `workers`: the group (its ranks' request servers and `sync_weights` controller method).
    `serving_backend`: what starts and stops the group's request servers (`megarl.controller.serving`, passed by the
    trainer: the controller layer sits above this one); None: `serving` refuses.
    `overlap_phase_ends`: take a phase's start and stop off the controller's critical path (the sync schedule,
    where one thread runs every phase; `megarl.controller.serving.begin_serving`): from the second phase on, the
    start is submitted without waiting (the router built from the first phase's layout) and the stop is submitted
    at the end of the `with` block and collected -- its error raised, naming the phase -- before the next weight
    sync, at the next phase's start, or at `close`. False: every phase starts and stops before `serving` yields /
    returns (`serve_group`)."""

    def __init__(self, workers: Any, serving_backend: Any = None, overlap_phase_ends: bool = False) -> None:
        self.workers = workers
        self.serving_backend = serving_backend
        self.weight_version: Optional[int] = None
        self.overlap_phase_ends = overlap_phase_ends
        self._layout: Optional[list] = None  # each rank's {"replica", "tp_rank"}, from the first phase's start
        self._ending: Any = None  # the ended phase whose start/stop answers are not collected yet

    def serving(self) -> ContextManager[Any]:
        """The request-level path for one phase (`serve_group`): every rank's server starts with its engine woken
        and stops with it put back to sleep (with `overlap_phase_ends`, see the class docstring)."""
        if not self.overlap_phase_ends:
            return serve_group(self.serving_backend, self.workers, self.weight_version)
        return self._overlapped_phase()

    @contextlib.contextmanager
    def _overlapped_phase(self) -> Iterator[Any]:
        backend = _backend(self.serving_backend)
        self.finish_phase("at the next phase's start")
        phase = backend.begin_serving(self.workers, layout=self._layout, weight_version=self.weight_version,
                                      poll_wait_s=SERVE_POLL_WAIT_S)
        self._layout = phase.layout
        try:
            yield phase.router
        except BaseException:
            backend.end_serving(phase)
            backend.finish_serving(phase, "as the phase failed")
            raise
        backend.end_serving(phase)  # every later call on the workers runs after the stop (Ray's order)
        self._ending = phase

    def finish_phase(self, where: str) -> None:
        """Collect the ended phase's start and stop (raising its error, naming the phase and `where`); no-op when
        none is left."""
        phase, self._ending = self._ending, None
        if phase is not None:
            _backend(self.serving_backend).finish_serving(phase, where)

    def push_weights(self, version: int) -> list[dict[str, float]]:
        """The local reshard of every rank (`HybridWorker.sync_weights`); returns each rank's reshard metrics. The
        ended phase's stop is collected first: the sync would run after it on the workers anyway (Ray's order of the
        default concurrency group), and a failed stop then fails the step it ended."""
        return self.submit_push(version)()

    def submit_push(self, version: int) -> Callable[[], list[dict[str, float]]]:
        """`push_weights` submitted without waiting (behind the update the controller submitted before it: the
        workers run one caller's calls in submission order): returns the function that collects the ranks' reshard
        metrics and labels the engines' weights `version`."""
        self.finish_phase("before the weight sync")
        pending = self.workers.sync_weights.submit()

        def collect() -> list[dict[str, float]]:
            metrics = pending.result()  # bounded by the group's heartbeat and call bounds (`PendingCall.result`)
            self.weight_version = version
            return metrics

        return collect

    def close(self) -> None:
        """Collect the last phase's stop (see `overlap_phase_ends`) and raise its error; idempotent. Called while
        another exception is on its way up (a `finally` after a failed step), the stop's error is logged instead:
        the first failure stays the one reported."""
        if sys.exc_info()[0] is None:
            self.finish_phase("at close")
            return
        try:
            self.finish_phase("at close")
        except Exception as e:  # noqa: BLE001 -- the exception in flight is the one to report
            logger.error("ColocatedRollout.close (during another failure): %s", e)


class PoolRollout:
    """`RolloutService` over engines on a pool of their own (`rollout.pool`): a `RolloutWorker` group on the rollout
    pool and the actor pool's `ActorWorker` group, joined by the bridge (`megarl.controller.bridge`).

    serving: a router over the rollout pool's replicas (`serve_group`) for one phase, or the async schedule's whole run.
    push_weights: every actor rank sends and every rollout rank receives (`ActorWorker.send_weights`,
        `RolloutWorker.receive_weights`, both submitted before either is waited on: the transfers pair up across
        the groups); returns [summary] + the actor ranks' metrics + the rollout ranks' metrics, the summary
        holding what the trainer logs (`reshard/...` of the first rollout rank, the sync's seconds = the slowest
        rank's) and the pool's figures under `reshard/pool/`: bytes sent max/mean over the actor ranks, received
        max/mean over the rollout ranks (each rank's too), the rollout ranks' lower bound, and `verified` = 1 when
        every rollout rank checked every piece the plan routes into it.
    Serving (`start_serving` .. `stop_serving`, the async schedule's whole run): every rollout rank runs its request
        server (`megarl.rollout.engine_server`) and `client` is a `RolloutRouter` over the replicas, and `push_weights`
        lands as a server op at a round boundary of every rollout rank (`RolloutWorker.serve_receive_weights`:
        pause(keep), receive, label the version, resume): the requests in flight keep their tokens and continue on the
        new weights, each token recording its version. The summary then also holds `reshard/pool/continued_requests`:
        requests in the engines across the push, summed over the replicas.
    """

    def __init__(self, actor_workers: Any, rollout_workers: Any, push_timeout_s: float = 1800.0,
                 serving_backend: Any = None) -> None:
        self.serving_backend = serving_backend  # as ColocatedRollout's
        self.actor_workers = actor_workers
        self.workers = rollout_workers
        self.weight_version: Optional[int] = None
        self.client = None  # the RolloutRouter while serving
        self.push_timeout_s = push_timeout_s

    def start_serving(self, **server_options: Any):
        """Start every rollout rank's request server at the engines' weights version; returns the `RolloutRouter`
        (also `self.client`). `server_options`: `RolloutHost.start_server`'s (round_steps, step_delay_s)."""
        if self.client is not None:
            raise RuntimeError("PoolRollout.start_serving: the rollout pool is already serving")
        self.client = _backend(self.serving_backend).start_serving(
            self.workers, weight_version=self.weight_version or 0, **server_options)
        return self.client

    def stop_serving(self) -> list[dict[str, float]]:
        """Close the router and stop every rank's server (requests in flight are aborted); idempotent."""
        client, self.client = self.client, None
        return [] if client is None else _backend(self.serving_backend).stop_serving(self.workers, client)

    def serving(self) -> ContextManager[Any]:
        """The request-level path for one phase over the rollout pool's replicas (`serve_group`); while the pool
        already serves (the async schedule), its router, left serving at the end."""
        if self.client is not None:
            return contextlib.nullcontext(self.client)
        return serve_group(self.serving_backend, self.workers, self.weight_version)

    def push_weights(self, version: int) -> list[dict[str, float]]:
        sending = self.actor_workers.send_weights.submit(version)
        if self.client is None:
            receiving = self.workers.receive_weights.submit(version)
        else:  # a server op at a round boundary of every rank: pause(keep) -> receive -> resume
            receiving = self.workers.serve_receive_weights.submit(version, self.push_timeout_s)
        sent, received = sending.result(), receiving.result()
        self.weight_version = version
        if self.client is not None:
            self.client.weight_version = version
        summary = pool_sync_summary(sent, received)
        if self.client is not None:
            summary["reshard/pool/continued_requests"] = float(sum(m.get("reshard/continued_requests", 0.0)
                                                                   for m in received if m.get("reshard/tp_rank") == 0))
        return [summary] + list(sent) + list(received)


# Seconds one long-poll of a replica waits for results in `serve_group` (it answers at once when one is ready, and a
# server being stopped answers its poll in flight at once: `stop_serving` tells the router's collectors to end first).
# So the end of a phase does not wait for it and it can be long: each empty poll is a Ray round trip on the
# controller and the rollout rank while the engines generate (0.05 s gave ~4 of them a step at the 0.6M-parameter
# `benchmarks/vs_trl.py` size, whose generation takes ~0.12 s).
SERVE_POLL_WAIT_S = 0.5


@contextlib.contextmanager
def serve_group(backend: Any, group: Any, weight_version: Optional[int]) -> Iterator[Any]:
    """Serve through `group`'s engines for the `with` block: every rank's request server started
    (`megarl.controller.serving.start_serving`, the engines' tokens labelled `weight_version`), a `RolloutRouter`
    over the replicas yielded, and at the end the router closed and every server stopped (requests still in flight
    aborted; a colocated engine goes back to sleep)."""
    backend = _backend(backend)
    router = backend.start_serving(group, weight_version=weight_version, poll_wait_s=SERVE_POLL_WAIT_S)
    try:
        yield router
    finally:
        backend.stop_serving(group, router)


def _backend(backend: Any) -> Any:
    if backend is None:
        raise RuntimeError("this rollout service was built without a serving backend (serving_backend="
                           "megarl.controller.serving, which the trainer passes): it cannot start request servers")
    return backend


def pool_sync_summary(sent: list[dict[str, float]], received: list[dict[str, float]]) -> dict[str, float]:
    """One sync across pools as metrics (see `PoolRollout`): `sent` = the actor ranks' reports in rank order,
    `received` = the rollout ranks'."""
    out = {k: v for k, v in received[0].items() if k.startswith("reshard/")}
    out["reshard/time_s"] = max(m["reshard/time_s"] for m in list(sent) + list(received))
    out["offload/actor_bytes"] = sent[0].get("offload/actor_bytes", 0.0)
    s = [m["reshard/bytes_sent"] for m in sent]
    r = [m["reshard/bytes_received"] for m in received]
    pool = {"sent_max_bytes": max(s), "sent_mean_bytes": sum(s) / len(s),
            "received_max_bytes": max(r), "received_mean_bytes": sum(r) / len(r),
            "lower_bound_bytes": sum(m["reshard/bytes_lower_bound"] for m in received),
            "verified": float(all(m["reshard/verified_pieces"] == m["reshard/planned_pieces"] > 0 for m in received))}
    pool.update({f"sent_bytes_rank{i}": v for i, v in enumerate(s)})
    pool.update({f"received_bytes_rank{i}": v for i, v in enumerate(r)})
    out.update({f"reshard/pool/{k}": float(v) for k, v in pool.items()})
    return out
