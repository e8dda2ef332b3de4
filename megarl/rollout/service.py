"""What the trainer talks to for rollouts: a `RolloutService`, wherever the engines run.

    service.generate(prompts, sampling) -> RolloutSamples   the synchronous step: n samples per prompt, in order
    service.push_weights(version)                            the actor's weights after update `version` into the
                                                             engines (0: the initial weights)
    service.submit_generate(prompts, sampling) -> PendingRollout   `generate` without waiting (the one_step_off and
                                                             async schedules, `megarl.trainer.schedule`)
    with service.serving() as client: ...                    the request-level path: a `RolloutClient` (a router
                                                             over the replicas' request servers) for one phase

The synchronous step, validation, the async schedule and the quickstarts' evaluations generate through `serving()`
(`megarl.envs.episode`: one coroutine per episode, single-turn its one-turn case); the batch `submit_generate` stays
for the one_step_off schedule.

`ColocatedRollout` is today's shape: the engines live in the actor's processes (`megarl.workers.HybridWorker`), the
step's prompts are split over the engine replicas by the controller (DP_SPLIT by `rollout_replica`) and a weight push
is the local reshard (`sync_weights`). It adds nothing to the data path: its samples are exactly the workers'.

`RequestRolloutService` adds the request-level calls a rollout pool and the asynchronous schedules need
(`submit` / `collect` / `pause` / `resume`), over the engines' request API (`megarl.rollout.engine.RolloutEngine`:
per-request ids, sampling settings and seeds). The colocated service does not offer them: its engines share the
devices with training and sleep between rollouts.

Nothing here imports vLLM, Ray or the controller: a service holds a worker group and calls its methods.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterator, Optional, Protocol, Sequence

from megarl.rollout.engine import GenerationOutput, GenerationRequest, RolloutSamples, SamplingSettings


class RolloutService(Protocol):
    """The rollouts of the synchronous step (see the module docstring)."""

    weight_version: Optional[int]  # the update whose weights the engines hold (0: initial); None before any push

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> RolloutSamples:
        """`sampling.samples_per_prompt` samples for each of `prompts` (token ids), ordered by (prompt_index,
        sample_index) with prompt indices into `prompts`; the prompts the length policy dropped or truncated in
        `dropped_prompt_indices` / `truncated_prompt_indices`."""
        ...

    def push_weights(self, version: int) -> list[dict[str, float]]:
        """Make the engines hold the actor's current weights, those after update `version`; returns each weight
        receiver's metrics (bytes, seconds), in rank order."""
        ...

    def serving(self) -> ContextManager[Any]:
        """A context manager yielding a `megarl.rollout.client.RolloutClient` over every replica: the engines serve
        requests inside it (their tokens labelled with `weight_version`) and no batch `generate` may run."""
        ...


class PendingRollout:
    """A `generate` submitted to the engines and not yet waited on (`submit_generate`): the schedules of
    `megarl.trainer.schedule` run it beside training. `result()` waits (bounded by the worker group's call timeout,
    naming the call) and returns the merged `RolloutSamples` with `generate_s` = seconds from submit to result."""

    def __init__(self, pending: Any, n_prompts: int) -> None:
        import time

        self._pending, self._n = pending, n_prompts
        self._submitted = time.perf_counter()
        self._result: Optional[RolloutSamples] = None
        self.generate_s: Optional[float] = None

    def done(self) -> bool:
        """Whether every engine rank has answered (without waiting)."""
        return self._result is not None or self._pending.done()

    def result(self) -> RolloutSamples:
        import time

        if self._result is None:
            self._result = _merged(self._pending.result(), self._n)
            self.generate_s = time.perf_counter() - self._submitted
        return self._result


class RequestRolloutService(RolloutService, Protocol):
    """A service that also takes requests one by one (a rollout pool; the asynchronous schedules). Signatures only:
    the pool and async issues implement them."""

    def submit(self, requests: Sequence[GenerationRequest]) -> list[str]:
        """Queue requests (each its own id, prompt ids, sampling settings and seed index) on the engines; returns
        the ids dropped by the prompt policy."""
        ...

    def collect(self, n: int, max_staleness: Optional[int] = None) -> list[GenerationOutput]:
        """Wait for `n` finished requests generated with weights at most `max_staleness` versions behind the
        newest pushed (None: any); returns them in finishing order."""
        ...

    def pause(self) -> None:
        """Hold generation on every engine (requests stay in flight), e.g. around a weight push."""
        ...

    def resume(self) -> None:
        """Let the engines generate again."""
        ...


class ColocatedRollout:
    """`RolloutService` over the actor pool's `HybridWorker` group (see the module docstring).

    `workers`: the group (any object with the group's `generate` and `sync_weights` controller methods).
    `serving_backend`: what starts and stops the group's request servers (`megarl.controller.serving`, passed by the
    trainer: the controller layer sits above this one); None: `serving` refuses."""

    def __init__(self, workers: Any, serving_backend: Any = None) -> None:
        self.workers = workers
        self.serving_backend = serving_backend
        self.weight_version: Optional[int] = None

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> RolloutSamples:
        """`RolloutService.generate` through the group's DP_SPLIT `generate`: replica k samples the k-th contiguous
        chunk of `prompts`; its local prompt indices are shifted by the sizes of the chunks before it."""
        return _merged(self.workers.generate(prompts, sampling), len(prompts))  # one result per replica

    def submit_generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> PendingRollout:
        """`generate` without waiting: the engines start on it and the caller goes on (one_step_off). The group's
        next calls (the roles' forwards and updates, on the same processes) queue behind it."""
        return PendingRollout(self.workers.generate.submit(prompts, sampling), len(prompts))

    def serving(self) -> ContextManager[Any]:
        """The request-level path for one phase (`serve_group`): every rank's server starts with its engine woken
        and stops with it put back to sleep, as `generate` wakes and sleeps it."""
        return serve_group(self.serving_backend, self.workers, self.weight_version)

    def push_weights(self, version: int) -> list[dict[str, float]]:
        """The local reshard of every rank (`HybridWorker.sync_weights`); returns each rank's reshard metrics."""
        metrics = self.workers.sync_weights()
        self.weight_version = version
        return metrics


class PoolRollout:
    """`RolloutService` over engines on a pool of their own (`rollout.pool`): a `RolloutWorker` group on the rollout
    pool and the actor pool's `ActorWorker` group, joined by the bridge (`megarl.controller.bridge`).

    generate: DP_SPLIT over the rollout pool's replicas, merged exactly as `ColocatedRollout` merges them.
    push_weights: every actor rank sends and every rollout rank receives (`ActorWorker.send_weights`,
        `RolloutWorker.receive_weights`, both submitted before either is waited on: the transfers pair up across
        the groups); returns [summary] + the actor ranks' metrics + the rollout ranks' metrics, the summary
        holding what the trainer logs (`reshard/...` of the first rollout rank, the sync's seconds = the slowest
        rank's) and the pool's figures under `reshard/pool/`: bytes sent max/mean over the actor ranks, received
        max/mean over the rollout ranks (each rank's too), the rollout ranks' lower bound, and `verified` = 1 when
        every rollout rank checked every piece the plan routes into it.
    Serving (`start_serving` .. `stop_serving`, the async schedule's whole run): every rollout rank runs its request
        server (`megarl.rollout.engine_server`) and `client` is a `RolloutRouter` over the replicas. `generate` then
        goes through the router (`megarl.envs.episode.run_single_turn`: one request per prompt, the batch path's
        seeds), and `push_weights` lands as a server op at a round boundary of every rollout rank
        (`RolloutWorker.serve_receive_weights`: pause(keep), receive, label the version, resume): the requests in
        flight keep their tokens and continue on the new weights, each token recording its version. The summary
        then also holds `reshard/pool/continued_requests`: requests in the engines across the push, summed over
        the replicas.
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

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> RolloutSamples:
        """`RolloutService.generate` through the rollout pool's DP_SPLIT `generate` (replica k: the k-th chunk); while
        the pool serves, generation goes through `serving()`'s router instead."""
        if self.client is not None:
            raise RuntimeError("PoolRollout.generate: the rollout pool is serving requests (the async schedule); "
                               "generate through `with service.serving() as client` instead")
        return _merged(self.workers.generate(prompts, sampling), len(prompts))

    def submit_generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> PendingRollout:
        """`generate` without waiting: the rollout pool generates while the actor pool trains."""
        return PendingRollout(self.workers.generate.submit(prompts, sampling), len(prompts))

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


# Seconds one long-poll of a replica waits for results in `serve_group` (it answers at once when one is ready): the
# end of a phase waits for the poll in progress to return, so it is kept short (0.5 s added ~0.4 s to every step of
# the quickstart, whose rollout takes ~0.3 s).
SERVE_POLL_WAIT_S = 0.05


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


def _merged(per_replica: list[dict], n_prompts: int) -> RolloutSamples:
    """The replicas' results (in replica order; replica k sampled the k-th contiguous chunk) as one `RolloutSamples`:
    local prompt indices shifted by the sizes of the chunks before them, ordered by (prompt_index, sample_index);
    `generate_s` = the slowest replica's seconds in its engine."""
    samples, dropped, truncated = [], [], []
    lo = 0
    for out in per_replica:
        samples.extend(_shifted(s, lo) for s in out["samples"])
        dropped.extend(lo + i for i in out["dropped"])
        truncated.extend(lo + i for i in out["truncated"])
        lo += out["prompts"]
    if lo != n_prompts:
        raise RuntimeError(f"the rollout replicas report {lo} prompts for the {n_prompts} sent")
    samples.sort(key=lambda s: (s.prompt_index, s.sample_index))
    out = RolloutSamples(samples, dropped_prompt_indices=dropped, truncated_prompt_indices=truncated)
    out.generate_s = max((r.get("seconds", 0.0) for r in per_replica), default=0.0)  # the slowest replica's
    return out


def _shifted(sample, offset: int):
    import dataclasses

    return dataclasses.replace(sample, prompt_index=offset + sample.prompt_index)
