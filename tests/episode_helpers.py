"""What the episode tests share (`megarl.envs.episode`): a scripted `RolloutClient` (what a policy that has learned
the task would sample, one request at a time) and an environment that records the order of its calls, whose first
tool call sleeps until another episode has reached its last turn. The real engine behind `InProcessClient` runs in
tests/distributed/test_engine_server.py and tests/e2e."""

from __future__ import annotations

import asyncio
from typing import Callable, Optional

from megarl.envs.base import EnvStep
from megarl.rollout.engine import Completion, GenerationOutput


def seeded_log_probs(request, n: int) -> list[float]:
    """Log-probs that depend on the request's seed (its sampling seed and seed_index), as a real engine's samples
    do: two paths that seed a request differently disagree here."""
    base = ((request.sampling.seed or 0) % 1000) / 10_000 + request.seed_index / 100
    return [-(base + (j + 1) / 1000) for j in range(n)]


class ScriptedClient:
    """A `RolloutClient` whose completion of a request is `reply(prompt text)` encoded with `tokenizer` (or
    `reply_ids(prompt ids)` as given) + the end-of-turn token, cut at the request's max_new_tokens; log-probs
    `log_probs(request, n)`; `versions(j)`: the version it reports for token j (None: it reports none, and
    `weight_version` is read). Records every request with its session (`requests`) and the most requests it held at
    once (`most_in_flight`)."""

    replicas = 1

    def __init__(self, tokenizer, reply: Optional[Callable[[str], str]] = None, *,
                 reply_ids: Optional[Callable[[list], list]] = None, log_probs=seeded_log_probs,
                 versions: Optional[Callable[[int], int]] = None, weight_version: Optional[int] = None) -> None:
        if (reply is None) == (reply_ids is None):
            raise ValueError("ScriptedClient: give exactly one of reply (text) or reply_ids (token ids)")
        self.tokenizer, self.reply, self.reply_ids, self.log_probs = tokenizer, reply, reply_ids, log_probs
        self.versions, self.weight_version = versions, weight_version
        self.requests, self.in_flight, self.most_in_flight = [], 0, 0

    def sample(self, prompt_ids: list) -> list:
        """The ids the policy writes after `prompt_ids`, its end-of-turn token included, before any cut."""
        if self.reply_ids is not None:
            return list(self.reply_ids(prompt_ids)) + [self.tokenizer.eos_token_id]
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        return self.tokenizer(self.reply(text), add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]

    async def generate(self, request, *, session_id=None, priority=0, timeout_s=None):
        self.requests.append((request, session_id))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0)  # others run meanwhile, as on a server
            await asyncio.sleep(0)
            completions = []
            for k in range(request.sampling.samples_per_prompt):
                ids = self.sample(list(request.prompt_ids))[:request.sampling.max_new_tokens]
                reason = "stop" if ids[-1] == self.tokenizer.eos_token_id else "length"
                versions = None if self.versions is None else [self.versions(j) for j in range(len(ids))]
                completions.append(Completion(k, ids, self.log_probs(request, len(ids)), reason, versions))
            return GenerationOutput(request.request_id, list(request.prompt_ids), completions, True)
        finally:
            self.in_flight -= 1

    async def abort(self, request_ids):
        return 0

    def metrics(self):
        return {}


class SlowFirstToolEnv:
    """`turns` model turns: the user answers each but the last with `reply`, the last ends the episode (reward 1).
    Records ("step", record, turn) when a step starts and ("stepped", record, turn) when it returns, in `events`.
    Record 0's first step is a slow tool: it returns once record 1's last step has started, or after `slow_s`,
    whichever first. `holder`: a dict the episodes of one run share (the release event, made inside the run's event
    loop). `prompt`: the user's first message (None: the record's prompt)."""

    def __init__(self, record, events: list, holder: dict, slow_s: float, turns: int = 3, reply: str = "go on",
                 prompt: Optional[str] = None) -> None:
        self.record, self.events, self.holder, self.slow_s = record, events, holder, slow_s
        self.turns, self.reply, self.prompt = turns, reply, prompt

    async def reset(self, record):
        self.release = self.holder.setdefault("release", asyncio.Event())
        return [{"role": "user", "content": record.prompt if self.prompt is None else self.prompt}]

    def tools(self):
        return None

    async def step(self, turn):
        me, last = self.record.index, self.turns - 1
        self.events.append(("step", me, turn.index))
        if me == 1 and turn.index == last:
            self.release.set()
        if me == 0 and turn.index == 0:
            try:
                await asyncio.wait_for(self.release.wait(), self.slow_s)
            except asyncio.TimeoutError:
                pass
        self.events.append(("stepped", me, turn.index))
        if turn.index == last:
            return EnvStep(reward=1.0, done=True)
        return EnvStep(({"role": "user", "content": self.reply},))

    async def close(self):
        pass
