"""`BatchProducer`: where every schedule's rollout batch comes from (`megarl.trainer.schedule`).

    producer = BatchProducer(cfg, loader, encoder, reward_fn, episodes)   # built once by `RLLoop`
    batch = producer.produce(index, client, version)                      # a scored `RolloutBatch`

draw (the loader's next prompts, sampling seed rollout.seed + index) -> requests through a `RolloutClient`
(single-turn: `megarl.envs.episode.run_single_turn`, one request per prompt; multi-turn: `EpisodeRunner.arun`, one
coroutine per episode) -> trajectories -> scores -> filters (DAPO's dynamic sampling; the soft overlong penalty is
`overlong_penalty`, applied by the step) -> `RolloutBatch`.

Streaming: a single-turn group (a prompt's samples_per_prompt samples, one request) is scored the moment its request
finishes, on the producer's reward thread, while the batch's other requests are still generating; the batch is
returned when every group is scored. Scoring is per response (`reward_fn(text, answer, record)`), so the scores are
the numbers scoring the whole batch afterwards gives, in the batch's order. A multi-turn episode is scored inside its
own coroutine (its environment calls the reward function at each step), so it overlaps generation already. With
reward.judge, a single-turn group is judged on the reward thread like any reward (`score_samples`); multi-turn
episodes are judged once the batch's episodes have ended (`judge_episodes`: each episode's final model turn).
`time/reward_overlap_s`: the seconds of scoring that ran while the batch still had requests generating.

Over-sampling (`rollout.oversample` = k > 0, single-turn): draw prompts_per_step + k prompts, keep the first
prompts_per_step groups whose requests finish, abort the others' requests (`RolloutClient.abort`) and count them
(`rollout/oversampled_aborted_groups`). The kept groups are in the batch in the order of their prompt index among
the drawn prompts (renumbered 0..prompts_per_step-1), so which groups are kept depends on the engines' timing but
their order, samples and scores do not; the loader moves past all prompts_per_step + k drawn prompts (its state after
the step is resumable: the aborted prompts are consumed, not drawn again).

`version`: the weights version of the sampled tokens, an int (the batch's `version`; `token_versions` None) or a
function read per request / turn (the async driver: per-token versions recorded, the batch's version its oldest).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
from typing import Any, Callable, Optional, Union

import torch

from megarl.algorithms import soft_overlong_penalty
from megarl.algorithms.dynamic_sampling import enough_groups, informative_groups, select_groups
from megarl.rollout.client import WatchedClient
from megarl.rollout.engine import RolloutSamples, SamplingSettings
from megarl.trainer.schedule import RolloutBatch

logger = logging.getLogger("megarl.trainer")

# Sampling-seed offset of each extra dynamic-sampling round within a step (round k: rollout.seed + step + k * this).
ROUND_SEED_STRIDE = 1_000_003

Version = Union[int, Callable[[], int]]


@dataclasses.dataclass
class GenerationRound:
    """One generation of single-turn groups: the records drawn, samples ordered by (prompt_index, sample_index),
    dropped prompt indices, [len(samples)] float32 rule scores, reward metrics, per-sample token versions, and the
    seconds: generating (until the last kept request finished), scoring (summed over groups) and the part of the
    scoring that overlapped generation; `aborted`: over-sampled groups not taken (their requests aborted, or
    dropped by the prompt policy)."""

    records: list
    samples: list
    dropped: list
    scores: torch.Tensor
    reward_metrics: dict
    token_versions: list
    generate_s: float = 0.0
    reward_s: float = 0.0
    reward_overlap_s: float = 0.0
    aborted: int = 0


class BatchProducer:
    """Draw -> requests -> trajectories -> scores -> filters -> `RolloutBatch` (module docstring).

    cfg: the `JobConfig`; loader: a `PromptLoader` (`next_batch(size)`); encoder: the prompt encoder (`encode`,
    `decode`); reward_fn(text, answer, record) -> float; episodes: an `EpisodeRunner` (rollout.env) or None
    (single-turn); sampling: the base `SamplingSettings` (default: from cfg.rollout); judge: a
    `megarl.rollout.judge.Judge` (reward.judge) that scores every response instead of reward_fn or beside it by
    weights, group by group on the reward thread (its requests overlapping the batch's generation; multi-turn: each
    episode's final turn once the batch's episodes ended), its `judge/...` metrics in the batch's."""

    def __init__(self, cfg: Any, loader: Any, encoder: Any, reward_fn: Any, episodes: Any = None,
                 sampling: Optional[SamplingSettings] = None, judge: Any = None) -> None:
        self.cfg, self.loader, self.encoder, self.reward_fn, self.episodes = cfg, loader, encoder, reward_fn, episodes
        self.judge = judge
        self.sampling = sampling if sampling is not None else SamplingSettings.from_config(cfg.rollout)

    # ------------------------------------------------------------------------------------------------ public
    def draw(self, index: int, k: int = 0, extra: int = 0):
        """The loader's next prompts for batch `index` (round `k`): (records, prompt token ids (None with episodes),
        sampling settings with seed rollout.seed + index, plus k * ROUND_SEED_STRIDE); `extra` more records than
        data.prompts_per_step (over-sampling)."""
        records = self.loader.next_batch(self.cfg.data.prompts_per_step + extra) if extra else self.loader.next_batch()
        prompts = None if self.episodes is not None else [self.encoder.encode(r.prompt) for r in records]
        sampling = dataclasses.replace(self.sampling, seed=self.sampling.seed + index + k * ROUND_SEED_STRIDE)
        return records, prompts, sampling

    def produce(self, index: int, client: Any, version: Version, timers: Optional[dict] = None) -> RolloutBatch:
        """Batch `index` (sampling seed rollout.seed + index) through `client`, scored (dynamic sampling's extra
        rounds included when it is on). `timers`: adds the phase seconds `rollout`, `reward` (scoring left after the
        last request finished) and `reward_overlap` (scoring while requests were generating)."""
        t = timers if timers is not None else {}
        if self.episodes is not None:
            records, _, sampling = self.draw(index)
            started = time.perf_counter()
            batch = self.episode_batch(index, records, sampling, version, client)
            t["rollout"] = t.get("rollout", 0.0) + time.perf_counter() - started
            return batch
        overlap_before = t.get("reward_overlap", 0.0)
        first = self._round(index, 0, client, version, t)
        metrics: dict[str, float] = {}
        if self.cfg.rollout.oversample:
            metrics["rollout/oversampled_aborted_groups"] = float(first.aborted)
        if self.cfg.algorithm.dynamic_sampling.enabled:
            samples, dropped, scores, reward_metrics, records = self.dynamic_sampling(index, client, version, t,
                                                                                     first, metrics)
            token_versions = None
        else:
            samples, dropped, scores, reward_metrics = first.samples, first.dropped, first.scores, first.reward_metrics
            token_versions, records = first.token_versions, first.records
        metrics["time/reward_overlap_s"] = t.get("reward_overlap", 0.0) - overlap_before  # every round's
        if self.judge is not None:  # the responses judged since the last batch (every round's, validation's)
            metrics.update(self.judge.take_metrics())
        oldest = version
        if callable(version):
            oldest = min((min(v) for v in token_versions if v), default=version())
        else:
            token_versions = None
        return RolloutBatch(index, records, samples, dropped, scores,
                            reward_metrics, version=oldest, token_versions=token_versions, metrics=metrics,
                            rollout_s=first.generate_s, reward_s=first.reward_s)

    def episode_batch(self, index: int, records, sampling: SamplingSettings, version: Version,
                      client: Any) -> RolloutBatch:
        """rollout.samples_per_prompt multi-turn episodes per record (`EpisodeRunner`: one coroutine per episode
        through `client`), every trajectory verified against the engine's tokens; scores = the episodes' summed
        rewards (their environments call the reward function as each step ends)."""
        started = time.perf_counter()
        result = self.episodes.run(records, self.cfg.rollout.samples_per_prompt, client, sampling, version,
                                   uid_prefix=f"{index}/")
        if callable(version):  # weights pushed between turns: the batch's version is its oldest token's
            version = min((v for t in result.trajectories for v in t.policy_version if v >= 0), default=version())
        metrics = dict(result.metrics)
        rewards = result.scores
        if self.judge is not None:  # after the batch's episodes end, every episode's final turn at once
            rewards = judge_episodes(self.judge, self.encoder.decode, result, list(records), f"{index}/")
            metrics.update(self.judge.take_metrics())
        scores = torch.tensor(rewards, dtype=torch.float32)
        reward_metrics = {"reward/errors": 0.0, "reward/timeouts": 0.0, "reward/error_frac": 0.0}
        return RolloutBatch(index, list(records), [], [], scores, reward_metrics, version=version,
                            metrics=metrics, rollout_s=time.perf_counter() - started,
                            trajectories=result.trajectories)

    def sample(self, prompts: list[list[int]], client: Any, sampling: SamplingSettings, uid_prefix: str = ""):
        """(samples ordered by (prompt_index, sample_index), dropped prompt indices) of `prompts` through `client`,
        unscored (the Python API's `generate`): one request per prompt, every prompt in flight at once."""
        from megarl.envs.episode import run_single_turn

        out, _ = asyncio.run(run_single_turn(client, prompts, sampling, uid_prefix=uid_prefix,
                                             max_concurrent=max(1, len(prompts)), keep_outputs=False))
        samples, dropped = list(out), list(out.dropped_prompt_indices)
        if dropped:
            self._warn_dropped(dropped)
        return samples, dropped

    def validate(self, records: list, client: Any, version: int) -> dict[str, float]:
        """`val/reward_mean` (and `val/reward_errors`, multi-turn `val/tool_success_frac|turns_mean`) of greedy
        (rollout.val_temperature) responses to `records`, or one episode each with rollout.env."""
        sampling = SamplingSettings.from_config(self.cfg.rollout, validation=True)
        if self.episodes is not None:
            result = self.episodes.run(records, 1, client, sampling, version, uid_prefix="val/")
            rewards = result.scores if self.judge is None else judge_episodes(
                self.judge, self.encoder.decode, result, list(records), "val/")
            out = {"val/reward_mean": sum(rewards) / max(len(rewards), 1), "val/reward_errors": 0.0}
            out.update({f"val/{k.split('/', 1)[1]}": v for k, v in result.metrics.items()
                        if k in ("multi_turn/tool_success_frac", "multi_turn/turns_mean")})
            return out
        prompts = [self.encoder.encode(r.prompt) for r in records]
        r = asyncio.run(self._generate_scored(client, records, prompts, sampling, "val/", version, "validation",
                                              keep=len(records), keep_outputs=False))
        return {"val/reward_mean": float(r.scores.mean()) if len(r.scores) else float("nan"),
                "val/reward_errors": r.reward_metrics["reward/errors"]}

    def overlong_penalty(self, samples, metrics: dict[str, float]) -> torch.Tensor:
        """[B] float32 DAPO soft overlong penalty of each sample or trajectory (0 when
        `algorithm.overlong.soft_cache_tokens` is null), on its generated tokens (a trajectory's loss-mask count:
        all its turns); logs `overlong/truncated_frac` (finish_reason 'length') and, when on,
        `overlong/penalty_mean`."""
        truncated = [s.finish_reason == "length" for s in samples]
        metrics["overlong/truncated_frac"] = sum(truncated) / max(len(samples), 1)
        o = self.cfg.algorithm.overlong
        if o.soft_cache_tokens is None:
            return torch.zeros(len(samples), dtype=torch.float32)
        lengths = torch.tensor([sum(s.loss_mask) if hasattr(s, "loss_mask") else len(s.response_ids)
                                for s in samples])
        penalty = soft_overlong_penalty(lengths, self.cfg.rollout.max_new_tokens, o.soft_cache_tokens,
                                        o.penalty_factor)
        metrics["overlong/penalty_mean"] = float(penalty.mean())
        return penalty

    def scores(self, samples, records, what: str) -> tuple[torch.Tensor, dict[str, float]]:
        """[B] float32 rule scores of the decoded responses, and `reward/errors|timeouts|error_frac`; failures follow
        `reward.on_error` / `timeout_s`, and more than `reward.max_error_fraction` failed stops the run
        (`megarl.rewards.scoring`)."""
        from megarl.rewards import check_failures

        scored = score_samples(self, samples, records)
        check_failures(scored, self.cfg.reward.max_error_fraction, what)
        return torch.tensor(scored.scores, dtype=torch.float32), scored.metrics()

    def dynamic_sampling(self, index: int, client: Any, version: Version, t: dict, first: GenerationRound,
                         metrics: dict[str, float]):
        """DAPO's dynamic sampling (`algorithm.dynamic_sampling`, `megarl.algorithms.dynamic_sampling`): from the
        first round, more rounds (`_round`) until data.prompts_per_step groups have unequal final scores (rule score
        + soft overlong penalty) or max_rounds ran; returns the selected groups' samples (prompt indices renumbered
        in training order), the dropped prompts of every round as (round, prompt), their rule scores [B], the
        reward metrics over every round and the selected groups' records in training order (records[i] is the
        record of the samples with prompt_index i). Logs `dynamic_sampling/{rounds,dropped_groups,filled_groups,
        surplus_groups}` (counts of groups)."""
        target = self.cfg.data.prompts_per_step
        rounds, flags = [first], []
        while True:
            r = rounds[-1]
            scores = r.scores + self.overlong_penalty(r.samples, {})
            group_ids = torch.tensor([s.prompt_index for s in r.samples], dtype=torch.long)
            informative = informative_groups(scores, group_ids, len(r.records))
            flags.append([None if p in set(r.dropped) else f for p, f in enumerate(informative)])
            if enough_groups(flags, target) or len(rounds) == self.cfg.algorithm.dynamic_sampling.max_rounds:
                break
            rounds.append(self._round(index, len(rounds), client, version, t))
        chosen = select_groups(flags, target)
        samples, scores = [], []
        for new_index, (k, p) in enumerate(chosen.selected):
            for s, score in zip(rounds[k].samples, rounds[k].scores.tolist()):
                if s.prompt_index == p:
                    samples.append(dataclasses.replace(s, prompt_index=new_index))
                    scores.append(score)
        n = sum(len(r.samples) for r in rounds)
        errors = sum(r.reward_metrics["reward/errors"] for r in rounds)
        reward_metrics = {"reward/errors": errors,
                          "reward/timeouts": sum(r.reward_metrics["reward/timeouts"] for r in rounds),
                          "reward/error_frac": errors / n if n else 0.0}
        metrics.update({"dynamic_sampling/rounds": float(len(rounds)),
                        "dynamic_sampling/dropped_groups": float(chosen.dropped),
                        "dynamic_sampling/filled_groups": float(chosen.filled),
                        "dynamic_sampling/surplus_groups": float(chosen.surplus)})
        if chosen.filled:
            logger.warning("step %d: %d of %d groups have all-equal scores after algorithm.dynamic_sampling."
                           "max_rounds=%d rounds; they fill the batch", index, chosen.filled, target, len(rounds))
        dropped = [(k, p) for k, r in enumerate(rounds) for p in r.dropped]
        records = [rounds[k].records[p] for k, p in chosen.selected]
        return samples, dropped, torch.tensor(scores, dtype=torch.float32), reward_metrics, records

    # ------------------------------------------------------------------------------------------------ pieces
    def _round(self, index: int, k: int, client: Any, version: Version, t: dict) -> GenerationRound:
        """Round `k` of batch `index` (k > 0 only with dynamic sampling): the loader's next prompts (plus
        rollout.oversample extra ones), generated and scored group by group (`_generate_scored`)."""
        extra = int(self.cfg.rollout.oversample or 0)
        records, prompts, sampling = self.draw(index, k, extra=extra)
        what = f"step {index}" + (f" round {k + 1}" if k else "")
        r = asyncio.run(self._generate_scored(client, records, prompts, sampling, f"{index}/{k}/", version, what,
                                              keep=self.cfg.data.prompts_per_step))
        t["rollout"] = t.get("rollout", 0.0) + r.generate_s
        t["reward"] = t.get("reward", 0.0) + max(r.reward_s - r.reward_overlap_s, 0.0)
        t["reward_overlap"] = t.get("reward_overlap", 0.0) + r.reward_overlap_s
        return r

    async def _generate_scored(self, client: Any, records: list, prompts: list, sampling: SamplingSettings,
                               uid_prefix: str, version: Version, what: str, keep: int,
                               keep_outputs: bool = True) -> GenerationRound:
        """Generate every prompt (one request each, `run_single_turn`) and score each group on the reward thread as
        its request finishes; with more prompts than `keep` (over-sampling), stop at the first `keep` finished
        groups and abort the others' requests; `keep_outputs` False (validation): no by-reference packages. Returns
        the `GenerationRound` of the kept groups, renumbered in prompt order."""
        from megarl.envs.episode import run_single_turn
        from megarl.rewards import check_failures
        from megarl.rewards.scoring import ScoredBatch

        loop = asyncio.get_running_loop()
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="megarl-reward")
        started = time.perf_counter()
        finished: dict[int, Any] = {}  # prompt index -> its output, in finishing order
        scoring: dict[int, asyncio.Future] = {}
        enough = asyncio.Event()
        generating_until: list[Optional[float]] = [None]

        def score_group(i: int, out) -> tuple:
            begin = time.perf_counter()
            scored = score_samples(self, out.samples(i), records)
            return scored, begin, time.perf_counter()

        def on_finished(request, out) -> None:
            i = request.seed_index
            if len(finished) >= keep:  # finished after the batch was full: not taken
                return
            finished[i] = out
            scoring[i] = loop.run_in_executor(pool, score_group, i, out)
            if len(finished) == keep:
                enough.set()

        watched = WatchedClient(client, on_finished)
        generation = asyncio.ensure_future(run_single_turn(
            watched, prompts, sampling, uid_prefix=uid_prefix, policy_version=version,
            max_concurrent=max(1, len(prompts)), keep_outputs=keep_outputs))
        try:
            if len(prompts) > keep:
                waiter = asyncio.ensure_future(enough.wait())
                # bounded: every request of `generation` has its client's timeout (the router's default_timeout_s)
                await asyncio.wait([generation, waiter], return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                if not generation.done():  # the first `keep` groups are in: abort the others' requests
                    await client.abort([f"{uid_prefix}{i}/t0" for i in range(len(prompts)) if i not in finished])
                    try:
                        await generation
                    except asyncio.CancelledError:  # the aborted requests' callers raise it
                        pass
                    generation = None
            if generation is not None:
                out, versions = await generation
            generating_until[0] = time.perf_counter()
            results = {i: await scoring[i] for i in sorted(scoring)}
        finally:
            if generation is not None and not generation.done():
                generation.cancel()
            pool.shutdown(wait=False)
        end = generating_until[0]
        if len(prompts) > keep:  # over-sampled: the kept groups' samples, renumbered in prompt order
            order = sorted(finished)
            samples, versions = [], []
            for new, i in enumerate(order):
                for s, c in zip(finished[i].samples(new), finished[i].completions):
                    samples.append(s)
                    current = self._version_now(client, version)
                    versions.append(list(c.versions) if c.versions is not None else [current] * len(c.token_ids))
            out = RolloutSamples(samples)
            kept_records = [records[i] for i in order]
            aborted = len(prompts) - len(order)
        else:
            order, kept_records, aborted = sorted(results), records, 0
        merged = ScoredBatch([], [])
        for i in order:
            scored = results[i][0]
            offset = len(merged.scores)
            merged.scores.extend(scored.scores)
            merged.failures.extend(dataclasses.replace(f, index=f.index + offset) for f in scored.failures)
        check_failures(merged, self.cfg.reward.max_error_fraction, what)
        samples, dropped = list(out), list(out.dropped_prompt_indices)
        if dropped:
            self._warn_dropped(dropped)
        spans = [(b, e) for _, b, e in results.values()]
        scores = torch.tensor(merged.scores, dtype=torch.float32)
        return GenerationRound(kept_records, samples, dropped, scores, merged.metrics(), versions,
                      generate_s=end - started, reward_s=sum(e - b for b, e in spans),
                      reward_overlap_s=sum(max(0.0, min(e, end) - b) for b, e in spans), aborted=aborted)

    def _warn_dropped(self, dropped: list) -> None:
        logger.warning("%d prompt(s) longer than rollout.max_prompt_tokens=%d were dropped this step "
                       "(rollout.overlong_prompt=%s)", len(dropped), self.cfg.rollout.max_prompt_tokens,
                       self.cfg.rollout.overlong_prompt)

    @staticmethod
    def _version_now(client: Any, version: Version) -> int:
        current = getattr(client, "weight_version", None)
        if current is None:
            current = version() if callable(version) else (version or 0)
        return current


def score_samples(producer: Any, samples, records):
    """`ScoredBatch` of `samples` (their records: records[s.prompt_index]) with `producer`'s encoder (decode),
    reward_fn and cfg.reward (on_error, timeout_s); with a judge, the judge's scores (which never fail: a failed
    judgement scores reward.judge.fallback_score, counted in its metrics)."""
    from megarl.rewards import ScoredBatch, score_responses

    r = producer.cfg.reward
    texts = [producer.encoder.decode(s.response_ids) for s in samples]
    kept = [records[s.prompt_index] for s in samples]
    judge = getattr(producer, "judge", None)  # duck-typed hosts (tests) may have none
    if judge is None or judge.cfg.function_weight:
        rule = score_responses(producer.reward_fn, texts, kept, on_error=r.on_error, timeout_s=r.timeout_s)
        if judge is None:
            return rule
    from megarl.rollout.judge import question_text

    judged = judge.score_group([question_text(k.prompt) for k in kept], texts, [k.answer for k in kept])
    if not judge.cfg.function_weight:
        return ScoredBatch(judge.combine(judged, None), [])
    return ScoredBatch(judge.combine(judged, rule.scores), rule.failures)


def judge_episodes(judge: Any, decode: Callable, result: Any, records: list, uid_prefix: str) -> list[float]:
    """[len(result.trajectories)] rewards of multi-turn episodes with a judge (`reward.judge`): each episode's final
    model turn (the last span of its final trajectory's loss mask, decoded) is judged as {response}, its text after
    the prompt as {transcript}, the record's prompt and answer as {question} and {reference}; the score is combined
    with the episode's summed environment rewards (result.scores) by weight / function_weight. Every trajectory of an
    episode (an agent's segments: uids "<prefix><record>/<episode>/s<j>") gets its episode's reward. Trajectories
    are record-major with group_uid "<prefix><record index>" (`EpisodeRunner`, `AgentRunner`)."""
    from megarl.rollout.judge import question_text

    episode_of = ["/".join(t.uid[len(uid_prefix):].split("/")[:2]) for t in result.trajectories]
    final = {key: i for i, key in enumerate(episode_of)}  # an episode's last trajectory: its final segment
    order = list(final)
    questions, responses, references, transcripts = [], [], [], []
    for key in order:
        t = result.trajectories[final[key]]
        record = records[int(t.group_uid[len(uid_prefix):])]
        questions.append(question_text(record.prompt))
        responses.append(decode(final_turn_ids(t)))
        references.append(record.answer)
        transcripts.append(decode(t.token_ids[t.prompt_len:]))
    judged = dict(zip(order, judge.score_group(questions, responses, references, transcripts)))
    rule = list(result.scores) if judge.cfg.function_weight else None
    return judge.combine([judged[key] for key in episode_of], rule)


def final_turn_ids(trajectory: Any) -> list[int]:
    """The token ids of a trajectory's last sampled span (its final model turn: the last run of loss_mask 1, or of
    the positions after the prompt when nothing is in the loss mask, e.g. a masked episode)."""
    mask = trajectory.loss_mask
    end = max((i for i, m in enumerate(mask) if m), default=None)
    if end is None:
        return list(trajectory.token_ids[trajectory.prompt_len:])
    start = end
    while start > trajectory.prompt_len and mask[start - 1]:
        start -= 1
    return list(trajectory.token_ids[start:end + 1])
