"""The template of an LLM judge (`reward.judge.template`): read and checked here, at config validation (below the
judge itself, `megarl.rollout.judge`, which renders it for each response)."""

from __future__ import annotations

import string

PLACEHOLDERS = ("question", "response", "reference", "transcript")


class JudgeTemplateError(ValueError):
    """A judge template that cannot render: an unknown placeholder, no {response}, a missing file."""


def load_template(spec: str) -> str:
    """The template text of `reward.judge.template`: the string itself, or the file's text for '@path'. Checked:
    its placeholders are among {question} {response} {reference} {transcript} and {response} is one of them."""
    text = spec
    if spec.startswith("@"):
        try:
            with open(spec[1:], encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise JudgeTemplateError(f"cannot read the template file {spec[1:]!r}: {e.strerror}") from None
    try:
        fields = {name.split(".")[0].split("[")[0] for _, name, _, _ in string.Formatter().parse(text)
                  if name is not None}
    except ValueError as e:
        raise JudgeTemplateError(f"not a valid format string ({e}); write literal braces as {{{{ and }}}}") from None
    unknown = sorted(fields - set(PLACEHOLDERS))
    if unknown:
        raise JudgeTemplateError(f"unknown placeholder(s) {unknown}; the template may use {{question}}, {{response}}, "
                                 "{reference} and {transcript} (literal braces doubled)")
    if "response" not in fields:
        raise JudgeTemplateError("the template has no {response} placeholder: the judge would not see the response")
    return text
