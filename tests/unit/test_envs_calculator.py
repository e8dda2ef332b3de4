"""The calculator tool: values checked against Python's own arithmetic; everything else an error string."""

from __future__ import annotations

import pytest

from megarl.envs.calculator import MAX_EXPRESSION_CHARS, calculator


@pytest.mark.parametrize("expression, expected", [
    ("(3 + 4) * 2 ** 3", str((3 + 4) * 2 ** 3)),
    ("7 / 2", "3.5"),
    ("8 / 2", "4"),
    ("1 / 3", "0.333333333333"),
    ("-7 // 2", str(-7 // 2)),
    ("-7 % 3", str(-7 % 3)),
    ("2 ** -2", "0.25"),
    ("2 ** 0.5", "1.41421356237"),
    ("-(2 - 5) * +1.5", "4.5"),
    ("  12345678901234567890 * 98765432109876543210 ", str(12345678901234567890 * 98765432109876543210)),
    ("0.1 + 0.2", "0.3"),
])
def test_values(expression, expected):
    assert calculator(expression) == expected


@pytest.mark.parametrize("expression, message", [
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("2 ** 10 ** 10", "exponent 10000000000 is larger than 1000"),
    ("9 ** 999", "more than 100 digits"),
    ("10 ** 60 * 10 ** 60", "more than 100 digits"),
    ("1" * 101, "more than 100 digits"),
    ("10.0 ** 400", "result is too large"),
    ("1e308 * 10", "not a finite number"),
    ("(-8) ** 0.5", "not a real number"),
    ("__import__('os').system('ls')", "Call is not allowed"),
    ("x + 1", "Name is not allowed"),
    ("True + 1", "only numbers are allowed"),
    ("'a' * 3", "only numbers are allowed"),
    ("1 << 2", "operator LShift is not allowed"),
    ("2 +", "not an arithmetic expression"),
    ("", "empty expression"),
    ("1+" * MAX_EXPRESSION_CHARS + "1", f"at most {MAX_EXPRESSION_CHARS}"),
    ("[1, 2]", "List is not allowed"),
])
def test_refusals_are_error_strings(expression, message):
    out = calculator(expression)
    assert out.startswith("Error: ") and message in out, out
