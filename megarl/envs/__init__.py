"""Multi-turn, tool-using rollouts: the environment protocol (`base`), tools, tool-call parsers, the sandbox and the
shipped environments. See docs/multi_turn.md."""

from megarl.envs.base import Environment, EnvStep, EpisodeError, Message, ModelTurn, ToolCall

__all__ = ["Environment", "EnvStep", "EpisodeError", "Message", "ModelTurn", "ToolCall"]
