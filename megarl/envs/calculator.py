"""The calculator tool: arithmetic on ints and floats, read with `ast` (never `eval`), bounded so that a model
cannot make it run long or allocate much (`2**10**10` is refused before it is computed).

Operators: + - * / // % ** (binary), + - (unary), parentheses. Limits: the expression's length
(`MAX_EXPRESSION_CHARS`), an exponent's size (`MAX_EXPONENT`), the digits of every integer, literal or
intermediate (`MAX_RESULT_DIGITS`). Every failure is returned as an "Error: ..." string for the model.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Optional

from megarl.envs.registry import register_env
from megarl.envs.tool_env import ToolEnvironment

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 1000
MAX_RESULT_DIGITS = 100

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_SYMBOL = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**"}


class CalculatorError(ValueError):
    """An expression the calculator refuses (the message is shown to the model)."""


_INT_LIMIT = 10 ** MAX_RESULT_DIGITS


def _check(value: int | float) -> int | float:
    if isinstance(value, int):
        if abs(value) >= _INT_LIMIT:
            raise CalculatorError(f"result has more than {MAX_RESULT_DIGITS} digits")
        return value
    if not math.isfinite(value):
        raise CalculatorError("result is not a finite number")
    return value


def _power(base: int | float, exponent: int | float) -> int | float:
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {exponent!r} is larger than {MAX_EXPONENT} in magnitude")
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if exponent * math.log10(abs(base)) > MAX_RESULT_DIGITS:
            raise CalculatorError(f"result has more than {MAX_RESULT_DIGITS} digits")
    if base == 0 and exponent < 0:
        raise CalculatorError("division by zero (0 to a negative power)")
    result = base ** exponent
    if isinstance(result, complex):
        raise CalculatorError("a negative number to a fractional power is not a real number")
    return result


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalculatorError(f"only numbers are allowed, not {node.value!r}")
        return _check(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            return _check(_power(left, right))
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalculatorError(f"division by zero ({_SYMBOL[type(node.op)]} 0)")
        return _check(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.BinOp):
        raise CalculatorError(f"operator {type(node.op).__name__} is not allowed; use + - * / // % **")
    raise CalculatorError(f"{type(node).__name__} is not allowed; only numbers, + - * / // % ** and parentheses")


def format_number(value: int | float) -> str:
    """Ints in full; floats with 12 significant digits ('2' for 2.0, '0.333333333333' for 1/3)."""
    return str(value) if isinstance(value, int) else f"{value:.12g}"


def evaluate(expression: str) -> int | float:
    """The value of arithmetic `expression`; a `CalculatorError` says why it is refused."""
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression is {len(expression)} characters long; at most {MAX_EXPRESSION_CHARS}")
    if not expression.strip():
        raise CalculatorError("empty expression")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"not an arithmetic expression ({e.msg})") from None
    except (RecursionError, MemoryError, ValueError) as e:
        raise CalculatorError(f"expression cannot be read ({type(e).__name__})") from None
    try:
        return _evaluate(tree)
    except RecursionError:
        raise CalculatorError("expression is nested too deeply") from None
    except OverflowError:
        raise CalculatorError("result is too large") from None


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: The expression, using numbers, + - * / // % ** and parentheses, e.g. "(3 + 4) * 2 ** 3".
    """
    try:
        return format_number(evaluate(expression))
    except CalculatorError as e:
        return f"Error: {e}"


CALCULATOR_SYSTEM_PROMPT = ("You can call the calculator tool to evaluate arithmetic. When you know the answer, reply "
                            "without a tool call and end with '#### <number>'.")


@register_env("calculator")
def calculator_env(reward_fn="gsm8k", system_prompt: Optional[str] = CALCULATOR_SYSTEM_PROMPT,
                   max_tool_calls_per_turn: int = 8, max_output_chars: int = 1000,
                   tool_timeout_s: float = 5.0) -> ToolEnvironment:
    """One episode with the calculator tool; the final answer is scored by `reward_fn` (a reward function or a
    registered name; default gsm8k: the number after '####')."""
    return ToolEnvironment([calculator], reward_fn, system_prompt=system_prompt,
                           max_tool_calls_per_turn=max_tool_calls_per_turn, max_output_chars=max_output_chars,
                           tool_timeout_s=tool_timeout_s)
