"""`RolloutRouter`'s placement with and without session stickiness (`sticky_sessions`), over replicas that answer
each request with its prompt reversed: the router is the code under test; the real engines behind it are
tests/distributed/test_rollout_router.py's."""

from __future__ import annotations

import asyncio
import threading

from megarl.rollout.engine import Completion, GenerationOutput, GenerationRequest, SamplingSettings
from megarl.rollout.engine_server import RequestResult
from megarl.rollout.router import RolloutRouter

TURN = SamplingSettings(temperature=0.0, max_new_tokens=2)


class EchoReplica:
    """A `ReplicaHandle` that finishes every submitted request at its next poll (tokens: the prompt reversed) and
    records the ids it took, in order."""

    def __init__(self, name: str) -> None:
        self.name, self.took, self._queue = name, [], []
        self._cond = threading.Condition()

    def submit(self, entries):
        with self._cond:
            for request, _ in entries:
                self.took.append(request.request_id)
                self._queue.append(request)
            self._cond.notify_all()

    def abort(self, request_ids):
        pass

    def poll(self, max_wait_s):
        with self._cond:
            if not self._queue:
                self._cond.wait(max_wait_s)
            done, self._queue = self._queue, []
        return {"results": [RequestResult(r.request_id, "finished", GenerationOutput(
            r.request_id, list(r.prompt_ids), [Completion(0, r.prompt_ids[::-1], [0.0] * len(r.prompt_ids), "stop")],
            True)) for r in done], "metrics": {}}


def _run(sticky: bool) -> tuple[list[str], list[str], RolloutRouter]:
    """Sessions "b" (one turn) and "a" (three turns) start together; a's later turns run alone."""
    replicas = [EchoReplica("replica 0"), EchoReplica("replica 1")]
    router = RolloutRouter(replicas, poll_wait_s=0.05, default_timeout_s=30, sticky_sessions=sticky)

    async def turn(sid, t, prompt):
        out = await router.generate(GenerationRequest(f"{sid}-{t}", prompt, TURN), session_id=sid)
        return out.completions[0].token_ids

    async def main():
        await asyncio.gather(turn("b", 0, [1, 2]), turn("a", 0, [3, 4]))
        for t in (1, 2):
            assert await turn("a", t, [5 + t]) == [5 + t]

    try:
        asyncio.run(main())
    finally:
        router.close()
    return replicas[0].took, replicas[1].took, router


def test_sticky_sessions_keep_a_session_on_the_replica_of_its_first_turn():
    # gather starts b first: least-loaded puts b on replica 0 (both idle, lowest index), a on replica 1 (b is in
    # flight there); a's later turns find both idle but stay on replica 1
    zero, one, router = _run(sticky=True)
    assert (zero, one) == (["b-0"], ["a-0", "a-1", "a-2"])
    assert router.replica_of("a") == 1 and router.metrics()["rollout/server/sessions"] == 2


def test_without_stickiness_every_request_goes_least_loaded():
    # the same requests: a's later turns find both replicas idle and go to the lowest index, replica 0
    zero, one, router = _run(sticky=False)
    assert (zero, one) == (["b-0", "a-1", "a-2"], ["a-0"])
    assert router.replica_of("a") is None and router.metrics()["rollout/server/sessions"] == 0


def test_a_request_after_the_router_closed_fails_at_once_instead_of_waiting_out_its_bound():
    """An agent's next turn that arrives after its serving phase ended (async mode closing with a batch in flight):
    no collector thread is left to deliver it, so without the check it waited `timeout_s` (here 30 s, in a run
    `rollout.agent_timeout_s`). Counted in event order: the call raises before any replica took the request."""
    import pytest

    from megarl.rollout.client import ReplicaDied

    replicas = [EchoReplica("replica 0")]
    router = RolloutRouter(replicas, poll_wait_s=0.05, default_timeout_s=30)

    async def turn(rid):
        return await router.generate(GenerationRequest(rid, [1, 2], TURN), session_id="s")

    assert asyncio.run(turn("before")).completions[0].token_ids == [2, 1]
    router.begin_close()
    with pytest.raises(ReplicaDied, match="router is closed"):
        asyncio.run(asyncio.wait_for(turn("after"), 5))  # 5 s: far below the request's 30 s bound
    router.close()
    assert replicas[0].took == ["before"] and router.metrics()["rollout/server/in_flight"] == 0
