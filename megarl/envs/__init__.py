"""Multi-turn, tool-using rollouts: the environment protocol (`base`), tools (`tools`), tool-call parsers
(`tool_calls`), the generic tool environment (`tool_env`), the registry behind `rollout.env` (`registry`) and the
shipped environments (`calculator`, `search`, `python`: code in the local sandbox, `sandbox`). See
docs/multi_turn.md."""

from megarl.envs import calculator, python_env, search  # noqa: E402,F401  (registers the built-in environments)
from megarl.envs.base import Environment, EnvStep, EpisodeError, Message, ModelTurn, ToolCall
from megarl.envs.registry import build_env_factory, get_env, list_envs, load_env_file, register_env
from megarl.envs.tool_calls import get_parser, list_parsers, parse_hermes, register_parser
from megarl.envs.tool_env import ToolEnvironment
from megarl.envs.tools import FunctionTool, Tool, ToolSet, function_schema

__all__ = ["EnvStep", "Environment", "EpisodeError", "FunctionTool", "Message", "ModelTurn", "Tool", "ToolCall",
           "ToolEnvironment", "ToolSet", "build_env_factory", "function_schema", "get_env", "get_parser",
           "list_envs", "list_parsers", "load_env_file", "parse_hermes", "register_env", "register_parser"]
