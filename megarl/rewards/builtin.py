"""Built-in rule-based rewards. Each is `fn(response_text, answer, record) -> float` in [0, 1].

exact_match     1.0 when the normalised response equals the normalised answer (whitespace collapsed, case folded).
gsm8k           1.0 when the response's final number equals the answer's number (numerically, 1e-6 tolerance);
                the response's number is the one after the last '####', else its last number; the answer's
                likewise (GSM8K answers end in '#### 42').
token_fraction  fraction of the response's whitespace-separated tokens that are in the record's target set
                (the CPU quickstart task, `megarl.data.quickstart`).
"""

from __future__ import annotations

import re
from typing import Any, Optional

from megarl.rewards.registry import register_reward

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def normalize_text(text: str) -> str:
    """Collapse whitespace and case-fold (the normalisation of `exact_match`)."""
    return " ".join(str(text).split()).casefold()


def extract_number(text: str) -> Optional[float]:
    """The number after the last '####' if there is one, else the last number in `text`; None when there is none.

    Thousands separators are dropped ("1,000" -> 1000), a leading '-' is kept, a trailing '.' (end of sentence)
    is not part of the number ("the answer is 3.5." -> 3.5).
    """
    text = str(text)
    if "####" in text:
        tail = _NUMBER.findall(text.rsplit("####", 1)[1])
        if tail:
            return _to_float(tail[0])
    found = _NUMBER.findall(text)
    return _to_float(found[-1]) if found else None


def _to_float(s: str) -> Optional[float]:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return None


@register_reward("exact_match")
def exact_match(response_text: str, answer: Optional[Any], record: dict[str, Any]) -> float:
    if answer is None:
        return 0.0
    return float(normalize_text(response_text) == normalize_text(answer))


@register_reward("gsm8k")
def gsm8k(response_text: str, answer: Optional[Any], record: dict[str, Any]) -> float:
    if answer is None:
        return 0.0
    want = extract_number(answer)
    got = extract_number(response_text)
    if want is None or got is None:
        return 0.0
    return float(abs(got - want) <= 1e-6 * max(1.0, abs(want)))


@register_reward("token_fraction")
def token_fraction(response_text: str, answer: Optional[Any], record: dict[str, Any]) -> float:
    """Fraction of response tokens (split on whitespace) in the target set: `record["targets"]` (a list of
    tokens), else the words of `answer`. An empty response scores 0."""
    targets = record.get("targets")
    if targets is None:
        targets = str(answer).split() if answer is not None else []
    words = response_text.split()
    if not words:
        return 0.0
    target_set = set(targets)
    return sum(w in target_set for w in words) / len(words)
