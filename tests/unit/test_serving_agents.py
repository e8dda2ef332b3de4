"""Agent environments (`rollout.env: agent:file.py:run`, `megarl.serving.agents`): agents written only against the
real `openai` client (tests/unit/fixtures/agents/calculator_agents.py) talk over real HTTP (uvicorn on 127.0.0.1) to
the OpenAI endpoint, each episode through its own session base URL, over a scripted `RolloutClient` that writes what
a policy which has learned the calculator task samples (a random model never writes a tool call; the real engine
behind the endpoint runs in tests/distributed/test_openai_api.py)."""

from __future__ import annotations

import asyncio
import os
import types

import httpx
import openai
import pytest

from megarl.algorithms.advantages import grpo
from megarl.config.errors import ConfigError
from megarl.data.dataset import PromptRecord
from megarl.data.tool_task import tool_call_text
from megarl.data.trajectory import trajectories_to_batch
from megarl.envs.tool_calls import get_parser
from megarl.serving.agents import AgentRunner, load_agent
from megarl.serving.openai_api import create_app
from megarl.serving.openai_protocol import OpenAIProtocol, ServeLimits
from megarl.trainer.producer import BatchProducer
from tests.unit.test_serving_openai_protocol import TOK, TOOLS, CalculatorPolicy, _rendered

AGENTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "agents", "calculator_agents.py")
LIMITS = ServeLimits(max_model_len=1024, max_tokens=64, default_max_tokens=64)


def _runner(function: str, **kw) -> AgentRunner:
    return AgentRunner(load_agent(f"agent:{AGENTS}:{function}"), TOK, get_parser("hermes"), LIMITS, **kw)


def _record(index: int, a: int, b: int, behaviour: str = "calculator") -> PromptRecord:
    return PromptRecord(index, f"{a}*{b}=", str(a * b), {"behaviour": behaviour})


def _final_conversation_ids(a: int, b: int) -> list[int]:
    """transformers' rendering of the agent's final conversation (with the tools), encoded: the expected trajectory,
    less the template's separator after the last end-of-turn token (the engine stops at <|im_end|>)."""
    conversation = [{"role": "user", "content": f"{a}*{b}="},
                    {"role": "assistant", "content": tool_call_text(f"{a}*{b}")},
                    {"role": "tool", "name": "calculator", "content": str(a * b)},
                    {"role": "assistant", "content": str(a * b)}]
    text = TOK.apply_chat_template(conversation, tools=TOOLS, tokenize=False)
    assert text.endswith("<|im_end|>\n")
    return TOK(text[:-1], add_special_tokens=False)["input_ids"]


def test_a_multi_turn_agent_with_a_tool_call_becomes_the_template_of_its_final_conversation():
    """Two records, two episodes each, through the real openai client: each episode is one trajectory whose ids are
    transformers' rendering of its final conversation; the loss mask covers exactly the engine's ids (the tool
    call and the answer, each with its <|im_end|>), the log-probs and versions are the engine's; reward 1 (the
    answer is right); group = record."""
    policy = CalculatorPolicy()
    result = _runner("calculator").run([_record(0, 12, 34), _record(1, 7, 8)], 2, policy, None)
    assert [t.group_uid for t in result.trajectories] == ["0", "0", "1", "1"]
    assert [t.uid for t in result.trajectories] == ["0/0", "0/1", "1/0", "1/1"]
    assert result.scores == [1.0] * 4
    for t, (a, b) in zip(result.trajectories, [(12, 34), (12, 34), (7, 8), (7, 8)]):
        assert t.token_ids == _final_conversation_ids(a, b)
        sampled = (TOK(tool_call_text(f"{a}*{b}"), add_special_tokens=False)["input_ids"] + [TOK.eos_token_id]
                   + TOK(str(a * b), add_special_tokens=False)["input_ids"] + [TOK.eos_token_id])
        assert [x for x, m in zip(t.token_ids, t.loss_mask) if m] == sampled
        assert sum(t.loss_mask) == len(sampled)  # nothing else is in the mask
        assert [lp for lp, m in zip(t.log_probs, t.loss_mask) if m] == [-0.25] * len(sampled)
        assert [lp for lp, m in zip(t.log_probs, t.loss_mask) if not m] == [0.0] * (len(t) - len(sampled))
        assert {v for v, m in zip(t.policy_version, t.loss_mask) if m} == {7}
        assert t.token_ids[:t.prompt_len] == _rendered([{"role": "user", "content": f"{a}*{b}="}])
    assert len(policy.requests) == 8  # two requests per episode
    assert result.metrics["agent/segments_per_episode"] == 1.0
    assert result.metrics["agent/errors"] == 0.0 and result.metrics["agent/timeouts"] == 0.0
    assert result.metrics["agent/tool_calls"] == 1.0  # the agents' numeric info, averaged


def test_an_agent_that_raises_or_hangs_is_counted_and_the_batch_still_forms():
    """Five episodes: two right, one that raises after its first request, one that hangs after it (past
    rollout.agent_timeout_s), one that sends nothing. The failed ones get reward 0, their one request still trains;
    the silent one yields no trajectory; the batch forms through `BatchProducer.episode_batch` and GRPO gives the
    failed episodes negative advantages."""
    runner = _runner("mixed", agent_timeout_s=3.0)  # the others finish well within it, even on a loaded machine
    cfg = types.SimpleNamespace(rollout=types.SimpleNamespace(samples_per_prompt=1))
    producer = BatchProducer(cfg, None, None, None, episodes=runner, sampling=object())
    records = [_record(0, 3, 4), _record(1, 3, 4, "raises"), _record(2, 3, 4, "hangs"), _record(3, 5, 6),
               _record(4, 5, 6, "silent")]
    batch = producer.episode_batch(0, records, None, 3, CalculatorPolicy())
    assert batch.metrics["agent/errors"] == 1.0 and batch.metrics["agent/timeouts"] == 1.0
    assert [t.group_uid for t in batch.trajectories] == ["0/0", "0/1", "0/2", "0/3"]  # the silent one sent nothing
    assert batch.scores.tolist() == [1.0, 0.0, 0.0, 1.0]
    first_turn = TOK(tool_call_text("3*4"), add_special_tokens=False)["input_ids"] + [TOK.eos_token_id]
    for failed in batch.trajectories[1:3]:  # one request each: the tool call, trained with reward 0
        assert [x for x, m in zip(failed.token_ids, failed.loss_mask) if m] == first_turn
    tensors = trajectories_to_batch(batch.trajectories, pad_id=0).tensors
    assert tensors["loss_mask"].sum().item() == sum(sum(t.loss_mask) for t in batch.trajectories)
    one_group = grpo(batch.scores, tensors["group_ids"].new_zeros(4), tensors["loss_mask"][:, 1:])[0]
    assert (one_group[1:3].sum(dim=1) < 0).all() and (one_group[[0, 3]].sum(dim=1) > 0).all()


def test_an_unknown_session_is_a_404_naming_it_and_a_session_records_apart():
    """Through the real openai client: a session's requests go to its own recorder (not the server's); a request
    to a session that is not open (never opened, or closed) gets 404 with OpenAI's error body naming it."""
    policy = CalculatorPolicy()
    protocol = OpenAIProtocol(policy, TOK, get_parser("hermes"), model_name="policy", limits=LIMITS)
    app = create_app(protocol)
    protocol.open_session("episode-1")

    async def requests():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        messages = [{"role": "user", "content": "2*3="}]
        ok = openai.AsyncOpenAI(base_url="http://test/sessions/episode-1/v1", api_key="none", http_client=http,
                                max_retries=0)
        answered = await ok.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        unknown = openai.AsyncOpenAI(base_url="http://test/sessions/episode-9/v1", api_key="none",
                                     http_client=http, max_retries=0)
        with pytest.raises(openai.NotFoundError) as chat_error:
            await unknown.chat.completions.create(model="policy", messages=messages)
        with pytest.raises(openai.NotFoundError) as stream_error:
            await unknown.chat.completions.create(model="policy", messages=messages, stream=True)
        with pytest.raises(openai.NotFoundError) as completion_error:
            await unknown.completions.create(model="policy", prompt="2*3=")
        await http.aclose()
        return answered, [chat_error.value, stream_error.value, completion_error.value]

    answered, errors = asyncio.run(requests())
    for e in errors:
        assert e.status_code == 404
        assert e.body["param"] == "session_id" and e.body["code"] == "session_not_found"
        assert "unknown session 'episode-9'" in e.body["message"]
    assert len(policy.requests) == 1  # the 404s never reached the engine
    assert protocol.recorder.records() == []
    assert [r.request_id for r in protocol.close_session("episode-1")] == [answered.id]
    with pytest.raises(Exception, match="unknown session 'episode-1'"):
        protocol.session_recorder("episode-1")  # closed: its base URL answers 404 from now on


def test_an_agent_spec_names_an_async_function_of_record_and_base_url():
    assert load_agent(f"agent:{AGENTS}:calculator").__name__ == "calculator"
    with pytest.raises(ConfigError, match=r"rollout.env=.*'not_async' must be an async function"):
        load_agent(f"agent:{AGENTS}:not_async")
    with pytest.raises(ConfigError, match=r"defines no 'calculatr'.*calculator"):
        load_agent(f"agent:{AGENTS}:calculatr")
    with pytest.raises(ConfigError, match=r"an agent is 'agent:path/to/file.py:function'"):
        load_agent("agent:calculator")


def test_the_agent_keys_are_refused_where_they_cannot_work():
    from megarl.config import load_config

    quickstart = os.path.join(os.path.dirname(AGENTS), "..", "..", "..", "..", "yaml_configs", "cpu_quickstart.yaml")
    agent = [f"rollout.env=agent:{AGENTS}:calculator", "data.chat_template=hf", "actor.mini_batch_prompts=null"]
    assert load_config(quickstart, [*agent, "rollout.agent_timeout_s=5"]).rollout.agent_timeout_s == 5.0
    with pytest.raises(ConfigError, match=r"rollout.agent_timeout_s=5.0 applies to agent environments only"):
        load_config(quickstart, ["rollout.agent_timeout_s=5"])
    with pytest.raises(ConfigError, match=r"an agent takes no options"):
        load_config(quickstart, [*agent, "rollout.env_options={a: 1}"])


def test_fixed_mini_batches_and_dp_are_refused_with_an_agent():
    """An agent episode that rewrites its history trains as several segments, so a step's sample count varies: a
    fixed mini-batch size or a DP split would stop the run at the first such step (it did, at step 13 of
    yaml_configs/cpu_agent_quickstart.yaml with mini_batch_prompts 16: 129 samples). The check refuses them before
    anything starts; the quickstart's own yaml passes it."""
    from megarl.config import load_config

    root = os.path.join(os.path.dirname(AGENTS), "..", "..", "..", "..")
    quickstart = os.path.join(root, "yaml_configs", "cpu_quickstart.yaml")
    agent = [f"rollout.env=agent:{AGENTS}:calculator", "data.chat_template=hf"]
    assert load_config(quickstart, [*agent, "actor.mini_batch_prompts=null"]).actor.mini_batch_prompts is None
    with pytest.raises(ConfigError, match=r"actor.mini_batch_prompts=4 with an agent environment .* set "
                                          r"actor.mini_batch_prompts=null"):
        load_config(quickstart, [*agent, "actor.mini_batch_prompts=4"])
    with pytest.raises(ConfigError, match=r"actor.parallel.dp=2 with an agent environment"):
        load_config(quickstart, [*agent, "actor.mini_batch_prompts=null", "actor.parallel={tp: 1, pp: 1, cp: 1, "
                                 "dp: 2}"])
    # without an agent the same settings are fine
    assert load_config(quickstart, ["actor.mini_batch_prompts=4"]).actor.mini_batch_prompts == 4


def test_the_example_react_agent_answers_through_its_tool():
    """examples/agents/react_calculator.py through the endpoint with a policy that has learned the task: it calls
    the calculator, reads the result, answers; reward 1, tool_success 1; its local calculator refuses non-arithmetic
    (expected values: Python's own arithmetic)."""
    example = os.path.join(os.path.dirname(AGENTS), "..", "..", "..", "..", "examples", "agents",
                           "react_calculator.py")
    agent = load_agent(f"agent:{example}:run")
    assert agent.__globals__["calculator"]("(3+4)*5-6/3") == str(int((3 + 4) * 5 - 6 / 3))
    with pytest.raises(ValueError, match="not arithmetic"):
        agent.__globals__["calculator"]("__import__('os')")
    limits = ServeLimits(max_model_len=1024, max_tokens=128)  # the example asks for 96 tokens a turn
    result = AgentRunner(agent, TOK, get_parser("hermes"), limits).run([_record(0, 23, 45)], 2, CalculatorPolicy(),
                                                                        None)
    assert result.scores == [1.0, 1.0]
    assert result.metrics["agent/tool_success"] == 1.0 and result.metrics["agent/tool_calls"] == 1.0
    assert [t.token_ids for t in result.trajectories] == [_final_conversation_ids(23, 45)] * 2


def test_the_example_agent_ends_without_an_answer_when_the_conversation_outgrows_the_context():
    """A context too small for the second turn (the tool call's ~50 tokens + result + generation prompt): the
    server answers 400 context_length_exceeded and the agent ends its episode with reward 0, not an error; its first
    request still trains."""
    example = os.path.join(os.path.dirname(AGENTS), "..", "..", "..", "..", "examples", "agents",
                           "react_calculator.py")
    prompt = len(_rendered([{"role": "user", "content": "23*45="}]))
    limits = ServeLimits(max_model_len=prompt + 96 + 8, max_tokens=128)  # turn 1 fits, turn 2 has 8 tokens of room
    result = AgentRunner(load_agent(f"agent:{example}:run"), TOK, get_parser("hermes"), limits).run(
        [_record(0, 23, 45)], 1, CalculatorPolicy(), None)
    assert result.scores == [0.0] and result.metrics["agent/errors"] == 0.0
    assert result.metrics["agent/requests_per_episode"] == 1.0 and result.metrics["agent/tool_calls"] == 1.0


class StuckPolicy(CalculatorPolicy):
    """A `RolloutClient` whose requests never finish until cancelled (an engine request that runs past the agent's
    limit); counts the requests cancelled."""

    def __init__(self):
        super().__init__()
        self.cancelled = 0

    async def generate(self, request, *, session_id=None, priority=0, timeout_s=None):
        self.requests.append(request)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


def test_an_agent_timed_out_mid_request_has_its_engine_request_cancelled_and_the_phase_ends():
    """The agent's only request never finishes: past rollout.agent_timeout_s the agent is cancelled, and by the
    end of the phase its engine request is cancelled (the client's contract: that aborts it; on the client's
    disconnect at once, else when the phase's endpoint stops, after its graceful bound) and the endpoint has
    stopped; the batch has nothing to train on, which is an error naming the counts."""
    policy = StuckPolicy()
    with pytest.raises(RuntimeError, match=r"no agent episode of this batch \(1 episodes\) got an answer.*"
                                           r"agent/timeouts=1"):
        _runner("calculator", agent_timeout_s=1.0).run([_record(0, 2, 3)], 1, policy, None)
    assert len(policy.requests) == 1 and policy.cancelled == 1
