"""LLM judges: a generative reward model served on engines of its own, scoring responses as their groups finish.

    judge = Judge(cfg.reward.judge, tokenizer, client)          # client: a RolloutClient over the judge engines
    scores = judge.score_group(questions, responses, references) # blocking, thread-safe; never raises per response
    metrics = judge.take_metrics()                               # judge/... counts of the calls since the last take

Prompt. `template` (a format string with {question} {response} {reference} {transcript}) is the judge's one user
message, rendered by the judge tokenizer's chat template with the generation prompt (`render_prompt`). Rewards:
`combine` weighs the judge's scores with the rule reward's (reward.judge.weight, function_weight); the callers are
`megarl.trainer.producer.score_samples` (single-turn) and `judge_episodes` (multi-turn: each episode's final turn).

Parsers (`reward.judge.parse`):
- number: greedy answer (max_new_tokens), the first number in it (`parse_number`), which must lie in score_range;
  normalised onto [0, 1] unless normalize is false.
- verdict: greedy answer, the first word of it that is a key of `verdicts` (case-insensitive; `parse_verdict`).
- yes_no_logprob: P(yes) / (P(yes) + P(no)) of the judge's next token after the prompt, yes/no the first tokens of
  the two `yes_no` words. Read from vLLM's prompt log-probs (`SamplingSettings.prompt_log_probs`, vLLM
  `prompt_logprobs=0`: raw log-softmax of the logits): one request per candidate, its prompt the judge prompt plus
  that token, the log-prob of that last prompt token is log p(candidate | prompt). Chosen over the sampled token's
  top-k log-probs, which hold a candidate only when it ranks in the top k (at most vLLM's max_logprobs, 20): the
  prompt log-probs always hold both, exactly.

Failures never stop the run: a request that fails (timeout, a dead engine, a refused request) or a prompt over
max_prompt_tokens counts in `judge/errors`, an answer that does not parse in `judge/parse_failures`; either scores
`fallback_score`. Cache (`cache: true`): a (question, response, reference, transcript) already answered (or being
answered: a group's identical responses wait for the first) is not judged again (`judge/cache_hits`); errors are not
cached; the least recently used entries beyond `cache_entries` are forgotten.
Concurrency: at most `max_concurrent` judge requests in flight, over every caller (one semaphore).

Nothing here imports vLLM or Ray: the client is any `RolloutClient` (`RolloutRouter` over the judge's engine
servers, `megarl.controller.serving`; `InProcessClient` in tests).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import math
import re
import threading
import time
import uuid
from typing import Any, Optional, Sequence

from megarl.config.judge_template import PLACEHOLDERS, JudgeTemplateError, load_template  # noqa: F401 (re-exported)
from megarl.rollout.engine import GenerationRequest, SamplingSettings

logger = logging.getLogger("megarl.rewards")

_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)")
_WORD = re.compile(r"[^\W\d_]+(?:[-'][^\W\d_]+)*")
# How many failures of each kind are logged (then only counted, in the metrics)
_LOGGED_FAILURES = 3


def question_text(prompt: Any) -> str:
    """The question a judge is shown from a dataset prompt: the string itself, or the content of the last user
    message of a chat prompt (the last message when none is a user's)."""
    if isinstance(prompt, str):
        return prompt
    users = [m for m in prompt if m.get("role") == "user"] or list(prompt)
    return str(users[-1].get("content", ""))


def render_prompt(tokenizer: Any, template: str, question: str, response: str, reference: Any,
                  transcript: Optional[str] = None) -> list[int]:
    """Token ids of the judge prompt: `template` filled in, as one user message through the tokenizer's chat
    template with the generation prompt (tokens as the chat template's text encodes, no special tokens added).
    `transcript` (the {transcript} placeholder) defaults to the response (single-turn)."""
    message = template.format(question=question, response=response, reference="" if reference is None else reference,
                              transcript=response if transcript is None else transcript)
    text = tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                         add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def parse_number(answer: str, low: float, high: float) -> Optional[float]:
    """The first number in `answer` when it lies in [low, high]; None when there is none or it lies outside."""
    m = _NUMBER.search(answer)
    if m is None:
        return None
    value = float(m.group())
    return value if low <= value <= high and math.isfinite(value) else None


def parse_verdict(answer: str, verdicts: dict[str, float]) -> Optional[float]:
    """The score of the first word of `answer` that is a verdict (case-insensitive); None when no word is."""
    table = {k.lower(): v for k, v in verdicts.items()}
    for word in _WORD.findall(answer.lower()):
        if word in table:
            return float(table[word])
    return None


def yes_probability(log_p_yes: float, log_p_no: float) -> float:
    """P(yes) / (P(yes) + P(no)) from the two log-probs (a two-way softmax, stable for any magnitudes)."""
    return 1.0 / (1.0 + math.exp(min(log_p_no - log_p_yes, 700.0)))


def candidate_tokens(tokenizer: Any, words: Sequence[str]) -> tuple[int, int]:
    """The first token id of each of the (yes, no) words; raises ValueError when they coincide or one is empty."""
    ids = [tokenizer.encode(w, add_special_tokens=False) for w in words]
    if not all(ids):
        raise ValueError(f"reward.judge.yes_no: {list(words)}: a word encodes to no token with the judge's tokenizer")
    if ids[0][0] == ids[1][0]:
        raise ValueError(f"reward.judge.yes_no: {list(words)} start with the same token ({ids[0][0]}) under the "
                         "judge's tokenizer; pick words whose first tokens differ")
    return ids[0][0], ids[1][0]


@dataclasses.dataclass
class JudgeCounters:
    """Counts since the last `take_metrics`: responses scored (`responses`), judge requests sent, responses scored
    from the cache, parse failures and errors (each a response scored `fallback_score`), the seconds the judged
    responses' requests took (summed) and the scores' sum."""

    responses: int = 0
    requests: int = 0
    cache_hits: int = 0
    parse_failures: int = 0
    errors: int = 0
    judged: int = 0
    latency_s: float = 0.0
    score_sum: float = 0.0
    function_count: int = 0
    function_sum: float = 0.0

    def metrics(self) -> dict[str, float]:
        return {"judge/requests": float(self.requests), "judge/cache_hits": float(self.cache_hits),
                "judge/parse_failures": float(self.parse_failures), "judge/errors": float(self.errors),
                "judge/latency_s": self.latency_s / self.judged if self.judged else 0.0,
                "judge/score_mean": self.score_sum / self.responses if self.responses else float("nan"),
                **({"judge/function_score_mean": self.function_sum / self.function_count}
                   if self.function_count else {})}


class _Failure(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind  # "parse" | "error"


class Judge:
    """Scores responses with a judge model behind `client` (see the module docstring).

    cfg: a `JudgeConfig`; tokenizer: the judge's HF tokenizer (chat template, encode, decode); client: a
    `RolloutClient` over the judge's engines (`generate(request, session_id=..., timeout_s=...)`). The judge runs
    its requests on an event loop of its own (a daemon thread), so `score_group` may be called from any thread."""

    def __init__(self, cfg: Any, tokenizer: Any, client: Any) -> None:
        self.cfg, self.tokenizer, self.client = cfg, tokenizer, client
        self.template = load_template(cfg.template)
        self.candidates = candidate_tokens(tokenizer, cfg.yes_no) if cfg.parse == "yes_no_logprob" else None
        self.counters = JudgeCounters()
        self._counter_lock = threading.Lock()
        # (question, response, reference) -> its score's future, least recently used first (at most cache_entries)
        self._cache: collections.OrderedDict[tuple, asyncio.Future] = collections.OrderedDict()
        # request ids unique among the engines' requests in flight, whoever else sends them: judge/<this>/<n>
        self._prefix = f"judge/{uuid.uuid4().hex[:8]}/"
        self._ids = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._semaphore: Optional[asyncio.Semaphore] = None
        self._logged: dict[str, int] = {"parse": 0, "error": 0}
        self._thread = threading.Thread(target=self._loop.run_forever, name="megarl-judge", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------------ public
    def score_group(self, questions: Sequence[str], responses: Sequence[str], references: Sequence[Any],
                    transcripts: Optional[Sequence[str]] = None) -> list[float]:
        """[len(responses)] scores of the responses (each with its question and reference; `transcripts`: each
        episode's text after the prompt, the template's {transcript}, default the responses), judged concurrently
        within max_concurrent; a failed or unparseable judgement scores fallback_score (counted)."""
        items = list(zip(questions, responses, references, transcripts if transcripts is not None else responses))
        if not items:
            return []
        future = asyncio.run_coroutine_threadsafe(self._score_all(items), self._loop)
        # every request is bounded by timeout_s; at worst they run one after another, two per yes_no response
        bound = self.cfg.timeout_s * (2 * len(items) + 1) + 60.0
        try:
            return future.result(timeout=bound)
        except TimeoutError:
            future.cancel()
            raise TimeoutError(f"the judge did not score a group of {len(items)} responses within {bound:.0f} s "
                               f"(reward.judge.timeout_s={self.cfg.timeout_s} per request)") from None

    def combine(self, judge_scores: Sequence[float], function_scores: Optional[Sequence[float]]) -> list[float]:
        """[len(judge_scores)] rewards: weight x judge score + function_weight x rule score (`function_scores`, the
        rule reward of the same responses; None when function_weight is 0). The rule scores' mean is counted
        (`judge/function_score_mean`)."""
        w, fw = self.cfg.weight, self.cfg.function_weight
        if function_scores is None:
            return [w * j for j in judge_scores]
        if len(function_scores) != len(judge_scores):
            raise ValueError(f"{len(function_scores)} rule scores for {len(judge_scores)} judged responses")
        with self._counter_lock:
            self.counters.function_count += len(function_scores)
            self.counters.function_sum += float(sum(function_scores))
        return [w * j + fw * f for j, f in zip(judge_scores, function_scores)]

    def take_metrics(self) -> dict[str, float]:
        """The `judge/...` metrics of the responses scored since the last call (then reset)."""
        with self._counter_lock:
            counters, self.counters = self.counters, JudgeCounters()
        return counters.metrics()

    def close(self) -> None:
        """Stop the judge's event loop (requests still in flight are abandoned)."""
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    # ------------------------------------------------------------------------------------------------ pieces
    async def _score_all(self, items: list[tuple]) -> list[float]:
        if self._semaphore is None:
            self._semaphore = asyncio.Semaphore(self.cfg.max_concurrent)
        return list(await asyncio.gather(*(self._score_one(*item) for item in items)))

    async def _score_one(self, question: str, response: str, reference: Any, transcript: str) -> float:
        key = (question, response, None if reference is None else str(reference), transcript)
        cached = self._cache.get(key) if self.cfg.cache else None
        if cached is not None:
            self._cache.move_to_end(key)
            score = await asyncio.shield(cached)
            self._count(score, cache_hit=True)
            return score
        entry = self._loop.create_future()
        if self.cfg.cache:
            self._cache[key] = entry
            while len(self._cache) > self.cfg.cache_entries:
                self._cache.popitem(last=False)  # its waiters hold the future itself
        started = time.perf_counter()
        try:
            try:
                score = await self._judge(question, response, reference, transcript)
            except _Failure:
                raise
            except Exception as e:  # anything else the judging raised (a tokenizer that cannot decode, ...)
                raise _Failure("error", f"{type(e).__name__}: {e}") from None
            entry.set_result(score)
            self._count(score, latency_s=time.perf_counter() - started)
        except _Failure as failure:
            score = self.cfg.fallback_score
            entry.set_result(score)
            if failure.kind == "error":
                self._cache.pop(key, None)  # a later response asks again
            self._count(score, failure=failure.kind, latency_s=time.perf_counter() - started)
            self._log_failure(failure, question, response)
        return score

    async def _judge(self, question: str, response: str, reference: Any, transcript: str) -> float:
        """One response's score, or `_Failure` (kind "error": no answer; "parse": an answer without a score)."""
        c = self.cfg
        try:
            prompt = render_prompt(self.tokenizer, self.template, question, response, reference, transcript)
        except Exception as e:  # a chat template that refuses the message
            raise _Failure("error", f"the judge prompt did not render: {type(e).__name__}: {e}") from None
        if len(prompt) > c.max_prompt_tokens:
            raise _Failure("error", f"the judge prompt has {len(prompt)} tokens, more than reward.judge."
                                    f"max_prompt_tokens={c.max_prompt_tokens}")
        if c.parse == "yes_no_logprob":
            scoring = SamplingSettings(temperature=0.0, max_new_tokens=1, seed=0, prompt_log_probs=True)
            outs = await asyncio.gather(*(self._request(prompt + [token], scoring) for token in self.candidates))
            log_p = [out.prompt_log_probs[-1] if out.prompt_log_probs else None for out in outs]
            if None in log_p:
                raise _Failure("error", "the judge engine returned no prompt log-probs")
            return yes_probability(*log_p)
        answering = SamplingSettings(temperature=0.0, max_new_tokens=c.max_new_tokens, seed=0)
        out = await self._request(prompt, answering)
        answer = self.tokenizer.decode(out.completions[0].token_ids, skip_special_tokens=True)
        if c.parse == "number":
            low, high = c.score_range
            value = parse_number(answer, low, high)
            if value is None:
                raise _Failure("parse", f"no number in [{low}, {high}] in the judge's answer {answer!r}")
            return (value - low) / (high - low) if c.normalize else value
        value = parse_verdict(answer, c.verdicts)
        if value is None:
            raise _Failure("parse", f"none of the verdicts {sorted(c.verdicts)} in the judge's answer {answer!r}")
        return value

    async def _request(self, prompt: list[int], sampling: SamplingSettings):
        request = GenerationRequest(f"{self._prefix}{next(self._ids)}", prompt, sampling)
        async with self._semaphore:
            with self._counter_lock:
                self.counters.requests += 1
            try:
                return await self.client.generate(request, session_id=None, timeout_s=self.cfg.timeout_s)
            except Exception as e:  # timeout, a dead engine, a refused request: counted, never fatal
                raise _Failure("error", f"judge request failed: {type(e).__name__}: {e}") from None

    def _count(self, score: float, *, cache_hit: bool = False, failure: Optional[str] = None,
               latency_s: float = 0.0) -> None:
        with self._counter_lock:
            k = self.counters
            k.responses += 1
            k.score_sum += score
            if cache_hit:
                k.cache_hits += 1
                return
            k.judged += 1
            k.latency_s += latency_s
            if failure == "parse":
                k.parse_failures += 1
            elif failure == "error":
                k.errors += 1

    def _log_failure(self, failure: _Failure, question: str, response: str) -> None:
        if self._logged[failure.kind] >= _LOGGED_FAILURES:
            return
        self._logged[failure.kind] += 1
        more = " (further ones are only counted)" if self._logged[failure.kind] == _LOGGED_FAILURES else ""
        logger.warning("judge %s for question %r, response %r: %s; scored reward.judge.fallback_score=%s%s",
                       "parse failure" if failure.kind == "parse" else "error", question[:80], response[:80],
                       failure, self.cfg.fallback_score, more)
