"""`RolloutRouter` (`megarl.rollout.router`) sends the requests made in one turn of the caller's event loop to each
replica as one submit, in the order they were made: what lets a single-turn batch enter an engine in one round, as
the batch `generate` added its prompts (the trainer's golden curve depends on it). The replicas here are in-process
`ReplicaHandle`s that answer every request at once with its prompt: the router's own logic is what is tested."""

from __future__ import annotations

import asyncio
import queue
import threading

from megarl.rollout.engine import Completion, GenerationOutput, GenerationRequest, SamplingSettings
from megarl.rollout.engine_server import RequestResult
from megarl.rollout.router import RolloutRouter

ONE = SamplingSettings(temperature=0.0, max_new_tokens=1)


class EchoReplica:
    """Records each `submit` call's request ids; answers each request with one token, its prompt's last."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.submits: list[list[str]] = []
        self._answers: queue.Queue = queue.Queue()
        self._lock = threading.Lock()

    def submit(self, entries) -> None:
        with self._lock:
            self.submits.append([r.request_id for r, _ in entries])
        for r, _ in entries:
            out = GenerationOutput(r.request_id, list(r.prompt_ids),
                                   [Completion(0, [r.prompt_ids[-1]], [0.0], "length", [0])], True)
            self._answers.put(RequestResult(r.request_id, "finished", output=out))

    def abort(self, request_ids) -> None:
        pass

    def poll(self, max_wait_s: float) -> dict:
        results = []
        try:
            results.append(self._answers.get(timeout=max_wait_s))
            while True:
                results.append(self._answers.get_nowait())
        except queue.Empty:
            pass
        return {"results": results, "metrics": {}}


def test_a_batch_started_in_one_loop_turn_reaches_each_replica_in_one_submit_in_order():
    replicas = [EchoReplica("replica 0"), EchoReplica("replica 1")]
    router = RolloutRouter(replicas, default_timeout_s=30, poll_wait_s=0.05)
    try:
        async def batch(prefix: str, n: int):
            return await asyncio.gather(*(router.generate(GenerationRequest(f"{prefix}{i}", [1, i], ONE))
                                          for i in range(n)))

        async def main():
            first = await batch("a", 6)
            second = await batch("b", 3)  # a later turn of the loop: submits of its own
            return first, second

        first, second = asyncio.run(main())
    finally:
        router.close()
    assert [o.completions[0].token_ids for o in first] == [[i] for i in range(6)]
    assert [o.completions[0].token_ids for o in second] == [[i] for i in range(3)]
    # least-loaded: new sessions alternate; each replica got its share of a batch in one call, in creation order
    assert replicas[0].submits == [["a0", "a2", "a4"], ["b0", "b2"]]
    assert replicas[1].submits == [["a1", "a3", "a5"], ["b1"]]

