"""The environment protocol of multi-turn, tool-using rollouts (docs/multi_turn.md).

An episode alternates model turns and observations:

    messages = await env.reset(record)            # the first messages (chat format: {"role", "content"})
    loop:
        model turn (sampled tokens, decoded text, parsed tool calls)
        step = await env.step(turn)               # observation messages (tool results, user replies), reward, done
        until step.done or a limit (rollout.max_turns, token budgets)

Environments are async so that many episodes advance while the engine batches their turns; nothing here imports
vLLM, Ray or the trainer. Messages are plain dicts in the chat-template format transformers uses
(`{"role": "user" | "assistant" | "tool" | "system", "content": str, ...}`; a tool result also carries "name"), so
the observation tokens are rendered by the tokenizer's own chat template.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Protocol

Message = dict  # {"role": ..., "content": ..., optional "name" / "tool_calls"}


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One tool call parsed from a model turn: the tool's `name`, its `arguments` (the JSON object the model wrote)
    and `id` (the parser's, unique within the turn)."""

    name: str
    arguments: dict
    id: str = ""


@dataclasses.dataclass(frozen=True)
class ModelTurn:
    """What the policy produced in one turn of an episode.

    index: 0-based turn number. text: the sampled tokens decoded (special tokens kept, the end-of-turn token that
    stopped the turn left out). token_ids: the sampled ids (that token included),
    exactly as the engine produced them. tool_calls: the calls parsed from `text`; parse_errors: one message per
    malformed call (the environment shows it to the model as an observation, never raises). finish_reason: the
    engine's ('stop' | 'length')."""

    index: int
    text: str
    token_ids: tuple
    tool_calls: tuple = ()
    parse_errors: tuple = ()
    finish_reason: str = "stop"


@dataclasses.dataclass(frozen=True)
class EnvStep:
    """An environment's answer to a model turn: `observations` (messages appended to the conversation; none when
    done), `reward` (this turn's, summed into the episode's score), `done` (the episode ends), `info` (counted
    metrics, e.g. {"tool_calls": 1, "tool_errors": 0})."""

    observations: tuple = ()
    reward: float = 0.0
    done: bool = False
    info: dict = dataclasses.field(default_factory=dict)


class Environment(Protocol):
    """One episode's environment (a new instance per episode: it may hold state, e.g. a sandbox's directory)."""

    async def reset(self, record: Any) -> list[Message]:
        """The conversation's first messages for dataset record `record` (a `PromptRecord`)."""
        ...

    async def step(self, turn: ModelTurn) -> EnvStep:
        """React to the model's turn."""
        ...

    def tools(self) -> Optional[list[dict]]:
        """The JSON schemas passed to the chat template's `tools=` (None: no tools)."""
        ...

    async def close(self) -> None:
        """Release what the episode holds (temporary directories, processes). Idempotent."""
        ...


class EpisodeError(RuntimeError):
    """An environment failed outside what it reports to the model; the message names the episode and turn."""
