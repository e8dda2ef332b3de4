"""The `python` environment: the model runs code in the local sandbox (`megarl.envs.sandbox`) as a tool.

    rollout:
      env: python
      env_options: {cpu_seconds: 5, wall_seconds: 10, memory_mb: 512, allow_network: false}

One `PythonSandbox` per limits per process (its isolation probe runs once, not per episode); each episode gets a new
`PythonTool` (its own counters) over it. Every run is a fresh process tree in a fresh directory, so episodes share
nothing but the limits.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

from megarl.envs.registry import register_env
from megarl.envs.sandbox import PythonSandbox, PythonTool, SandboxLimits
from megarl.envs.tool_env import ToolEnvironment
from megarl.envs.tools import Tool

PYTHON_SYSTEM_PROMPT = ("You can call the python tool to run Python code (print what you need to see). When you know "
                        "the answer, reply without a tool call and end with '#### <answer>'.")


class SandboxedPython(Tool):
    """`PythonTool` as a `Tool` of a `ToolSet`: the schema is the sandbox tool's, the counters its own."""

    name = "python"

    def __init__(self, sandbox: PythonSandbox) -> None:
        super().__init__()
        self.tool = PythonTool(sandbox)
        self.schema = self.tool.schema()
        self.counters = self.tool.counters

    async def run(self, code: str) -> str:
        return await self.tool.python(code)


@functools.lru_cache(maxsize=8)
def shared_sandbox(limits: SandboxLimits) -> PythonSandbox:
    """The process's sandbox for `limits` (probed once)."""
    return PythonSandbox(limits)


@register_env("python")
def python_env(reward_fn: Any = "gsm8k", system_prompt: Optional[str] = PYTHON_SYSTEM_PROMPT,
               max_tool_calls_per_turn: int = 4, max_output_chars: int = 2000, **limits: Any) -> ToolEnvironment:
    """One episode with the sandboxed python tool; `limits` are `SandboxLimits` fields (given as
    `rollout.env_options`). The tool's own wall clock bounds a call, plus 5 s for the sandbox's start."""
    sandbox = shared_sandbox(SandboxLimits(**limits))
    return ToolEnvironment([SandboxedPython(sandbox)], reward_fn, system_prompt=system_prompt,
                           max_tool_calls_per_turn=max_tool_calls_per_turn, max_output_chars=max_output_chars,
                           tool_timeout_s=sandbox.limits.wall_seconds + 5.0)
