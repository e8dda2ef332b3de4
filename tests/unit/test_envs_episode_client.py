"""Episodes over a `RolloutClient` (`megarl.envs.episode`): one coroutine per episode, single-turn generation as the
one-turn case, tools that sleep or hang, anything but a client refused.

The client is scripted (`tests.episode_helpers.ScriptedClient`: what a policy that has learned the task would sample,
one request at a time, each request's log-probs a function of its seed so that a wrong seed shows); the real engine
behind `InProcessClient` runs in tests/distributed/test_engine_server.py and tests/e2e. Order, not time: an
environment records the order of its calls, and the assertions read that order.
"""

from __future__ import annotations

import asyncio
import re
import threading

import pytest

from megarl.data.chat_chars import build_chat_char_tokenizer
from megarl.data.dataset import PromptRecord
from megarl.envs.base import EnvStep, EpisodeError
from megarl.envs.episode import TURN_SEED_STRIDE, EpisodeLimits, EpisodeRunner, run_single_turn, verify_trajectory
from megarl.envs.tool_calls import parse_hermes
from megarl.envs.tool_env import ToolEnvironment
from megarl.rollout.client import RequestDropped
from megarl.rollout.engine import SamplingSettings
from tests import episode_helpers

TOK = build_chat_char_tokenizer()
RECORDS = [PromptRecord(0, "12*34=", "408", {}), PromptRecord(1, "7*8=", "56", {})]
LIMITS = EpisodeLimits(max_turns=4, max_tokens_per_turn=128, max_new_tokens=400, max_model_len=1024)


def calculator_reply(text: str) -> str:
    """The calculator policy: call the tool for the question, then answer with the tool's result."""
    results = re.findall(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", text)
    if results:
        return results[-1]
    a, b = re.search(r"user\n(\d+)\*(\d+)=", text).groups()
    return '<tool_call>{"name": "multiply", "arguments": {"a": %s, "b": %s}}</tool_call>' % (a, b)


class ScriptedClient(episode_helpers.ScriptedClient):
    """The calculator policy (`calculator_reply`) on the character tokenizer, reporting weights version 3."""

    def __init__(self, reply=calculator_reply, versions=None, weight_version=3):
        super().__init__(TOK, reply, versions=versions, weight_version=weight_version)


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def exact(text, answer, record):
    return float(text == answer)


def calculator_env(record):
    return ToolEnvironment([multiply], exact, system_prompt=None)


def episode_runner(factory=calculator_env, limits=LIMITS, **kw):
    return EpisodeRunner(TOK, factory, parse_hermes, limits, **kw)


def test_each_episode_is_its_own_requests_seeded_by_its_place_and_turn_and_token_exact():
    """Request ids f"{uid}/t{turn}", session = the episode, seed_index = its place in the batch, turn t's sampling
    seed = seed + t * TURN_SEED_STRIDE; per-token versions as the client reports them; every trajectory verified."""
    client = ScriptedClient(versions=lambda j: 4 + j % 2)  # a push mid-request: versions alternate
    result = episode_runner().run(RECORDS, 2, client, SamplingSettings(seed=11), uid_prefix="s/")
    assert result.scores == [1.0] * 4
    expected = {(f"s/{i}/{k}/t{t}", f"s/{i}/{k}", 2 * i + k, 11 + t * TURN_SEED_STRIDE)
                for i in range(2) for k in range(2) for t in range(2)}
    assert {(r.request_id, s, r.seed_index, r.sampling.seed) for r, s in client.requests} == expected
    assert all(r.sampling.samples_per_prompt == 1 for r, _ in client.requests)
    for t, turns in zip(result.trajectories, result.turns):
        verify_trajectory(t, turns)
        sampled = [v for v, m in zip(t.policy_version, t.loss_mask) if m]
        assert sampled[:4] == [4, 5, 4, 5]  # each token's own version, not one per turn


def test_without_per_token_versions_the_clients_weight_version_is_recorded():
    result = episode_runner().run(RECORDS[:1], 1, ScriptedClient(versions=None, weight_version=9),
                                  SamplingSettings(seed=0))
    t = result.trajectories[0]
    assert {v for v, m in zip(t.policy_version, t.loss_mask) if m} == {9}


@pytest.mark.parametrize("bound", [1, 3])
def test_any_concurrency_bound_gives_identical_trajectories_for_the_same_seeds(bound):
    """A request's seed is its episode's place and its turn, never what else is in flight: a bound of 1 or 3 episodes
    at once samples the same tokens (here: the same seed-dependent log-probs) as all of them at once."""
    sampling = SamplingSettings(seed=5)
    unbounded = episode_runner().run(RECORDS, 2, ScriptedClient(), sampling)
    client = ScriptedClient()
    bounded = episode_runner(max_concurrent_episodes=bound).run(RECORDS, 2, client, sampling)
    assert client.most_in_flight == bound  # the bound held, and reached
    for a, b in zip(unbounded.trajectories, bounded.trajectories):
        assert (a.token_ids, a.loss_mask, a.log_probs, a.policy_version) == \
            (b.token_ids, b.loss_mask, b.log_probs, b.policy_version)
    assert unbounded.metrics == bounded.metrics


def test_a_batch_generate_function_is_refused_naming_what_to_pass():
    """The batch `generate(prompts, sampling)` path was deleted: a function (or a `RolloutService`'s bound
    `generate`) is a TypeError that says to pass a client from `service.serving()`."""
    def generate(prompts, sampling):
        raise AssertionError("never called")

    for source in (generate, object()):
        with pytest.raises(TypeError, match=r"EpisodeRunner.run takes a RolloutClient .*service.serving\(\)"):
            episode_runner().run(RECORDS, 1, source, SamplingSettings(seed=0), 0)
    with pytest.raises(TypeError, match=r"run_single_turn takes a RolloutClient"):
        asyncio.run(run_single_turn(generate, [[1, 2]], SamplingSettings(seed=0)))


def chatty_run(slow_s):
    events, holder = [], {}

    def env(record):
        return episode_helpers.SlowFirstToolEnv(record, events, holder, slow_s)

    client = ScriptedClient(reply=lambda text: "ok")
    result = episode_runner(env).run(RECORDS, 1, client, SamplingSettings(seed=0))
    return result, events


def test_an_episode_whose_tool_sleeps_does_not_delay_another_episodes_turns():
    """Record 0's first tool call waits until record 1 has reached its last turn: with one coroutine per episode,
    record 1 takes all its turns while record 0's tool sleeps (the events say so), and both finish."""
    result, events = chatty_run(slow_s=30.0)
    assert result.scores == [1.0, 1.0]
    slow_done = events.index(("stepped", 0, 0))
    assert [e for e in events[:slow_done] if e[1] == 1] == [
        ("step", 1, 0), ("stepped", 1, 0), ("step", 1, 1), ("stepped", 1, 1), ("step", 1, 2), ("stepped", 1, 2)]


def test_a_hanging_tool_is_cancelled_and_counted_and_the_other_episodes_finish():
    """Record 0's tool never returns (async: cancelled at the tool's deadline; blocking: abandoned on its bounded
    thread): the episode reads an error observation and goes on to answer; record 1 is untouched. A step that itself
    never returns is cancelled at env_timeout_s, ends its episode (trained on nothing) and the run goes on."""
    stop = threading.Event()

    async def hang_async(a: int, b: int) -> int:
        """Never returns.

        Args:
            a: the first factor
            b: the second factor
        """
        await asyncio.Event().wait()

    def hang_blocking(a: int, b: int) -> int:
        """Blocks until the test ends.

        Args:
            a: the first factor
            b: the second factor
        """
        stop.wait(60)
        return 0

    from megarl.envs.tools import tool_pool

    abandoned = tool_pool().abandoned
    try:
        for hang in (hang_async, hang_blocking):
            def factory(record, hang=hang):
                tool = hang if record.index == 0 else multiply
                tool.__name__ = "multiply"
                return ToolEnvironment([tool], exact, system_prompt=None, tool_timeout_s=0.2)

            result = episode_runner(factory).run(RECORDS, 1, ScriptedClient(), SamplingSettings(seed=0))
            m = result.metrics
            assert m["multi_turn/tool_timeouts"] == 1 and m["multi_turn/step_timeouts"] == 0, hang
            assert m["multi_turn/tool_errors"] == 1
            assert result.scores[1] == 1.0  # the other episode answered from its tool
            text = TOK.decode(result.trajectories[0].token_ids, skip_special_tokens=False)
            assert "Error: tool 'multiply' timed out after 0.2 s" in text  # the episode went on past it
            assert len(result.turns[0]) == 2
        assert tool_pool().abandoned == abandoned + 1  # the blocking one, left on its (daemon) thread
    finally:
        stop.set()

    class HangingStep(episode_helpers.SlowFirstToolEnv):
        def __init__(self, record):
            super().__init__(record, [], {}, 0)

        async def step(self, turn):
            if self.record.index == 0:
                await asyncio.Event().wait()
            return EnvStep(reward=1.0, done=True)

    result = episode_runner(HangingStep, env_timeout_s=0.2).run(RECORDS, 2, ScriptedClient(reply=lambda t: "ok"),
                                                                SamplingSettings(seed=0))
    assert result.metrics["multi_turn/step_timeouts"] == 2 and result.metrics["multi_turn/tool_timeouts"] == 2
    assert result.scores == [0.0, 0.0, 1.0, 1.0]
    assert [sum(t.loss_mask) for t in result.trajectories[:2]] == [0, 0]  # trained on nothing
    assert all(sum(t.loss_mask) > 0 for t in result.trajectories[2:])


def test_an_environment_reset_that_does_not_return_stops_the_run_naming_it():
    class HangingReset(episode_helpers.SlowFirstToolEnv):
        def __init__(self, record):
            super().__init__(record, [], {}, 0)

        async def reset(self, record):
            if record.index == 1:
                await asyncio.Event().wait()
            return await super().reset(record)

        async def step(self, turn):
            return EnvStep(reward=1.0, done=True)

    with pytest.raises(EpisodeError, match=r"episode s/1/0: reset: the environment did not return within 0.2 s"):
        episode_runner(HangingReset, env_timeout_s=0.2).run(RECORDS, 1, ScriptedClient(), SamplingSettings(seed=0),
                                                            uid_prefix="s/")


def test_single_turn_generation_is_one_request_per_prompt_with_its_samples():
    """The one-turn case: prompt i -> one request (seed_index i, samples_per_prompt n, the sampling seed as given),
    the samples ordered as a batch generate returns them; a prompt the prompt policy drops is reported, not fatal."""

    class Dropping(ScriptedClient):
        async def generate(self, request, **kw):
            if request.seed_index == 1:
                raise RequestDropped(f"request {request.request_id!r}: prompt dropped (rollout.overlong_prompt=drop)")
            return await super().generate(request, **kw)

    prompts = [TOK(TOK.apply_chat_template([{"role": "user", "content": r.prompt}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False)["input_ids"]
               for r in RECORDS + [PromptRecord(2, "3*3=", "9", {})]]
    client = Dropping(versions=None, weight_version=2)
    samples, versions = asyncio.run(run_single_turn(client, prompts, SamplingSettings(seed=7, samples_per_prompt=2),
                                                    uid_prefix="v/"))
    assert [(s.prompt_index, s.sample_index) for s in samples] == [(0, 0), (0, 1), (2, 0), (2, 1)]
    assert samples.dropped_prompt_indices == [1]
    assert sorted((r.request_id, s, r.seed_index, r.sampling.seed, r.sampling.samples_per_prompt)
                  for r, s in client.requests) == [("v/0/t0", "v/0", 0, 7, 2), ("v/2/t0", "v/2", 2, 7, 2)]
    assert all(v == [2] * len(s.response_ids) for s, v in zip(samples, versions))
    assert TOK.decode(samples[0].response_ids, skip_special_tokens=True).startswith('<tool_call>{"name"')


def test_blocking_tools_run_on_a_bounded_pool_of_threads():
    """ToolPool(2): five blocking calls at once, never more than two running (counted inside the calls), all five
    answered once released; a call queued past its deadline is dropped, never run."""
    from megarl.envs.tools import ToolPool

    pool, lock, release = ToolPool(2), threading.Lock(), threading.Event()
    running, most = [0], [0]

    def work(k):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        release.wait(30)
        with lock:
            running[0] -= 1
        return k

    async def main():
        calls = [asyncio.ensure_future(pool.run(work, 60, k=k)) for k in range(5)]
        late = asyncio.ensure_future(pool.run(work, 0.05, k=99))  # queued behind the five: times out queued
        for _ in range(3000):  # until two run (a bound on the wait, not an assertion on time)
            if running[0] == 2 and late.done():
                break
            await asyncio.sleep(0.01)
        release.set()
        return await asyncio.gather(*calls), await asyncio.gather(late, return_exceptions=True)

    done, (late,) = asyncio.run(main())
    assert done == [0, 1, 2, 3, 4] and most[0] == 2 and len(pool._started) == 2
    assert isinstance(late, asyncio.TimeoutError) and pool.abandoned == 0  # dropped from the queue, not abandoned
