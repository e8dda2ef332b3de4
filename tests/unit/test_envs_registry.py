"""The environment registry (`rollout.env`: a name or 'file.py:factory') and ToolEnvironment episodes."""

from __future__ import annotations

import asyncio

import pytest

from megarl.config.errors import ConfigError
from megarl.data.dataset import PromptRecord
from megarl.envs import build_env_factory, list_envs, register_env
from megarl.envs.base import EpisodeError, ModelTurn, ToolCall
from megarl.envs.calculator import CALCULATOR_SYSTEM_PROMPT, calculator
from megarl.envs.tool_calls import parse_hermes
from megarl.envs.tool_env import PARSE_ERROR_NAME, ToolEnvironment


def record(prompt="What is 12 * 7 + 1?", answer="85", **extra) -> PromptRecord:
    return PromptRecord(index=3, prompt=prompt, answer=answer, record={"prompt": prompt, "answer": answer, **extra})


def turn(index: int, text: str) -> ModelTurn:
    calls, errors = parse_hermes(text)
    return ModelTurn(index=index, text=text, token_ids=(), tool_calls=tuple(calls), parse_errors=tuple(errors))


def test_calculator_episode():
    env = build_env_factory("calculator")()
    assert [t["function"]["name"] for t in env.tools()] == ["calculator"]
    messages = asyncio.run(env.reset(record()))
    assert messages == [{"role": "system", "content": CALCULATOR_SYSTEM_PROMPT},
                        {"role": "user", "content": "What is 12 * 7 + 1?"}]
    step = asyncio.run(env.step(turn(0, 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": '
                                        '{"expression": "12 * 7 + 1"}}\n</tool_call>')))
    assert step.observations == ({"role": "tool", "name": "calculator", "content": "85", "tool_call_id": "call_0"},)
    assert (step.reward, step.done) == (0.0, False)
    assert step.info["tool_calls"] == 1 and step.info["tool_errors"] == 0
    final = asyncio.run(env.step(turn(1, "12 * 7 + 1 = 85.\n#### 85")))
    assert (final.reward, final.done, final.observations) == (1.0, True, ())
    with pytest.raises(EpisodeError, match="after the episode ended"):
        asyncio.run(env.step(turn(2, "again")))
    asyncio.run(env.close())
    asyncio.run(env.close())  # idempotent


def test_wrong_final_answer_scores_zero_and_options_reach_the_factory():
    env = build_env_factory("calculator", {"reward_fn": "exact_match", "system_prompt": None})()
    assert asyncio.run(env.reset(record())) == [{"role": "user", "content": "What is 12 * 7 + 1?"}]
    assert asyncio.run(env.step(turn(0, " 84 "))).reward == 0.0
    env = build_env_factory("calculator", {"reward_fn": "exact_match"})()
    asyncio.run(env.reset(record()))
    assert asyncio.run(env.step(turn(0, " 85\n"))).reward == 1.0


def test_errors_limits_and_parse_errors_become_tool_messages():
    env = ToolEnvironment([calculator], "gsm8k", max_tool_calls_per_turn=2)
    asyncio.run(env.reset(record(prompt=[{"role": "system", "content": "sys"}, {"role": "user", "content": "q"}])))
    text = ('<tool_call>{"name": "calc", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {oops}}</tool_call>')
    step = asyncio.run(env.step(turn(0, text)))
    contents = [m["content"] for m in step.observations]
    assert contents[0] == "Error: unknown tool 'calc'; available: calculator"
    assert contents[1] == "Error: division by zero (/ 0)"  # the calculator's own error string: not a tool error
    assert contents[2] == ("Error: at most 2 tool calls are run per turn; this call (calculator) was skipped")
    assert step.observations[3]["name"] == PARSE_ERROR_NAME and contents[3].startswith("Error: tool call 4: invalid")
    assert {k: v for k, v in step.info.items() if v} == {"tool_calls": 2, "tool_errors": 1, "unknown_tool": 1,
                                                        "tool_calls_dropped": 1, "tool_parse_errors": 1}
    assert not step.done


def test_a_message_list_prompt_keeps_its_system_message():
    env = ToolEnvironment([calculator], "gsm8k", system_prompt="ours")
    prompt = [{"role": "system", "content": "theirs"}, {"role": "user", "content": "q"}]
    assert asyncio.run(env.reset(record(prompt=prompt))) == prompt
    env = ToolEnvironment([calculator], "gsm8k", system_prompt="ours")
    assert asyncio.run(env.reset(record(prompt=[{"role": "user", "content": "q"}])))[0] == {"role": "system",
                                                                                            "content": "ours"}


def test_a_failing_reward_function_names_the_record_and_turn():
    def bad(response_text, answer, record):
        raise ValueError("nope")

    env = ToolEnvironment([calculator], bad)
    asyncio.run(env.reset(record()))
    with pytest.raises(EpisodeError, match="record 3, turn 0: reward function 'bad' failed: ValueError: nope"):
        asyncio.run(env.step(turn(0, "85")))


def test_reward_gets_text_answer_and_record_dict():
    seen = []
    env = ToolEnvironment([calculator], lambda text, answer, rec: seen.append((text, answer, rec)) or 0.5)
    asyncio.run(env.reset(record(extra_key=1)))
    assert asyncio.run(env.step(turn(0, "  final  \n"))).reward == 0.5
    assert seen == [("final", "85", {"prompt": "What is 12 * 7 + 1?", "answer": "85", "extra_key": 1})]


def test_registry_names_and_errors():
    assert {"calculator", "search"} <= set(list_envs())
    with pytest.raises(ConfigError, match=r"rollout.env: unknown environment 'calculater' \(did you mean "
                                          r"'calculator'\?\)"):
        build_env_factory("calculater")
    with pytest.raises(ConfigError, match="rollout.env='calculator': options .* do not fit"):
        build_env_factory("calculator", {"tools": []})
    with pytest.raises(ConfigError, match="rollout.env.*'path/to/file.py:function'"):
        build_env_factory("envs.txt:make")
    with pytest.raises(ConfigError, match="rollout.env=nope.py:make: file 'nope.py' does not exist"):
        build_env_factory("nope.py:make")
    with pytest.raises(ValueError, match="already registered"):
        register_env("calculator")(lambda: None)


USER_ENV = '''
from megarl.envs import ToolEnvironment

def shout(text: str) -> str:
    """Shout.

    Args:
        text: What to shout.
    """
    return text.upper()

def make_env(suffix="!"):
    return ToolEnvironment([shout], lambda text, answer, record: float(text == answer + suffix))

not_callable = 3
'''


def test_user_file_factory(tmp_path):
    path = tmp_path / "my_env.py"
    path.write_text(USER_ENV)
    factory = build_env_factory(f"{path}:make_env", {"suffix": "?"})
    env1, env2 = factory(), factory()
    assert env1 is not env2  # one environment per episode
    asyncio.run(env1.reset(record(answer="ok")))
    step = asyncio.run(env1.step(ModelTurn(0, "", (), tool_calls=(ToolCall("shout", {"text": "hi"}, "c"),))))
    assert step.observations[0]["content"] == "HI"
    assert asyncio.run(env1.step(turn(1, "ok?"))).reward == 1.0
    with pytest.raises(ConfigError, match=r"defines no 'make_envs' \(did you mean 'make_env'\?\)"):
        build_env_factory(f"{path}:make_envs")
    with pytest.raises(ConfigError, match="'not_callable' is not callable"):
        build_env_factory(f"{path}:not_callable")
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('at import')\n")
    with pytest.raises(ConfigError, match="failed to import: RuntimeError: at import"):
        build_env_factory(f"{broken}:make_env")
