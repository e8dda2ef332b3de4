"""`RolloutRouter` (`megarl.rollout.router`) sends the requests made in one turn of the caller's event loop to each
replica as one submit, in the order they were made: what lets a single-turn batch enter an engine in one round, as
the batch `generate` added its prompts (the trainer's golden curve depends on it). The replicas here are in-process
`ReplicaHandle`s that answer every request at once with its prompt: the router's own logic is what is tested."""

from __future__ import annotations

import asyncio
import queue
import threading
import time

from megarl.rollout.client import ReplicaDied
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



class ServerLikeReplica(EchoReplica):
    """An `EchoReplica` whose long-poll waits like `EngineServer.take_results`: up to `max_wait_s`, answering at once
    when there are results or the server is stopping (then, with none, `ReplicaDied` as `RemoteReplica.poll` raises
    for the stopping server's alive=False answer); a poll after the stop raises, as `RolloutHost.server_poll` does on a
    replica that no longer serves."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.stopped = threading.Event()
        self.polls_after_stop = 0

    def poll(self, max_wait_s: float) -> dict:
        if self.stopped.is_set():
            self.polls_after_stop += 1
            raise RuntimeError(f"server_poll: {self.name} is not serving (start_server first)")
        results = []
        deadline = time.monotonic() + max_wait_s
        while not results and not self.stopped.is_set() and time.monotonic() < deadline:
            try:
                results.append(self._answers.get(timeout=0.01))
            except queue.Empty:
                pass
        if self.stopped.is_set() and not results:  # answered as its server stopped: `RemoteReplica.poll` reads
            raise ReplicaDied(f"{self.name}: its engine loop stopped: None")  # alive=False as this
        return {"results": results, "metrics": {}}


class StoppingGroup:
    """The worker group's `stop_server` over `ServerLikeReplica`s (what `stop_serving` calls)."""

    def __init__(self, replicas) -> None:
        self.replicas = replicas

    def stop_server(self, timeout_s: float = 60.0) -> list[dict]:
        for r in self.replicas:
            r.stopped.set()
        return [{} for _ in self.replicas]


def test_ending_a_serving_phase_does_not_wait_out_the_long_poll_in_flight(caplog):
    """`stop_serving` tells the collectors to end, then stops the servers: the poll each collector has in flight
    (here a 600 s one) answers as its server stops, so the phase ends within the 60 s it is given here; a collector
    whose next poll meets a stopped server with nothing awaited on it ends quietly (no replica reported dead)."""
    from megarl.controller.serving import stop_serving

    replicas = [ServerLikeReplica("replica 0"), ServerLikeReplica("replica 1")]
    router = RolloutRouter(replicas, default_timeout_s=30, poll_wait_s=600.0)

    async def batch():
        return await asyncio.gather(*(router.generate(GenerationRequest(f"r{i}", [1, i], ONE)) for i in range(4)))

    outs = asyncio.run(batch())
    assert [o.completions[0].token_ids for o in outs] == [[0], [1], [2], [3]]
    ended = threading.Thread(target=stop_serving, args=(StoppingGroup(replicas), router), daemon=True)
    ended.start()
    ended.join(timeout=60)
    assert not ended.is_alive(), "stop_serving still waits for a long-poll of a stopped server"
    assert router.counts["failed"] == 0
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
