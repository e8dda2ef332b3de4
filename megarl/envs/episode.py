"""Multi-turn episodes, token in, token out: the loop that turns environments and an engine into `Trajectory`s.

    runner = EpisodeRunner(tokenizer, env_factory, parser, limits)
    result = runner.run(records, n, generate, sampling, policy_version, uid_prefix)
    result.trajectories, result.scores, result.metrics

Per turn, for every live episode at once (one engine call per turn, the episodes' requests batched):
1. the engine gets the tokens the episode holds (prompt, every sampled turn as sampled, every observation delta) and
   samples the next turn; the sampled ids are appended as they are (loss_mask 1, the engine's log-probs, the
   weights version); they are decoded only to be read (tool calls, the reward), never re-encoded;
2. the environment answers (`Environment.step`, all live episodes concurrently with asyncio);
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

Environment calls are bounded: `reset`, `step` and `close` each get `env_timeout_s` (an `EpisodeError` naming the
episode, turn and call when one does not return); an environment must not block the event loop (run blocking work
with `asyncio.to_thread`), or no bound can apply.

Metrics (`multi_turn/...`): turns_mean, tool_calls_per_episode, tool_errors, parse_errors, truncated_frac,
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
import logging
import re
from typing import Any, Callable, Optional, Sequence

from megarl.data.trajectory import Trajectory, TrajectoryBuilder
from megarl.envs.base import EpisodeError, ModelTurn

logger = logging.getLogger("megarl.envs")

# Sampling-seed offset of turn t of an episode batch: seed + t * this.
TURN_SEED_STRIDE = 9_000_011
# ... and of call k within a turn (the turn's episodes split into calls that fit the engine's length).
CALL_SEED_STRIDE = 7_919


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
    messages: list = dataclasses.field(default_factory=list)
    builder: Optional[TrajectoryBuilder] = None
    reward: float = 0.0
    generated: int = 0
    turn: int = 0
    done: bool = False
    finish: str = "stop"
    mismatch: bool = False
    turns: list = dataclasses.field(default_factory=list)
    sampled: dict = dataclasses.field(default_factory=dict)  # message index -> the sampled content ids it holds


def _calls(group: list, budget: dict, max_model_len: int) -> list[list]:
    """The live episodes of a turn as few engine calls as fit: a call takes its longest budget and its longest
    prompt, so together they must fit `max_model_len` (each episode's own prompt + budget always does). Largest
    budgets first; an episode whose prompt would not fit beside the call's budget starts the next call."""
    calls: list[list] = []
    for e in sorted(group, key=lambda e: -budget[e.uid]):
        if calls:
            top = budget[calls[-1][0].uid]
            if max(len(x.builder.token_ids) for x in calls[-1] + [e]) + top <= max_model_len:
                calls[-1].append(e)
                continue
        calls.append([e])
    return calls


class EpisodeRunner:
    """Runs batches of episodes against an engine (module docstring).

    tokenizer: a HF tokenizer with the chat template (or pass `chat_template`). env_factory(record) -> a new
    `Environment` per episode. parser(text) -> (tool calls, errors) (`megarl.envs.tool_calls`). limits:
    `EpisodeLimits`. on_template_mismatch: "error" | "mask". verify: check every trajectory (`verify_trajectory`).
    min_requests: the fewest requests an engine call may carry (the number of engine replicas: each needs one);
    a turn with fewer live episodes is padded with copies whose samples are dropped. env_timeout_s: the bound on
    each environment call (reset, step, close), seconds."""

    def __init__(self, tokenizer: Any, env_factory: Callable[[Any], Any], parser: Callable[[str], tuple],
                 limits: EpisodeLimits, chat_template: Optional[str] = None, on_template_mismatch: str = "error",
                 verify: bool = True, min_requests: int = 1, env_timeout_s: float = 600.0) -> None:
        if on_template_mismatch not in ("error", "mask"):
            raise ValueError(f"on_template_mismatch must be 'error' or 'mask', got {on_template_mismatch!r}")
        if not env_timeout_s > 0:
            raise ValueError(f"env_timeout_s must be > 0 seconds, got {env_timeout_s!r}")
        self.tokenizer, self.env_factory, self.parser, self.limits = tokenizer, env_factory, parser, limits
        self.chat_template, self.on_template_mismatch, self.verify = chat_template, on_template_mismatch, verify
        self.min_requests, self.env_timeout_s = min_requests, env_timeout_s
        self._vocab = len(tokenizer)  # ids at or beyond it decode to nothing (padded embedding rows)

    async def _bounded(self, call, what: str):
        """Await an environment call within `env_timeout_s`; `what` names it (episode, turn, method)."""
        try:
            return await asyncio.wait_for(call, self.env_timeout_s)
        except asyncio.TimeoutError:
            raise EpisodeError(f"{what}: the environment did not return within {self.env_timeout_s:g} s "
                               "(rollout.env_timeout_s); a hung tool or an environment blocking the event loop") \
                from None

    def run(self, records: Sequence[Any], n: int, generate: Callable, sampling: Any,
            policy_version: "int | Callable[[], int]", uid_prefix: str = "") -> EpisodeResult:
        """`n` episodes per record; `generate(prompts, sampling) -> RolloutSamples` is the rollout service's (one
        call per turn); `sampling` its settings (samples_per_prompt and max_new_tokens are set per turn here).
        `policy_version`: the engines' weights version, or a function read after each turn's generation (weights
        pushed between turns: an episode's turns then carry the versions that sampled them)."""
        return asyncio.run(self._run(records, n, generate, sampling, policy_version, uid_prefix))

    async def _run(self, records, n, generate, sampling, version, uid_prefix) -> EpisodeResult:
        episodes = [_Episode(f"{uid_prefix}{i}/{k}", f"{uid_prefix}{i}", r, self.env_factory(r))
                    for i, r in enumerate(records) for k in range(n)]
        counts = {"tool_calls": 0, "tool_errors": 0, "parse_errors": 0, "truncated": 0, "template_mismatch": 0,
                  "turns": 0, "turns_cut": 0, "noncanonical_turns": 0, "undecodable_turns": 0}
        renderers = {}
        try:
            firsts = await asyncio.gather(*(self._bounded(e.env.reset(e.record), f"episode {e.uid}: reset")
                                            for e in episodes))
            for e, messages in zip(episodes, firsts):
                renderer = renderers.setdefault(id(type(e.env)), ChatRenderer(
                    self.tokenizer, e.env.tools(), self.chat_template))
                e.messages = list(messages)
                e.builder = TrajectoryBuilder(renderer.prompt(e.messages), uid=e.uid, group_uid=e.group_uid)
            called: dict[str, int] = {}  # episode -> tool calls that ran (>0) or failed to (<0 once any did)
            for turn in range(self.limits.max_turns):
                live = [e for e in episodes if not e.done]
                if not live:
                    break
                await self._turn(live, turn, generate, sampling, version, renderers, counts, called)
        finally:
            await asyncio.gather(*(self._bounded(e.env.close(), f"episode {e.uid}: close") for e in episodes),
                                 return_exceptions=True)
        trajectories = []
        for e in episodes:
            t = e.builder.build(e.finish)
            if self.verify:
                verify_trajectory(t, e.turns)
            if e.mismatch:  # on_template_mismatch=mask: kept for the group, trained on nothing
                t = dataclasses.replace(t, loss_mask=[0] * len(t), log_probs=[0.0] * len(t),
                                        policy_version=[-1] * len(t))
            trajectories.append(t)
        total = len(episodes)
        metrics = {"multi_turn/turns_mean": counts["turns"] / total,
                   "multi_turn/tool_calls_per_episode": counts["tool_calls"] / total,
                   "multi_turn/tool_errors": float(counts["tool_errors"]),
                   "multi_turn/parse_errors": float(counts["parse_errors"]),
                   "multi_turn/truncated_frac": counts["truncated"] / total,
                   "multi_turn/turns_cut": float(counts["turns_cut"]),
                   "multi_turn/template_mismatch": float(counts["template_mismatch"]),
                   "multi_turn/noncanonical_turns": float(counts["noncanonical_turns"]),
                   "multi_turn/undecodable_turns": float(counts["undecodable_turns"]),
                   "multi_turn/tool_use_frac": len(called) / total,
                   "multi_turn/tool_success_frac": sum(1 for v in called.values() if v > 0) / total}
        return EpisodeResult(trajectories, [e.reward for e in episodes], metrics, [e.turns for e in episodes])

    async def _turn(self, live, turn, generate, sampling, version, renderers, counts, called) -> None:
        lim = self.limits
        group, budget = [], {}
        for e in live:
            left = min(lim.max_tokens_per_turn, lim.max_new_tokens - e.generated,
                       lim.max_model_len - len(e.builder.token_ids))
            if left < 1:
                e.done, e.finish = True, "length"
                counts["truncated"] += 1
            else:
                group.append(e)
                budget[e.uid] = left
        for k, calls in enumerate(_calls(group, budget, lim.max_model_len)):
            await self._call(calls, budget, turn, k, generate, sampling, version, renderers, counts, called)

    async def _call(self, group, budget, turn, k, generate, sampling, version, renderers, counts, called) -> None:
        """One engine call for `group` (episodes whose requests fit the engine's length together, `_calls`):
        the longest budget for all, each sample cut to its episode's own (the tokens after the cut were never part
        of it: as if the engine had stopped there, finish_reason 'length'), then the environments' steps."""
        if group:
            prompts = [list(e.builder.token_ids) for e in group]
            # at least `min_requests` requests (the engine replicas each need one): padded with copies, dropped
            padded = prompts + [prompts[0]] * max(0, self.min_requests - len(prompts))
            s = dataclasses.replace(
                sampling, samples_per_prompt=1, max_new_tokens=max(budget[e.uid] for e in group),
                max_prompt_tokens=max(len(p) for p in prompts),
                seed=None if sampling.seed is None else sampling.seed + turn * TURN_SEED_STRIDE + k * CALL_SEED_STRIDE)
            out = generate(padded, s)
            sampled_by = version() if callable(version) else version
            by_index = {x.prompt_index: x for x in out if x.prompt_index < len(group)}
            if len(by_index) != len(group):
                raise EpisodeError(f"turn {turn}: the engine returned {len(by_index)} samples for {len(group)} "
                                   "episodes (a prompt dropped as overlong?)")
            steps = []
            for i, e in enumerate(group):
                x = by_index[i]
                if len(x.response_ids) > budget[e.uid]:
                    cut = budget[e.uid]
                    x = dataclasses.replace(x, response_ids=list(x.response_ids)[:cut],
                                            response_log_probs=list(x.response_log_probs)[:cut],
                                            finish_reason="length")
                e.turns.append((prompts[i], list(x.response_ids), list(x.response_log_probs)))
                e.builder.sampled(x.response_ids, x.response_log_probs, sampled_by)
                e.generated += len(x.response_ids)
                e.turn = turn + 1
                counts["turns"] += 1
                ids = list(x.response_ids)
                body = ids[:-1] if ids and ids[-1] in self._end_ids() else ids  # the end-of-turn token left out
                text = self.tokenizer.decode(body, skip_special_tokens=False)
                self._count_encoding(body, text, counts)
                calls, errors = self.parser(text)
                counts["parse_errors"] += len(errors)
                if calls or errors:
                    called.setdefault(e.uid, 0)
                steps.append((e, x, ModelTurn(turn, text, tuple(x.response_ids), tuple(calls), tuple(errors),
                                              x.finish_reason)))
            results = await asyncio.gather(*(self._bounded(e.env.step(mt), f"episode {e.uid}, turn {turn}: step")
                                             for e, _, mt in steps), return_exceptions=True)
            for (e, x, mt), step in zip(steps, results):
                if isinstance(step, EpisodeError):
                    raise step
                if isinstance(step, BaseException):
                    raise EpisodeError(f"episode {e.uid}, turn {turn}: the environment failed: {step!r}") from step
                e.reward += float(step.reward)
                ran, failed = int(step.info.get("tool_calls", 0)), int(step.info.get("tool_errors", 0))
                counts["tool_calls"] += ran
                counts["tool_errors"] += failed
                if e.uid in called and called[e.uid] >= 0:
                    called[e.uid] = -1 if failed or mt.parse_errors else called[e.uid] + ran
                if step.done:
                    e.done, e.finish = True, x.finish_reason
                    continue
                cut = x.finish_reason == "length"
                if turn + 1 >= self.limits.max_turns or (cut and (e.generated >= self.limits.max_new_tokens
                                                                  or self.tokenizer.eos_token_id is None)):
                    # the last turn allowed, or the episode's token budget spent: the episode is truncated
                    e.done, e.finish = True, "length"
                    counts["truncated"] += 1
                    continue
                if cut:  # cut at max_tokens_per_turn: the template's end-of-turn token closes it, as context
                    e.builder.context([self.tokenizer.eos_token_id])
                    counts["turns_cut"] += 1
                self._observe(e, x, mt, step, turn, renderers, counts, closed=cut)

    def _observe(self, e, x, mt, step, turn, renderers, counts, closed: bool = False) -> None:
        """Append the observation tokens of `step` after the sampled turn (`closed`: a turn cut at its token limit,
        already closed by an end-of-turn token appended as context), and check the delta rule."""
        renderer = renderers[id(type(e.env))]
        ids = list(x.response_ids)
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
    `max_new_tokens`, the engine's context = max_prompt_tokens + max_new_tokens) and the chat template of
    `data.chat_template` (the tokenizer's, or a Jinja string). Refuses a template that rewrites earlier turns unless
    rollout.on_template_mismatch=mask."""
    from megarl.envs.registry import build_env_factory
    from megarl.envs.tool_calls import get_parser

    r = cfg.rollout
    limits = EpisodeLimits(max_turns=r.max_turns, max_tokens_per_turn=r.max_tokens_per_turn or r.max_new_tokens,
                           max_new_tokens=r.max_new_tokens, max_model_len=r.max_prompt_tokens + r.max_new_tokens)
    template = encoder.chat_template if getattr(encoder, "mode", "hf") == "jinja" else None
    factory = build_env_factory(r.env, {"reward_fn": reward_fn, **dict(r.env_options)})
    pool = cfg.resources.pools[r.pool if r.pool is not None else cfg.actor.pool]
    replicas = max(1, pool.nodes * pool.devices_per_node // r.tp)
    runner = EpisodeRunner(encoder.tokenizer, lambda record: factory(), get_parser(r.tool_parser), limits,
                           chat_template=template, on_template_mismatch=r.on_template_mismatch,
                           min_requests=replicas, env_timeout_s=r.env_timeout_s)
    if r.on_template_mismatch == "error":
        ChatRenderer(encoder.tokenizer, None, template).check_prefix_stable()
    return runner
