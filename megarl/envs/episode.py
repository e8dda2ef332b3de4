"""Multi-turn episodes, token in, token out: the loop that turns environments and an engine into `Trajectory`s.

    runner = EpisodeRunner(tokenizer, env_factory, parser, limits)
    result = runner.run(records, n, client, sampling, uid_prefix=...)     # client: a `RolloutClient`
    result.trajectories, result.scores, result.metrics

One coroutine per episode (`run_episode`): each episode, from reset to done,
submits its next turn to the client as soon as its previous observation is ready, and awaits only its own requests
and its own environment, so a slow tool call or a long turn holds nobody else; at most `max_concurrent_episodes`
are in flight (`rollout.max_concurrent_episodes`), the engine batching whatever requests are in flight. A turn is one
request: id f"{uid}/t{turn}", session = the episode's uid (its later turns go to the replica holding its prefix),
seed_index = the episode's place in the batch, sampling seed = `turn_seed(sampling.seed, turn)`; so a request's
samples do not depend on what else is in flight. Per-token versions come from `Completion.versions` (a request that
ran across a weight push records the version of each token), else the client's `weight_version`. Single-turn
generation is the one-turn case (`run_single_turn`: no environment, one request of samples_per_prompt per prompt).
A batch `generate(prompts, sampling)` function is refused (TypeError): a caller holding a `RolloutService` gets a
client from `with service.serving() as client`. (The per-turn barrier, every live episode's turn t then every step
of turn t, and the batch lockstep path were deleted after `benchmarks/results/agentic.md` compared them, issue 31.)

Per turn of an episode:
1. the engine gets the tokens the episode holds (prompt, every sampled turn as sampled, every observation delta) and
   samples the next turn; the sampled ids are appended as they are (loss_mask 1, the engine's log-probs, the
   weights version); they are decoded only to be read (tool calls, the reward), never re-encoded;
2. the environment answers (`Environment.step`, on the event loop beside every other episode);
3. the observation messages become tokens as the chat template's delta (`ChatRenderer.observation`): the template
   rendered over the conversation with and without them, the difference, plus what the template puts after the
   assistant's end-of-turn token (the separator verl PR #6921 lost at every assistant -> tool boundary); appended
   with loss_mask 0.

Checks (on by default, no peer does them by default):
- the delta rule, per turn: every token the template adds (the prompt, separators, observations, the generation
  prompt) is exactly what the template renders around the sampled turns. The sampled ids are compared as sampled,
  never re-encoded: a BPE model often samples ids that are not the canonical encoding of their own text (e.g. "ab"
  sampled as "a" + "b"), which says nothing about the template. So the expected tokens are the template's rendering
  with every sampled turn's text replaced by a placeholder, cut at the placeholders, each piece encoded, and the
  sampled ids spliced in where the placeholders were (`ChatRenderer.spliced_ids`); the template must also insert
  each turn's text verbatim. When every sampled turn is canonical this is simply the template's rendering of the
  whole conversation (checked first, the common case). A template that rewrites earlier turns breaks the rule:
  `on_template_mismatch`: "error" stops the run naming the episode and turn, "mask" keeps the episode but zeroes
  its loss mask (trained on nothing) and counts it (`multi_turn/template_mismatch`);
  `ChatRenderer.check_prefix_stable` refuses such a template at start-up.
  Counted, never an error: `multi_turn/noncanonical_turns` (sampled turns whose ids are not the tokenizer's encoding
  of their text) and `multi_turn/undecodable_turns` (turns holding an id beyond the tokenizer's vocabulary, e.g. a
  model whose embedding rows are padded past it: the id decodes to nothing, is kept and trained as sampled).
- token exactness, per trajectory (`verify_trajectory`): for every turn, the tokens the engine was given are the
  trajectory's prefix, the ids it produced follow them exactly with loss_mask 1 and the engine's log-probs, and
  nothing else is trained on; a mismatch raises `EpisodeError` naming the trajectory and turn.

Environment calls are bounded by `env_timeout_s`: a `reset` or `close` that does not return is an `EpisodeError`
naming the episode and call (the run stops); a `step` that does not return is cancelled, ends its episode (kept for
its group, trained on nothing) and is counted (`multi_turn/step_timeouts`, `multi_turn/tool_timeouts`): the run goes
on. A single tool call has its own deadline inside the step (`ToolSet`: the model reads an "Error: ... timed out"
observation and the episode goes on, counted in `multi_turn/tool_timeouts`). Async tools run on the event loop,
blocking ones on the bounded tool thread pool (`megarl.envs.tools.tool_pool`, `rollout.tool_threads`), sandbox runs
at most `rollout.max_concurrent_sandboxes` at once. An environment must not block the event loop (run blocking work
on a thread), or no bound can apply.

Metrics (`multi_turn/...`): turns_mean, tool_calls_per_episode, tool_errors, tool_timeouts, step_timeouts,
parse_errors, truncated_frac,
template_mismatch, noncanonical_turns, undecodable_turns, tool_use_frac (episodes that wrote a tool call),
tool_success_frac (episodes whose every tool call parsed and ran without an error, at least one).

Limits: `max_turns`; `max_tokens_per_turn` (a turn cut there is closed by the end-of-turn token as context, counted
in `multi_turn/turns_cut`, and the episode goes on); `max_new_tokens` = generated tokens over the whole episode (what
the overlong limits count); the context (`max_model_len`): an episode whose next request would not fit ends with
finish_reason "length". Tool-output length is the tool set's (`megarl.envs.tools`). Truncations are counted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import re
from typing import Any, Callable, Optional, Sequence

from megarl.data.trajectory import Trajectory, TrajectoryBuilder
from megarl.envs.base import EpisodeError, ModelTurn
from megarl.rollout.client import RequestDropped
from megarl.rollout.engine import GenerationRequest, RolloutSamples

logger = logging.getLogger("megarl.envs")

# Sampling-seed offset of turn t of an episode batch: seed + t * this.
TURN_SEED_STRIDE = 9_000_011
# Episodes in flight at once (rollout.max_concurrent_episodes).
DEFAULT_MAX_CONCURRENT_EPISODES = 256


# Stands for sampled turn k in a rendering (`ChatRenderer.spliced_ids`): private-use characters no tokenizer merges
# with the template's text and no model writes by chance.
_PLACEHOLDER = "\ue000megarl-sampled-{}\ue001"
_PLACEHOLDER_RE = re.compile("\ue000megarl-sampled-(\\d+)\ue001")


class TemplateMismatch(EpisodeError):
    """The chat template does not render the conversation as the tokens held (delta rule broken)."""


class ChatRenderer:
    """Chat messages -> token ids with the tokenizer's chat template (or `chat_template`, a Jinja string), with the
    tools' schemas passed as `tools=`. Text is rendered by the template and encoded without added special tokens,
    so the template alone decides the special tokens."""

    def __init__(self, tokenizer: Any, tools: Optional[list] = None, chat_template: Optional[str] = None) -> None:
        self.tokenizer, self.tools, self.chat_template = tokenizer, tools, chat_template

    def text(self, messages: Sequence[dict], add_generation_prompt: bool) -> str:
        kw = {"chat_template": self.chat_template} if self.chat_template else {}
        return self.tokenizer.apply_chat_template(list(messages), tools=self.tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **kw)

    def ids(self, messages: Sequence[dict], add_generation_prompt: bool) -> list[int]:
        return list(self.tokenizer(self.text(messages, add_generation_prompt), add_special_tokens=False)["input_ids"])

    def prompt(self, messages: Sequence[dict]) -> list[int]:
        """The first request of an episode: its messages and the generation prompt."""
        return self.ids(messages, True)

    def observation(self, conversation: Sequence[dict], observations: Sequence[dict], end_id: Optional[int]) -> list:
        """The tokens that follow a sampled turn ending with token `end_id` (the conversation's last message is that
        turn): the template's separator after the turn's end token, the observations, the next generation prompt.
        Raises TemplateMismatch when adding them changes the rendering of what comes before."""
        before = self.ids(conversation, False)
        after = self.ids(list(conversation) + list(observations), True)
        if after[:len(before)] != before:
            raise TemplateMismatch("the chat template renders the conversation differently once the observations are "
                                   "added (it rewrites earlier turns)")
        tail: list[int] = []
        if end_id is not None and end_id in before:
            tail = before[len(before) - before[::-1].index(end_id):]  # after the last end-of-turn token
        return tail + after[len(before):]

    def spliced_ids(self, messages: Sequence[dict], sampled: dict) -> list[int]:
        """The tokens the template renders for `messages` (with the generation prompt) when the assistant messages
        at the indices in `sampled` hold the ids the engine sampled, `sampled[i]` (the turn's content ids, its
        end-of-turn token left to the template), instead of the tokenizer's encoding of their text: the rendering
        with each such message's text replaced by a placeholder, cut there, each piece encoded, the sampled ids
        spliced in. Raises TemplateMismatch when the template does not insert a turn's text verbatim (it edits
        assistant content), since no splice can then stand for what it renders."""
        order = sorted(sampled)
        slot = {i: k for k, i in enumerate(order)}
        held = [dict(m, content=_PLACEHOLDER.format(slot[i])) if i in sampled else m for i, m in enumerate(messages)]
        parts = _PLACEHOLDER_RE.split(self.text(held, True))
        pieces, slots = parts[0::2], [int(k) for k in parts[1::2]]
        if slots != list(range(len(order))):
            raise TemplateMismatch(f"the chat template renders the sampled turns as {slots}, not once each in order "
                                   f"{list(range(len(order)))} (it drops, repeats or reorders turns)")
        real = pieces[0] + "".join(messages[i]["content"] + pieces[k + 1] for k, i in enumerate(order))
        if self.text(messages, True) != real:
            raise TemplateMismatch("the chat template does not insert a sampled turn's text verbatim (it edits "
                                   "assistant content, e.g. strips whitespace or reasoning)")
        ids = self._encode(pieces[0])
        for k, i in enumerate(order):
            ids += list(sampled[i]) + self._encode(pieces[k + 1])
        return ids

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def check_prefix_stable(self) -> None:
        """Refuse a template that rewrites earlier turns: render a probe conversation (user, assistant, tool,
        assistant) growing turn by turn and require each rendering to start with the previous one."""
        probe = [{"role": "user", "content": "2*3?"},
                 {"role": "assistant", "content": "<think>multiply</think>I will compute it."},
                 {"role": "tool", "name": "calculator", "content": "6"},
                 {"role": "assistant", "content": "6"}]
        previous: list[int] = []
        for k in range(1, len(probe) + 1):
            ids = self.ids(probe[:k], False)
            if ids[:len(previous)] != previous:
                raise TemplateMismatch(f"the chat template is not prefix-stable: adding message {k} "
                                       f"({probe[k - 1]['role']}) re-renders the earlier ones (e.g. it drops "
                                       "reasoning from past turns); multi-turn training needs a template that only "
                                       "appends, or rollout.on_template_mismatch=mask")
            previous = ids


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
    """max_turns: model turns per episode; max_tokens_per_turn; max_new_tokens: generated tokens per episode (all
    turns); max_model_len: prompt + everything after it (the engine's context)."""

    max_turns: int = 4
    max_tokens_per_turn: int = 256
    max_new_tokens: int = 512
    max_model_len: int = 1024


@dataclasses.dataclass
class EpisodeResult:
    """trajectories (record-major, n per record, group = record); scores [len(trajectories)] (the episodes' summed
    rewards); metrics (`multi_turn/...`); turns: per trajectory [(prompt ids given, ids produced, log-probs)]."""

    trajectories: list
    scores: list
    metrics: dict
    turns: list


@dataclasses.dataclass
class _Episode:
    uid: str
    group_uid: str
    record: Any
    env: Any
    index: int = 0  # the episode's place in its batch: its requests' seed_index
    messages: list = dataclasses.field(default_factory=list)
    builder: Optional[TrajectoryBuilder] = None
    reward: float = 0.0
    generated: int = 0
    turn: int = 0
    done: bool = False
    finish: str = "stop"
    mismatch: bool = False
    step_timed_out: bool = False
    turns: list = dataclasses.field(default_factory=list)
    sampled: dict = dataclasses.field(default_factory=dict)  # message index -> the sampled content ids it holds


@dataclasses.dataclass
class _Tally:
    """What the episodes of one batch share: the counts behind the metrics, the episodes that called a tool
    (uid -> tool calls that ran, or -1 once one failed) and one `ChatRenderer` per environment type."""

    counts: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(COUNT_NAMES, 0))
    called: dict = dataclasses.field(default_factory=dict)
    renderers: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class _Sample:
    """One sampled turn: the prompt ids the engine was given, the ids it produced (cut to the turn's budget), their
    log-probs, its finish reason and [len(ids)] the weights version of each token."""

    prompt: list
    ids: list
    log_probs: list
    finish: str
    versions: list


COUNT_NAMES = ("tool_calls", "tool_errors", "tool_timeouts", "step_timeouts", "parse_errors", "truncated",
               "template_mismatch", "turns", "turns_cut", "noncanonical_turns", "undecodable_turns")


def turn_seed(seed: Optional[int], turn: int) -> Optional[int]:
    """The sampling seed of turn `turn` of an episode batch (None: unseeded)."""
    return None if seed is None else seed + turn * TURN_SEED_STRIDE


def is_client(source: Any) -> bool:
    """True for a `RolloutClient` (an object with a coroutine `generate(request, ...)`)."""
    return inspect.iscoroutinefunction(getattr(source, "generate", None))


def check_client(source: Any, caller: str) -> None:
    """Raise a TypeError naming `caller` and what to pass when `source` is not a `RolloutClient` (e.g. a batch
    `generate(prompts, sampling)` function, which the episode path no longer takes)."""
    if not is_client(source):
        raise TypeError(f"{caller} takes a RolloutClient (megarl.rollout.client: an object with a coroutine "
                        f"generate(request, ...)), got {type(source).__name__} {source!r:.80}; from a RolloutService "
                        "use `with service.serving() as client: ...`, the batch generate(prompts, sampling) path was "
                        "deleted (issue 31)")


async def _all_or_cancel(coroutines) -> list:
    """Await every coroutine concurrently; when one raises, cancel the others (their `finally`s run) and raise it."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def check_max_concurrent_episodes(n: int) -> None:
    """Refuse a bound on episodes in flight below 1 (`rollout.max_concurrent_episodes`), naming the key."""
    if n < 1:
        raise ValueError(f"max_concurrent_episodes (rollout.max_concurrent_episodes) must be >= 1, got {n}")


class EpisodeRunner:
    """Runs batches of episodes against the rollout engines (module docstring).

    tokenizer: a HF tokenizer with the chat template (or pass `chat_template`). env_factory(record) -> a new
    `Environment` per episode. parser(text) -> (tool calls, errors) (`megarl.envs.tool_calls`). limits:
    `EpisodeLimits`. on_template_mismatch: "error" | "mask". verify: check every trajectory (`verify_trajectory`).
    env_timeout_s: the bound on each environment call (reset, step, close), seconds: a reset or close that does not
    return stops the run; a step that does not return is cancelled, counted (`multi_turn/tool_timeouts`,
    `multi_turn/step_timeouts`) and ends its episode, trained on nothing; the run goes on.
    max_concurrent_episodes: episodes in flight at once (the others wait for a slot). request_timeout_s: each
    request's bound (None: the client's)."""

    def __init__(self, tokenizer: Any, env_factory: Callable[[Any], Any], parser: Callable[[str], tuple],
                 limits: EpisodeLimits, chat_template: Optional[str] = None, on_template_mismatch: str = "error",
                 verify: bool = True, env_timeout_s: float = 600.0,
                 max_concurrent_episodes: int = DEFAULT_MAX_CONCURRENT_EPISODES,
                 request_timeout_s: Optional[float] = None) -> None:
        if on_template_mismatch not in ("error", "mask"):
            raise ValueError(f"on_template_mismatch must be 'error' or 'mask', got {on_template_mismatch!r}")
        if not env_timeout_s > 0:
            raise ValueError(f"env_timeout_s must be > 0 seconds, got {env_timeout_s!r}")
        check_max_concurrent_episodes(max_concurrent_episodes)
        self.tokenizer, self.env_factory, self.parser, self.limits = tokenizer, env_factory, parser, limits
        self.chat_template, self.on_template_mismatch, self.verify = chat_template, on_template_mismatch, verify
        self.env_timeout_s, self.max_concurrent_episodes = env_timeout_s, max_concurrent_episodes
        self.request_timeout_s = request_timeout_s
        self._vocab = len(tokenizer)  # ids at or beyond it decode to nothing (padded embedding rows)

    async def _bounded(self, call, what: str):
        """Await an environment call within `env_timeout_s`; `what` names it (episode, turn, method)."""
        try:
            return await asyncio.wait_for(call, self.env_timeout_s)
        except asyncio.TimeoutError:
            raise EpisodeError(f"{what}: the environment did not return within {self.env_timeout_s:g} s "
                               "(rollout.env_timeout_s); a hung tool or an environment blocking the event loop") \
                from None

    def run(self, records: Sequence[Any], n: int, client: Any, sampling: Any,
            policy_version: "int | Callable[[], int] | None" = None, uid_prefix: str = "") -> EpisodeResult:
        """`n` episodes per record (in a new event loop; `arun` from a running one), each its own coroutine.

        client: a `RolloutClient` (`megarl.rollout.client`; from a `RolloutService`: `with service.serving() as
        client`). sampling: the settings (samples_per_prompt, max_new_tokens, seed are set per request here).
        policy_version: the weights version of the sampled tokens where the engine does not report it (the client's
        `Completion.versions`, else its `weight_version`, else this); a function is read after each generation
        (weights pushed between turns)."""
        check_client(client, "EpisodeRunner.run")
        return asyncio.run(self.arun(records, n, client, sampling, policy_version, uid_prefix))

    async def arun(self, records: Sequence[Any], n: int, client: Any, sampling: Any,
                   policy_version: "int | Callable[[], int] | None" = None, uid_prefix: str = "") -> EpisodeResult:
        """`run` as a coroutine (for a caller whose event loop the client is bound to)."""
        check_client(client, "EpisodeRunner.arun")
        episodes = [_Episode(f"{uid_prefix}{i}/{k}", f"{uid_prefix}{i}", r, self.env_factory(r), index=i * n + k)
                    for i, r in enumerate(records) for k in range(n)]
        tally = _Tally()
        slots = asyncio.Semaphore(self.max_concurrent_episodes)

        async def in_slot(e: _Episode) -> None:
            try:
                async with slots:
                    await self._play(e, client, sampling, policy_version, tally)
            finally:
                await self._close(e)

        await _all_or_cancel(in_slot(e) for e in episodes)
        return self._result(episodes, tally)

    async def run_episode(self, episode: _Episode, client: Any, sampling: Any, tally: _Tally,
                          policy_version: "int | Callable[[], int] | None" = None) -> None:
        """One episode from reset to done against `client`, independent of every other episode: each turn is one
        request (id f"{uid}/t{turn}", session = the episode's uid, seed_index = its place in the batch, sampling
        seed `turn_seed(sampling.seed, turn)`), submitted as soon as the previous observation is ready; its
        environment is closed at the end, whatever happened."""
        try:
            await self._play(episode, client, sampling, policy_version, tally)
        finally:
            await self._close(episode)

    async def _play(self, e: _Episode, client, sampling, version, tally: _Tally) -> None:
        self._begin(e, await self._bounded(e.env.reset(e.record), f"episode {e.uid}: reset"), tally)
        for turn in range(self.limits.max_turns):
            mt = await self._request_turn(e, turn, client, sampling, version, tally)
            if mt is None:
                return
            await self._env_turn(e, turn, mt, tally)
            if e.done:
                return

    async def _close(self, e: _Episode) -> None:
        try:
            await self._bounded(e.env.close(), f"episode {e.uid}: close")
        except Exception as err:  # the episode's result stands; what it held is logged
            logger.warning("episode %s: close failed: %s", e.uid, err)

    def _begin(self, e: _Episode, messages, tally: _Tally) -> None:
        renderer = tally.renderers.setdefault(id(type(e.env)), ChatRenderer(
            self.tokenizer, e.env.tools(), self.chat_template))
        e.messages = list(messages)
        e.builder = TrajectoryBuilder(renderer.prompt(e.messages), uid=e.uid, group_uid=e.group_uid)

    def _budget(self, e: _Episode, tally: _Tally) -> Optional[int]:
        """Tokens the episode's next turn may sample; None (the episode ends, truncated) when none are left."""
        lim = self.limits
        left = min(lim.max_tokens_per_turn, lim.max_new_tokens - e.generated,
                   lim.max_model_len - len(e.builder.token_ids))
        if left < 1:
            e.done, e.finish = True, "length"
            tally.counts["truncated"] += 1
            return None
        return left

    @staticmethod
    def _cut(sample: _Sample, budget: int) -> _Sample:
        """`sample` cut to `budget` tokens (as if the engine had stopped there, finish_reason 'length')."""
        if len(sample.ids) <= budget:
            return sample
        return dataclasses.replace(sample, ids=sample.ids[:budget], log_probs=sample.log_probs[:budget],
                                   versions=sample.versions[:budget], finish="length")

    async def _request_turn(self, e: _Episode, turn: int, client, sampling, version,
                            tally: _Tally) -> Optional[ModelTurn]:
        """Turn `turn` of episode `e` as one request to `client`; None when the episode has no tokens left."""
        left = self._budget(e, tally)
        if left is None:
            return None
        prompt = list(e.builder.token_ids)
        s = dataclasses.replace(sampling, samples_per_prompt=1, max_new_tokens=left, max_prompt_tokens=len(prompt),
                                seed=turn_seed(sampling.seed, turn))
        request = GenerationRequest(f"{e.uid}/t{turn}", prompt, s, seed_index=e.index)
        try:
            out = await client.generate(request, session_id=e.uid, timeout_s=self.request_timeout_s)
        except ValueError as err:  # the prompt policy dropped it (it cannot: prompt + budget fit the context)
            raise EpisodeError(f"episode {e.uid}, turn {turn}: the engine refused request {request.request_id!r}: "
                               f"{err}") from err
        if not out.finished or len(out.completions) != 1:
            raise EpisodeError(f"episode {e.uid}, turn {turn}: request {request.request_id!r} came back "
                               f"{'finished' if out.finished else 'unfinished'} with {len(out.completions)} "
                               "completions (expected 1, finished)")
        c = out.completions[0]
        ids = list(c.token_ids)
        if c.versions is not None:
            versions = list(c.versions)
        else:
            current = getattr(client, "weight_version", None)
            if current is None:
                current = version() if callable(version) else (0 if version is None else version)
            versions = [current] * len(ids)
        sample = self._cut(_Sample(prompt, ids, list(c.log_probs), c.finish_reason or "length", versions), left)
        return self._take(e, turn, sample, tally)

    def _take(self, e: _Episode, turn: int, x: _Sample, tally: _Tally) -> ModelTurn:
        """Append a sampled turn to the episode as sampled and read it (decoded, tool calls parsed)."""
        counts = tally.counts
        e.turns.append((x.prompt, list(x.ids), list(x.log_probs)))
        e.builder.sampled(x.ids, x.log_probs, list(x.versions))
        e.generated += len(x.ids)
        e.turn = turn + 1
        counts["turns"] += 1
        ids = list(x.ids)
        body = ids[:-1] if ids and ids[-1] in self._end_ids() else ids  # the end-of-turn token left out
        text = self.tokenizer.decode(body, skip_special_tokens=False)
        self._count_encoding(body, text, counts)
        calls, errors = self.parser(text)
        counts["parse_errors"] += len(errors)
        if calls or errors:
            tally.called.setdefault(e.uid, 0)
        return ModelTurn(turn, text, tuple(ids), tuple(calls), tuple(errors), x.finish)

    async def _env_turn(self, e: _Episode, turn: int, mt: ModelTurn, tally: _Tally) -> None:
        """The environment's step for turn `mt` of episode `e` (bounded by env_timeout_s: a step that does not
        return is cancelled, counted and ends the episode, masked), then the episode's limits and observation."""
        counts = tally.counts
        try:
            step = await asyncio.wait_for(e.env.step(mt), self.env_timeout_s)
        except asyncio.TimeoutError:
            counts["tool_timeouts"] += 1
            counts["step_timeouts"] += 1
            e.done, e.finish, e.step_timed_out = True, "stop", True
            logger.warning("episode %s, turn %d: the environment's step did not return within %g s "
                           "(rollout.env_timeout_s): cancelled, the episode ends and is trained on nothing",
                           e.uid, turn, self.env_timeout_s)
            return
        except EpisodeError:
            raise
        except Exception as err:
            raise EpisodeError(f"episode {e.uid}, turn {turn}: the environment failed: {err!r}") from err
        e.reward += float(step.reward)
        ran, failed = int(step.info.get("tool_calls", 0)), int(step.info.get("tool_errors", 0))
        counts["tool_calls"] += ran
        counts["tool_errors"] += failed
        counts["tool_timeouts"] += int(step.info.get("tool_timeouts", 0))
        called = tally.called
        if e.uid in called and called[e.uid] >= 0:
            called[e.uid] = -1 if failed or mt.parse_errors else called[e.uid] + ran
        if step.done:
            e.done, e.finish = True, mt.finish_reason
            return
        cut = mt.finish_reason == "length"
        if turn + 1 >= self.limits.max_turns or (cut and (e.generated >= self.limits.max_new_tokens
                                                          or self.tokenizer.eos_token_id is None)):
            # the last turn allowed, or the episode's token budget spent: the episode is truncated
            e.done, e.finish = True, "length"
            counts["truncated"] += 1
            return
        if cut:  # cut at max_tokens_per_turn: the template's end-of-turn token closes it, as context
            e.builder.context([self.tokenizer.eos_token_id])
            counts["turns_cut"] += 1
        self._observe(e, list(mt.token_ids), step, turn, tally, closed=cut)

    def _result(self, episodes: list, tally: _Tally) -> EpisodeResult:
        trajectories = []
        for e in episodes:
            t = e.builder.build(e.finish)
            if self.verify:
                verify_trajectory(t, e.turns)
            if e.mismatch or e.step_timed_out:  # kept for the group, trained on nothing
                t = dataclasses.replace(t, loss_mask=[0] * len(t), log_probs=[0.0] * len(t),
                                        policy_version=[-1] * len(t))
            trajectories.append(t)
        total, counts, called = len(episodes), tally.counts, tally.called
        metrics = {"multi_turn/turns_mean": counts["turns"] / total,
                   "multi_turn/tool_calls_per_episode": counts["tool_calls"] / total,
                   "multi_turn/tool_errors": float(counts["tool_errors"]),
                   "multi_turn/tool_timeouts": float(counts["tool_timeouts"]),
                   "multi_turn/step_timeouts": float(counts["step_timeouts"]),
                   "multi_turn/parse_errors": float(counts["parse_errors"]),
                   "multi_turn/truncated_frac": counts["truncated"] / total,
                   "multi_turn/turns_cut": float(counts["turns_cut"]),
                   "multi_turn/template_mismatch": float(counts["template_mismatch"]),
                   "multi_turn/noncanonical_turns": float(counts["noncanonical_turns"]),
                   "multi_turn/undecodable_turns": float(counts["undecodable_turns"]),
                   "multi_turn/tool_use_frac": len(called) / total,
                   "multi_turn/tool_success_frac": sum(1 for v in called.values() if v > 0) / total}
        return EpisodeResult(trajectories, [e.reward for e in episodes], metrics, [e.turns for e in episodes])

    def _observe(self, e, ids, step, turn, tally: _Tally, closed: bool = False) -> None:
        """Append the observation tokens of `step` after the sampled turn `ids` (`closed`: a turn cut at its token
        limit, already closed by an end-of-turn token appended as context), and check the delta rule."""
        renderer = tally.renderers[id(type(e.env))]
        counts = tally.counts
        if closed:
            content_ids, end_id = ids, self.tokenizer.eos_token_id
        else:
            end_id = ids[-1] if ids else None
            content_ids = ids[:-1] if ids and end_id in self._end_ids() else ids
        assistant = {"role": "assistant", "content": self.tokenizer.decode(content_ids, skip_special_tokens=False)}
        conversation = e.messages + [assistant]
        try:
            obs = renderer.observation(conversation, list(step.observations), end_id)
            e.builder.context(obs)
            e.sampled[len(e.messages)] = content_ids
            e.messages = conversation + list(step.observations)
            held = e.builder.token_ids
            # the delta rule: the canonical case first (the whole conversation re-encodes to the tokens held), else
            # the template's pieces around the sampled ids as sampled (module docstring)
            if renderer.prompt(e.messages) != held:
                expected = renderer.spliced_ids(e.messages, e.sampled)
                if expected != held:
                    at = next((i for i, (a, b) in enumerate(zip(expected, held)) if a != b),
                              min(len(expected), len(held)))
                    raise TemplateMismatch(
                        f"the template renders {len(expected)} tokens around the sampled turns, the episode holds "
                        f"{len(held)}; first difference at token {at}: expected {expected[at:at + 8]}, held "
                        f"{held[at:at + 8]}")
        except TemplateMismatch as err:
            if self.on_template_mismatch == "error":
                raise TemplateMismatch(f"episode {e.uid}, turn {turn}: {err} (the template adds other tokens than "
                                       "the ones held, or rewrites earlier turns); set "
                                       "rollout.on_template_mismatch=mask to train such episodes on nothing "
                                       "instead") from None
            counts["template_mismatch"] += 1
            e.mismatch, e.done, e.finish = True, True, "stop"
            return
        if len(e.builder.token_ids) >= self.limits.max_model_len:
            e.done, e.finish = True, "length"
            counts["truncated"] += 1

    def _count_encoding(self, body: list, text: str, counts: dict) -> None:
        """Count a sampled turn (its ids `body` without the end-of-turn token, decoded as `text`) that holds an id
        beyond the tokenizer's vocabulary, or whose ids are not the tokenizer's encoding of its text."""
        if any(i >= self._vocab for i in body):
            counts["undecodable_turns"] += 1
        elif list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) != list(body):
            counts["noncanonical_turns"] += 1

    def _end_ids(self) -> set:
        ids = {self.tokenizer.eos_token_id}
        return {i for i in ids if i is not None}


def verify_trajectory(t: Trajectory, turns: Sequence[tuple]) -> None:
    """Token exactness of one episode's trajectory against what the engine saw, turn by turn: `turns` = [(prompt
    ids given to the engine, ids it produced, its log-probs)]. Raises EpisodeError naming the trajectory and turn."""
    sampled = 0
    for k, (given, produced, log_probs) in enumerate(turns):
        n = len(given)
        if list(t.token_ids[:n]) != list(given):
            raise EpisodeError(f"trajectory {t.uid}, turn {k}: the tokens the engine was given are not the "
                               "trajectory's prefix (retokenized or rewritten)")
        if list(t.token_ids[n:n + len(produced)]) != list(produced):
            raise EpisodeError(f"trajectory {t.uid}, turn {k}: the tokens after the turn's prompt are not the ids "
                               "the engine produced (retokenized?)")
        if any(m != 1 for m in t.loss_mask[n:n + len(produced)]):
            raise EpisodeError(f"trajectory {t.uid}, turn {k}: a token the policy sampled is not in the loss mask")
        if [float(x) for x in t.log_probs[n:n + len(produced)]] != [float(x) for x in log_probs]:
            raise EpisodeError(f"trajectory {t.uid}, turn {k}: the rollout log-probs do not line up with the "
                               "sampled tokens")
        sampled += len(produced)
    if sum(t.loss_mask) != sampled:
        raise EpisodeError(f"trajectory {t.uid}: {sum(t.loss_mask)} tokens in the loss mask but the engine sampled "
                           f"{sampled}: context tokens would be trained on")


def runner_from_config(cfg: Any, encoder: Any, reward_fn: Any) -> EpisodeRunner:
    """The `EpisodeRunner` of a job config with `rollout.env` set: the environment factory (`megarl.envs.registry`),
    the tool-call parser (`rollout.tool_parser`), the limits (`rollout.max_turns`, `max_tokens_per_turn`,
    `max_new_tokens`, the engine's context = max_prompt_tokens + max_new_tokens), the chat template of
    `data.chat_template` (the tokenizer's, or a Jinja string) and the bounds on episodes in flight, tool threads and
    sandbox runs (`rollout.max_concurrent_episodes`, `tool_threads`, `max_concurrent_sandboxes`). Refuses a template
    that rewrites earlier turns unless rollout.on_template_mismatch=mask."""
    from megarl.envs.registry import build_env_factory
    from megarl.envs.tool_calls import get_parser

    r = cfg.rollout
    limits = EpisodeLimits(max_turns=r.max_turns, max_tokens_per_turn=r.max_tokens_per_turn or r.max_new_tokens,
                           max_new_tokens=r.max_new_tokens, max_model_len=r.max_prompt_tokens + r.max_new_tokens)
    template = encoder.chat_template if getattr(encoder, "mode", "hf") == "jinja" else None
    factory = build_env_factory(r.env, {"reward_fn": reward_fn, **dict(r.env_options)})
    from megarl.envs.sandbox import set_max_concurrent_runs
    from megarl.envs.tools import set_tool_threads

    set_tool_threads(r.tool_threads)
    set_max_concurrent_runs(r.max_concurrent_sandboxes)
    runner = EpisodeRunner(encoder.tokenizer, lambda record: factory(), get_parser(r.tool_parser), limits,
                           chat_template=template, on_template_mismatch=r.on_template_mismatch,
                           env_timeout_s=r.env_timeout_s,
                           max_concurrent_episodes=r.max_concurrent_episodes)
    if r.on_template_mismatch == "error":
        ChatRenderer(encoder.tokenizer, None, template).check_prefix_stable()
    return runner


async def run_single_turn(client: Any, prompts: Sequence[Sequence[int]], sampling: Any, *, uid_prefix: str = "",
                          policy_version: "int | Callable[[], int] | None" = None,
                          max_concurrent: int = DEFAULT_MAX_CONCURRENT_EPISODES,
                          timeout_s: Optional[float] = None,
                          keep_outputs: bool = True) -> tuple[RolloutSamples, list[list[list[int]]]]:
    """Single-turn generation as the one-turn case of the episode path: no environment, no observation; prompt i is
    one request (id f"{uid_prefix}{i}/t0", session f"{uid_prefix}{i}", seed_index i, the sampling seed of turn 0
    = `sampling.seed`, `sampling.samples_per_prompt` completions), in flight `max_concurrent` at a time.
    `keep_outputs` False: nothing trains on these samples (validation, the Python API's `generate`), so the rollout
    hosts put no by-reference package of them (`GenerationRequest.keep_output`).

    Returns (samples, versions): a `RolloutSamples` ordered by (prompt_index, sample_index) as a batch
    `generate(prompts, sampling)` returns it (prompts the prompt policy dropped in `dropped_prompt_indices`, cut
    ones in `truncated_prompt_indices`), and per sample [len(response_ids)] the weights version of each token
    (`Completion.versions`, else the client's `weight_version`, else `policy_version`)."""
    check_client(client, "run_single_turn")
    slots = asyncio.Semaphore(max_concurrent)
    s = dataclasses.replace(sampling, seed=turn_seed(sampling.seed, 0))

    async def one(i: int, prompt: Sequence[int]):
        request = GenerationRequest(f"{uid_prefix}{i}/t0", list(prompt), s, seed_index=i, keep_output=keep_outputs)
        async with slots:
            try:
                return await client.generate(request, session_id=f"{uid_prefix}{i}", timeout_s=timeout_s)
            except RequestDropped:  # dropped by the prompt policy (rollout.overlong_prompt: drop)
                return None

    outs = await _all_or_cancel(one(i, p) for i, p in enumerate(prompts))
    samples, versions, dropped, truncated = [], [], [], []
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        if out is None:
            dropped.append(i)
            continue
        if len(out.prompt_ids) < len(prompt):
            truncated.append(i)
        for sample, c in zip(out.samples(i), out.completions):
            samples.append(sample)
            if c.versions is not None:
                versions.append(list(c.versions))
            else:
                current = getattr(client, "weight_version", None)
                if current is None:
                    current = policy_version() if callable(policy_version) else (policy_version or 0)
                versions.append([current] * len(c.token_ids))
    return RolloutSamples(samples, dropped_prompt_indices=dropped, truncated_prompt_indices=truncated), versions
