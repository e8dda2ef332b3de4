"""The request-level rollout path on Ray: the rollout worker group's engines as servers, a router over them.

    router = start_serving(rollout_group)      # every rank: RolloutHost.start_server; a RolloutRouter over the leaders
    ...  await router.generate(request, session_id=...)  ...
    stop_serving(rollout_group, router)        # the router's collectors, then every rank's server (colocated: sleep)

A replica is reached through its first TP rank alone (`WorkerGroup.rank_call`, in the actors' serve concurrency
group, beside the worker thread): `RayReplica.submit`/`abort` send without waiting; `poll` is the bounded long-poll
(`RolloutHost.server_poll`), the one place a dead replica shows: Ray raises `RayActorError` for a call on an actor
whose process died, which becomes `ReplicaDied` naming the replica and its rank.

A phase off the critical path (`begin_serving` .. `end_serving` .. `finish_serving`; the sync schedule's colocated
phases, `megarl.rollout.service.ColocatedRollout`): each phase gets an id (increasing over the run).
- `begin_serving` submits every rank's `start_server(phase=id)` without waiting and builds the router from the
  layout the group's earlier phase reported (`start_server`'s {"replica", "tp_rank"} per rank; a layout is fixed for
  a group's life); a replica's collector waits for its ranks' start answers (within `START_WAIT_S`) before its first
  long-poll and checks each against that layout, so a start that failed or disagrees fails the replica's requests
  (`ReplicaDied` naming the phase). A submit may still reach a rank before its start ran (the serve concurrency
  group is not ordered against the worker thread): it names the phase and waits for that phase's server there
  (`RolloutHost._serving`, bounded by `START_WAIT_S`).
- `end_serving` tells the collectors to end and submits every rank's `stop_server` without waiting. What makes this
  safe: Ray runs one caller's calls to an actor on one concurrency group (here the default one, the worker thread)
  in submission order, so every later role call of the controller on those workers (the reference's log-probs, the
  update, the weight sync) starts only after `stop_server` returned there -- after the engine loop was joined and the
  engine put back to sleep; the engine thread never runs beside a role call
  (tests/distributed/test_rollout_router.py checks this order on the workers).
- `finish_serving` collects the start's and the stop's answers (raising the first error, naming the phase and where
  it was collected) and joins the router's collectors: called before the next call that needs the engine asleep
  and in order anyway (the weight sync), at the next phase's start and at close, so a failed stop still fails the
  step it ended.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from typing import Any, Optional, Sequence

from megarl.rollout.client import ReplicaDied
from megarl.rollout.engine import GenerationRequest
from megarl.rollout.router import RolloutRouter


class RayReplica:
    """`ReplicaHandle` over rank `rank` (a replica's tp_rank 0) of a worker group whose workers are `RolloutHost`s.

    poll_slack_s: how much longer than its `max_wait_s` a long-poll may take to answer before the replica counts as
    dead (a frozen process; a dead one raises at once). `followers`: the replica's other TP ranks; each poll also
    checks them (`RolloutHost.server_alive`, one check in flight per rank): a follower that died leaves the leader's
    engine waiting in a collective, still answering its polls, so without this the replica's requests would wait out
    their timeout instead of failing in seconds."""

    def __init__(self, group: Any, rank: int, name: str, *, poll_slack_s: float = 30.0,
                 followers: Sequence[int] = (), phase: Optional[int] = None,
                 starts: Optional[dict[int, tuple[Any, dict]]] = None, start_wait_s: float = 0.0) -> None:
        """`phase`: the serving phase's id, passed with every per-rank call (None: a phase without one). `starts`:
        rank -> (the ref of its `start_server` call in flight, the {"replica", "tp_rank"} it must answer) for this
        replica's ranks, awaited (within `start_wait_s`) before the first long-poll; None: started already."""
        self.group, self.rank, self.name = group, rank, name
        self.poll_slack_s = poll_slack_s
        self.followers = list(followers)
        self.phase = phase
        self._starts = dict(starts or {})
        self.start_wait_s = start_wait_s
        self._phase_kwargs = {} if phase is None else {"phase": phase, "start_wait_s": start_wait_s}
        self._checks: dict[int, Any] = {}  # follower rank -> its server_alive ref in flight
        self._sent: list = []  # refs of submits/aborts not yet checked
        self._lock = threading.Lock()

    def submit(self, entries: Sequence[tuple[GenerationRequest, int]]) -> None:
        ref = self.group.rank_call(self.rank, "server_submit", list(entries), **self._phase_kwargs)
        with self._lock:
            self._sent.append(("server_submit", ref))

    def abort(self, request_ids: Sequence[str]) -> None:
        ref = self.group.rank_call(self.rank, "server_abort", list(request_ids), **self._phase_kwargs)
        with self._lock:
            self._sent.append(("server_abort", ref))

    def poll(self, max_wait_s: float) -> dict[str, Any]:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        bound = max_wait_s + self.poll_slack_s
        self._confirm_started()
        self._check_followers()
        try:
            self._check_sent()
            got = ray.get(self.group.rank_call(self.rank, "server_poll", max_wait_s, **self._phase_kwargs),
                          timeout=bound)
        except RayActorError as e:
            raise ReplicaDied(f"{self.name}: its actor died ({type(e).__name__}: {str(e).splitlines()[0]})") from None
        except GetTimeoutError:
            raise ReplicaDied(f"{self.name}: a long-poll of {max_wait_s} s got no answer within {bound} s (a frozen "
                              "or unreachable process)") from None
        except RayTaskError as e:
            raise ReplicaDied(f"{self.name}: its server failed: {str(e).splitlines()[-1]}") from None
        if not got["alive"]:
            raise ReplicaDied(f"{self.name}: its engine loop stopped: {got['error']}")
        return got

    def _confirm_started(self) -> None:
        """Wait for the `start_server` answers of this replica's ranks (once; each within `start_wait_s`); raise
        `ReplicaDied` naming the phase and rank when one failed, did not answer, or reports another place in the
        layout than the one the router was built on."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        phase = f"serving phase {self.phase}"
        for rank, (ref, expected) in sorted(self._starts.items()):
            try:
                got = ray.get(ref, timeout=self.start_wait_s)
            except GetTimeoutError:
                raise ReplicaDied(f"{self.name}: start_server of {phase} on rank {rank} did not answer within "
                                  f"{self.start_wait_s:g} s") from None
            except RayActorError as e:
                raise ReplicaDied(f"{self.name}: the actor of rank {rank} died before start_server of {phase} "
                                  f"answered ({type(e).__name__}: {str(e).splitlines()[0]})") from None
            except RayTaskError as e:
                raise ReplicaDied(f"{self.name}: start_server of {phase} failed on rank {rank}: "
                                  f"{str(e).splitlines()[-1]}") from None
            if dict(got) != dict(expected):
                raise ReplicaDied(f"{self.name}: start_server of {phase} on rank {rank} answered {got}, but the "
                                  f"router was built for {expected} (the layout of the group's earlier phase)")
            del self._starts[rank]

    def _check_followers(self) -> None:
        """Raise `ReplicaDied` naming a follower rank whose check answered that it died (its actor, or its loop with
        an error); a follower whose server already stopped is the end of a phase, not a death."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        for rank in self.followers:
            if rank not in self._checks:
                self._checks[rank] = self.group.rank_call(rank, "server_alive", **self._phase_kwargs)
        ready, _ = ray.wait(list(self._checks.values()), num_returns=len(self._checks), timeout=0)
        for rank, ref in list(self._checks.items()):
            if ref not in ready:
                continue
            del self._checks[rank]
            try:
                got = ray.get(ref)
            except RayActorError as e:
                raise ReplicaDied(f"{self.name}: its TP rank on worker rank {rank} died ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0]})") from None
            except RayTaskError:  # its server stopped (the end of a phase): the leader's own poll tells the rest
                continue
            if not got["alive"] and got["error"] is not None:  # a loop that failed (a clean stop is the phase's end)
                raise ReplicaDied(f"{self.name}: the engine loop of its worker rank {rank} failed: {got['error']}")

    def _check_sent(self) -> None:
        """Raise the error of a submit/abort call that has answered with one (Ray raises it on `get`)."""
        import ray

        with self._lock:
            refs = [r for _, r in self._sent]
        if not refs:
            return
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        done = set(ready)
        with self._lock:
            self._sent = [(w, r) for w, r in self._sent if r not in done]
        for ref in ready:
            ray.get(ref)


def start_serving(group: Any, *, round_steps: int = 16, weight_version: Optional[int] = None,
                  default_timeout_s: float = 600.0, poll_wait_s: float = 0.5,
                  sticky_sessions: bool = True, step_delay_s: float = 0.0) -> RolloutRouter:
    """Start every rank's request server (`RolloutHost.start_server`; `weight_version`: the version of the weights
    the engines hold, which their tokens record; None: the engines' own; `step_delay_s`: tests only, see
    `EngineServer`) and return a router over the replicas' first ranks, in replica order (`sticky_sessions`:
    `RolloutRouter`'s)."""
    infos = group.start_server(round_steps=round_steps, weight_version=weight_version, step_delay_s=step_delay_s)
    return _router_over(group, infos, default_timeout_s=default_timeout_s, poll_wait_s=poll_wait_s,
                        weight_version=weight_version, sticky_sessions=sticky_sessions)


def _router_over(group: Any, infos: Sequence[dict], *, phase: Optional[int] = None, start: Any = None,
                 start_wait_s: float = 0.0, **router_options: Any) -> RolloutRouter:
    """A `RolloutRouter` over the replicas of the layout `infos` (each rank's {"replica", "tp_rank"}), its handles on
    the replicas' first ranks; `start`: the `PendingCall` of `start_server` still in flight (each handle awaits its
    ranks' answers, see `RayReplica`)."""
    leaders = sorted((info["replica"], rank) for rank, info in enumerate(infos) if info["tp_rank"] == 0)
    members = {replica: [rank for rank, info in enumerate(infos) if info["replica"] == replica]
               for replica, _ in leaders}
    handles = []
    for replica, rank in leaders:
        starts = None if start is None else {r: (start.refs[r], dict(infos[r])) for r in members[replica]}
        handles.append(RayReplica(group, rank, f"replica {replica} (rank {rank})",
                                  followers=[r for r in members[replica] if r != rank], phase=phase, starts=starts,
                                  start_wait_s=start_wait_s))
    return RolloutRouter(handles, **router_options)


def stop_serving(group: Any, router: RolloutRouter, timeout_s: float = 60.0) -> list[dict[str, float]]:
    """Stop every rank's server (requests still in flight are aborted) and close the router; returns each rank's
    server counters. The router's collectors are told to end first (`RolloutRouter.begin_close`): the long-poll each
    has in flight then answers as its server stops instead of after its full wait (`poll_wait_s` per phase)."""
    router.begin_close()
    try:
        return group.stop_server(timeout_s=timeout_s)
    finally:
        router.close()


# Seconds a phase's per-rank calls wait for its `start_server` (the controller's collectors and the ranks' submits,
# `begin_serving`): the start runs on the worker thread after whatever the controller sent there before it.
START_WAIT_S = 300.0
_PHASE_IDS = itertools.count(1)  # the serving phases' ids, increasing over the controller's life


@dataclasses.dataclass
class ServingPhase:
    """One serving phase off the critical path (see the module docstring): its `id`, the `group`, the `router`
    over it, the `layout` (each rank's {"replica", "tp_rank"}), and the calls still to collect: `start` (None: it
    was awaited) and `stop` (None until `end_serving`)."""

    id: int
    group: Any
    router: RolloutRouter
    layout: list
    start: Any = None
    stop: Any = None


def begin_serving(group: Any, *, layout: Optional[Sequence[dict]] = None, round_steps: int = 16,
                  weight_version: Optional[int] = None, default_timeout_s: float = 600.0, poll_wait_s: float = 0.5,
                  sticky_sessions: bool = True, step_delay_s: float = 0.0,
                  start_wait_s: float = START_WAIT_S) -> ServingPhase:
    """Start a serving phase: every rank's `start_server(phase=id)` (options as `start_serving`'s) and a router over
    the replicas. `layout`: what an earlier phase's start returned for this group (`ServingPhase.layout`): the start
    is submitted without waiting and the router built from it; None: the start is awaited (a group's first phase)."""
    phase = next(_PHASE_IDS)
    options = dict(round_steps=round_steps, weight_version=weight_version, step_delay_s=step_delay_s, phase=phase)
    router_options = dict(default_timeout_s=default_timeout_s, poll_wait_s=poll_wait_s,
                          weight_version=weight_version, sticky_sessions=sticky_sessions)
    if layout is None:
        infos = group.start_server(**options)
        return ServingPhase(phase, group, _router_over(group, infos, phase=phase, **router_options), list(infos))
    if len(layout) != group.world_size:
        raise ValueError(f"begin_serving: the layout has {len(layout)} ranks, the group {group.world_size}; pass "
                         "the `layout` of this group's earlier phase")
    start = group.start_server.submit(**options)
    router = _router_over(group, layout, phase=phase, start=start, start_wait_s=start_wait_s, **router_options)
    return ServingPhase(phase, group, router, [dict(i) for i in layout], start=start)


def end_serving(phase: ServingPhase, timeout_s: float = 60.0) -> None:
    """End the phase without waiting: the router's collectors told to end (new requests refused) and every rank's
    `stop_server` submitted; `finish_serving` collects it. Relies on Ray's order of one caller's calls on the workers'
    default concurrency group (see the module docstring): the next role call runs after the stop there."""
    phase.router.begin_close()
    phase.stop = phase.group.stop_server.submit(timeout_s=timeout_s)


def finish_serving(phase: ServingPhase, where: str) -> list[dict[str, float]]:
    """Collect the phase's start (when it was not awaited) and stop answers and join the router's collectors;
    returns each rank's server counters. Raises the first failure, naming the phase and `where` it was collected
    (e.g. "before the weight sync") -- `WorkerError`/`CallTimeout` as the group raised it, with the phase in front;
    the layout check of the start raises RuntimeError."""
    from megarl.controller.worker_group import CallTimeout, WorkerError

    if phase.stop is None:
        raise RuntimeError(f"finish_serving: serving phase {phase.id} was not ended (end_serving first)")
    errors: list[BaseException] = []
    stopped: list[dict[str, float]] = []
    prefix = f"serving phase {phase.id} (collected {where})"
    for what, call in (("start_server", phase.start), ("stop_server", phase.stop)):
        if call is None:
            continue
        try:
            # bounded: `PendingCall.result` raises CallTimeout naming a rank whose heartbeat goes unanswered for
            # resources.heartbeat_timeout_s (and at call_timeout_s when set); stop_server joins its loop within
            # its own timeout_s (60 s)
            got = call.result()
        except WorkerError as e:
            errors.append(WorkerError(f"{prefix}: {e}", e.rank))
            continue
        except CallTimeout as e:
            errors.append(CallTimeout(f"{prefix}: {e}", e.ranks))
            continue
        if what == "stop_server":
            stopped = got
        elif [dict(i) for i in got] != phase.layout:
            errors.append(RuntimeError(f"{prefix}: start_server answered the layout {got}, but the router was built "
                                       f"for {phase.layout} (the group's earlier phase)"))
    try:
        phase.router.close()
    except BaseException as e:  # noqa: BLE001 -- raised below, after the workers' own failures
        errors.append(e)
    if errors:
        raise errors[0]
    return stopped
