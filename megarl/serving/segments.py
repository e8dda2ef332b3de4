"""A session's recorded responses -> token-exact segments, by the delta rule (issue 32 item 2's core, no HTTP).

    segments = chain_segments(recorder.records())      # the requests of one session, in the order they were sent
    s.token_ids, s.loss_mask, s.log_probs, s.versions, s.request_ids

A request extends the current segment when its prompt ids start with the segment's tokens so far (the previous
request's prompt + its completion, exactly): its prompt's new tokens (the observation, the template's separators and
generation prompt) are appended with loss_mask 0, its completion with loss_mask 1 and the engine's log-probs. A
request whose prompt does not extend them (the agent rewrote history, or the history re-tokenized differently from
what the engine sampled) starts a new segment; nothing is ever re-tokenized here, so nothing the engine did not
sample is in a loss mask. Only a request's first choice (n = 1, as agents send) continues a chain; a request with
n > 1 ends its segment with its first choice (its other choices are not part of any chain).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from megarl.serving.openai_protocol import ResponseRecord


@dataclasses.dataclass
class SessionSegment:
    """One token-exact chain of requests. token_ids [T]; loss_mask [T] (1: sampled by the engine); log_probs [T]
    (the engine's for sampled tokens, 0.0 elsewhere); versions [T] (the weights version of each sampled token, -1
    elsewhere and where the client reported none); request_ids: the requests in the chain, in order."""

    token_ids: list[int]
    loss_mask: list[int]
    log_probs: list[float]
    versions: list[int]
    request_ids: list[str]

    def __len__(self) -> int:
        return len(self.token_ids)


def _start(record: ResponseRecord) -> SessionSegment:
    n = len(record.prompt_ids)
    return SessionSegment(list(record.prompt_ids), [0] * n, [0.0] * n, [-1] * n, [])


def _append(segment: SessionSegment, record: ResponseRecord, new_prompt: Sequence[int]) -> None:
    choice = record.choices[0]
    k = len(new_prompt)
    segment.token_ids += list(new_prompt)
    segment.loss_mask += [0] * k
    segment.log_probs += [0.0] * k
    segment.versions += [-1] * k
    segment.token_ids += choice.token_ids
    segment.loss_mask += [1] * len(choice.token_ids)
    segment.log_probs += list(choice.log_probs)
    segment.versions += list(choice.versions) if choice.versions is not None else [-1] * len(choice.token_ids)
    segment.request_ids.append(record.request_id)


def chain_segments(records: Sequence[ResponseRecord]) -> list[SessionSegment]:
    """The segments of one session's requests (in the order sent), by the delta rule (see the module docstring)."""
    segments: list[SessionSegment] = []
    current: Optional[SessionSegment] = None
    for record in records:
        if not record.choices:
            raise ValueError(f"recorded response {record.request_id!r} has no choices")
        prompt = list(record.prompt_ids)
        if current is not None and prompt[:len(current)] == current.token_ids:
            _append(current, record, prompt[len(current):])
        else:
            current = _start(record)
            segments.append(current)
            _append(current, record, [])
        if len(record.choices) > 1:
            current = None
    return segments
