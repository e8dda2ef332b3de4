"""The request-level rollout path on Ray: the rollout worker group's engines as servers, a router over them.

    router = start_serving(rollout_group)      # every rank: RolloutHost.start_server; a RolloutRouter over the leaders
    ...  await router.generate(request, session_id=...)  ...
    stop_serving(rollout_group, router)        # the router's collectors, then every rank's server (colocated: sleep)

A replica is reached through its first TP rank alone (`WorkerGroup.rank_call`, in the actors' serve concurrency
group, beside the worker thread): `RayReplica.submit`/`abort` send without waiting; `poll` is the bounded long-poll
(`RolloutHost.server_poll`), the one place a dead replica shows: Ray raises `RayActorError` for a call on an actor
whose process died, which becomes `ReplicaDied` naming the replica and its rank.
"""

from __future__ import annotations

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
                 followers: Sequence[int] = ()) -> None:
        self.group, self.rank, self.name = group, rank, name
        self.poll_slack_s = poll_slack_s
        self.followers = list(followers)
        self._checks: dict[int, Any] = {}  # follower rank -> its server_alive ref in flight
        self._sent: list = []  # refs of submits/aborts not yet checked
        self._lock = threading.Lock()

    def submit(self, entries: Sequence[tuple[GenerationRequest, int]]) -> None:
        ref = self.group.rank_call(self.rank, "server_submit", list(entries))
        with self._lock:
            self._sent.append(("server_submit", ref))

    def abort(self, request_ids: Sequence[str]) -> None:
        ref = self.group.rank_call(self.rank, "server_abort", list(request_ids))
        with self._lock:
            self._sent.append(("server_abort", ref))

    def poll(self, max_wait_s: float) -> dict[str, Any]:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        bound = max_wait_s + self.poll_slack_s
        self._check_followers()
        try:
            self._check_sent()
            got = ray.get(self.group.rank_call(self.rank, "server_poll", max_wait_s), timeout=bound)
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

    def _check_followers(self) -> None:
        """Raise `ReplicaDied` naming a follower rank whose check answered that it died (its actor, or its loop with
        an error); a follower whose server already stopped is the end of a phase, not a death."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        for rank in self.followers:
            if rank not in self._checks:
                self._checks[rank] = self.group.rank_call(rank, "server_alive")
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
    leaders = sorted((info["replica"], rank) for rank, info in enumerate(infos) if info["tp_rank"] == 0)
    followers = {replica: [rank for rank, info in enumerate(infos) if info["replica"] == replica and info["tp_rank"]]
                 for replica, _ in leaders}
    handles = [RayReplica(group, rank, f"replica {replica} (rank {rank})", followers=followers[replica])
               for replica, rank in leaders]
    return RolloutRouter(handles, default_timeout_s=default_timeout_s, poll_wait_s=poll_wait_s,
                         weight_version=weight_version, sticky_sessions=sticky_sessions)


def stop_serving(group: Any, router: RolloutRouter, timeout_s: float = 60.0) -> list[dict[str, float]]:
    """Stop every rank's server (requests still in flight are aborted) and close the router; returns each rank's
    server counters. The router's collectors are told to end first (`RolloutRouter.begin_close`): the long-poll each
    has in flight then answers as its server stops instead of after its full wait (`poll_wait_s` per phase)."""
    router.begin_close()
    try:
        return group.stop_server(timeout_s=timeout_s)
    finally:
        router.close()
