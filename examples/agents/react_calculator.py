"""A ReAct agent written only against the `openai` client: it answers an arithmetic question, calling a local
calculator function as its tool until the model answers in plain text (at most MAX_TURNS model turns).

Trained by megarl through the OpenAI endpoint (yaml_configs/cpu_agent_quickstart.yaml):

    rollout:
      env: agent:examples/agents/react_calculator.py:run

megarl calls `run(record, base_url)` once per episode with the episode's own base URL; the same function runs
against any OpenAI-compatible server (`megarl serve`, vLLM, ...):

    asyncio.run(run(types.SimpleNamespace(prompt="12*34=", answer="408"), "http://127.0.0.1:8000/v1"))

Reward: 1.0 when the final answer is the record's answer, else 0.0; the info's numbers (tool_calls, tool_success)
are logged as agent/tool_calls and agent/tool_success.
"""

from __future__ import annotations

import ast
import json
import operator

import openai

MAX_TURNS = 3
MAX_TOKENS_PER_TURN = 96
TEMPERATURE = 1.0  # sampling for training: GRPO needs different episodes in a group

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression (+, -, *, /, parentheses).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """The value of an arithmetic expression, as text (an integer when it is one); raises ValueError otherwise."""
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value,
                                                                                                      bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")

    if len(expression) > 200:
        raise ValueError("expression too long")
    result = value(ast.parse(expression, mode="eval").body)
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


async def run(record, base_url: str):
    """One episode: the ReAct loop over the OpenAI chat API at `base_url`. Returns (reward, info)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
    messages = [{"role": "user", "content": record.prompt}]
    calls = succeeded = 0
    answer = ""
    try:
        for _ in range(MAX_TURNS):
            try:
                response = await client.chat.completions.create(
                    model="policy", messages=messages, tools=TOOLS, temperature=TEMPERATURE,
                    max_tokens=MAX_TOKENS_PER_TURN)
            except openai.BadRequestError as e:
                if e.code == "context_length_exceeded":  # the conversation outgrew the context: no answer
                    break
                raise
            message = response.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:  # a plain answer ends the episode
                answer = (message.content or "").strip()
                break
            for call in message.tool_calls:  # act, observe
                calls += 1
                try:
                    result = calculator(json.loads(call.function.arguments)["expression"])
                    succeeded += 1
                except Exception as e:  # noqa: BLE001 -- the model reads the error and may try again
                    result = f"error: {e}"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    finally:
        await client.close()
    reward = float(answer == str(record.answer).strip())
    return reward, {"tool_calls": float(calls), "tool_success": float(calls > 0 and succeeded == calls)}
