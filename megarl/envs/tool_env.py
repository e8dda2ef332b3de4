"""`ToolEnvironment`: the generic tool-using episode — the model calls tools until it answers without a call.

    reset(record)  -> [system (if `system_prompt`), user: record.prompt]   (a message-list prompt is kept as is,
                      the system prompt put first when it has none)
    step(turn)     a turn with tool calls (or malformed ones): each call runs through the `ToolSet` and becomes a
                   tool message {"role": "tool", "name": <tool>, "content": <output or "Error: ...">, "tool_call_id"};
                   each parse error becomes a tool message named `PARSE_ERROR_NAME`; reward 0, not done.
                   A turn without any: the episode ends, reward = reward_fn(turn.text.strip(), record.answer,
                   record.record) (the signature of `megarl.rewards`).

Step info: the turn's tool counts (`megarl.envs.tools.COUNT_KEYS`, plus `tool_parse_errors` and
`tool_calls_dropped`: calls beyond `max_tool_calls_per_turn`, answered with an error and not run); the final
step's info holds each tool's counters, "<tool>/<counter>" (episode totals).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Optional, Union

from megarl.envs.base import EnvStep, EpisodeError, Message, ModelTurn
from megarl.envs.tools import COUNT_KEYS, Tool, ToolSet
from megarl.rewards.registry import RewardFn, get_reward

STEP_COUNT_KEYS = COUNT_KEYS + ("tool_parse_errors", "tool_calls_dropped")
PARSE_ERROR_NAME = "invalid_tool_call"


def resolve_reward(reward_fn: Union[str, RewardFn]) -> RewardFn:
    """A reward function, or the one registered under that name (`megarl.rewards`)."""
    return get_reward(reward_fn) if isinstance(reward_fn, str) else reward_fn


def first_messages(record: Any, system_prompt: Optional[str]) -> list[Message]:
    """The conversation's start for a `PromptRecord`: its prompt as a user message (or its message list, copied),
    with `system_prompt` first unless the list already starts with a system message."""
    prompt = record.prompt
    messages = [dict(m) for m in prompt] if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if system_prompt is not None and not (messages and messages[0].get("role") == "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


class ToolEnvironment:
    """One episode with tools (see the module docstring).

    tools: `Tool`s or plain functions (a new environment per episode, so stateful tools start fresh).
    reward_fn: `fn(response_text, answer, record) -> float`, or a registered reward name.
    max_tool_calls_per_turn: calls of one turn beyond this many are not run (each answered with an error).
    max_output_chars, tool_timeout_s: the `ToolSet`'s output cut and per-call deadline (seconds).
    """

    def __init__(self, tools: Iterable[Union[Tool, Callable]], reward_fn: Union[str, RewardFn], *,
                 system_prompt: Optional[str] = None, max_tool_calls_per_turn: int = 8,
                 max_output_chars: int = 4000, tool_timeout_s: Optional[float] = 30.0) -> None:
        if max_tool_calls_per_turn < 1:
            raise ValueError(f"max_tool_calls_per_turn must be >= 1, got {max_tool_calls_per_turn}")
        self.toolset = ToolSet(tools, max_output_chars=max_output_chars, timeout_s=tool_timeout_s)
        self.reward_fn = resolve_reward(reward_fn)
        self.system_prompt = system_prompt
        self.max_tool_calls_per_turn = max_tool_calls_per_turn
        self.record: Any = None
        self.done = False

    def tools(self) -> Optional[list[dict]]:
        return self.toolset.schemas() or None

    async def reset(self, record: Any) -> list[Message]:
        self.record = record
        self.done = False
        return first_messages(record, self.system_prompt)

    async def step(self, turn: ModelTurn) -> EnvStep:
        if self.record is None:
            raise EpisodeError(f"{type(self).__name__}.step(turn {turn.index}) before reset()")
        if self.done:
            raise EpisodeError(f"{type(self).__name__}.step(turn {turn.index}) after the episode ended")
        if not turn.tool_calls and not turn.parse_errors:
            self.done = True
            return EnvStep(reward=self.score(turn), done=True, info=self.final_info())
        observations, info = await self.run_tools(turn)
        return EnvStep(observations=tuple(observations), info=info)

    async def run_tools(self, turn: ModelTurn) -> tuple[list[Message], dict]:
        """The turn's tool messages — the calls' results in the turn's order (run one after another: stateful
        tools see them in order), then one message per parse error — and the turn's counts."""
        info = dict.fromkeys(STEP_COUNT_KEYS, 0)
        messages: list[Message] = []
        for i, call in enumerate(turn.tool_calls):
            if i < self.max_tool_calls_per_turn:
                content, call_info = await self.toolset.call(call)
                for k, v in call_info.items():
                    info[k] += v
            else:
                content = (f"Error: at most {self.max_tool_calls_per_turn} tool calls are run per turn; this call "
                           f"({call.name}) was skipped")
                info["tool_calls_dropped"] += 1
            message = {"role": "tool", "name": call.name, "content": content}
            if call.id:
                message["tool_call_id"] = call.id
            messages.append(message)
        for error in turn.parse_errors:
            messages.append({"role": "tool", "name": PARSE_ERROR_NAME, "content": f"Error: {error}"})
            info["tool_parse_errors"] += 1
        return messages, info

    def score(self, turn: ModelTurn) -> float:
        """reward_fn(final text, answer, record dict); a failing reward function is an EpisodeError."""
        record = self.record
        try:
            reward = float(self.reward_fn(turn.text.strip(), record.answer, record.record))
        except Exception as e:
            raise EpisodeError(f"record {getattr(record, 'index', '?')}, turn {turn.index}: reward function "
                               f"{getattr(self.reward_fn, '__name__', self.reward_fn)!r} failed: "
                               f"{type(e).__name__}: {e}") from e
        if not math.isfinite(reward):
            raise EpisodeError(f"record {getattr(record, 'index', '?')}, turn {turn.index}: reward is {reward}")
        return reward

    def final_info(self) -> dict:
        """The episode's last info: each tool's counters ("<tool>/<counter>")."""
        return self.toolset.counters()

    async def close(self) -> None:
        return None
