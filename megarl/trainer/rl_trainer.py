"""The RL loop, on the controller. One screen of dataflow; the work happens in the workers.

    prompts -> rollout (vLLM, each replica its chunk) -> rewards -> old / reference log-probs (Megatron)
            -> mismatch (vLLM vs Megatron log-probs) -> advantages -> critic + actor updates -> reshard into vLLM
            -> metrics

`RLLoop` talks to the rollout engines through a `megarl.rollout.service.RolloutService` (`ColocatedRollout`: the
`HybridWorker` group's engines, weights by local reshard; `PoolRollout`: engines on a pool of their own, weights
sent over a bridge) and to the roles through their worker groups
(`megarl.controller`: each call runs on every rank (SPMD) and returns the collected result). Rewards and advantages
are computed here, on the controller, from plain tensors.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Any, Optional

import torch

from megarl.algorithms import (
    apply_kl_penalty,
    build_kl_controller,
    filter_truncated,
    get_advantage,
    per_sequence_advantages,
    scores_to_token_rewards,
)
from megarl.algorithms.distillation import (
    combine_advantages,
    reverse_kl_advantages,
    reverse_kl_mean,
    rows_by_source,
)
from megarl.algorithms.rollout_correction import mismatch_from_rows
from megarl.config.loader import to_dict
from megarl.config.schema import JobConfig
from megarl.controller import serving
from megarl.controller.shares import BatchShares
from megarl.data.batch import Batch
from megarl.data.token_rows import TokenRowSource
from megarl.data.trajectory import trajectories_to_batch
from megarl.rollout.engine import SamplingSettings
from megarl.rollout.service import ColocatedRollout, RolloutService
from megarl.trainer import checkpointing
from megarl.trainer.checkpoint_manager import CheckpointManager, ProcessRNG
from megarl.trainer.faults import RunAborted
from megarl.trainer.producer import BatchProducer
from megarl.trainer.progress import ConsoleProgress
from megarl.trainer.samples import samples_to_trajectories
from megarl.trainer.schedule import build_schedule
from megarl.trainer.stop import StopRequest
from megarl.trainer.tracking import build_sinks

logger = logging.getLogger("megarl.trainer")

SCORE_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")
# What each step logs of rank 0's reshard report (`megarl.reshard.executor.ReshardReport`): bytes received and the
# layouts' lower bound (equal when the plan is optimal), seconds (verification included, and its share), pieces
# verified against their senders' checksums (0 with rollout.verify_sync=false), and the actor's offloaded bytes.
RESHARD_METRICS = ("reshard/bytes_received", "reshard/bytes_lower_bound", "reshard/time_s", "reshard/verify_time_s",
                   "reshard/verified_pieces", "reshard/peak_extra_bytes", "offload/actor_bytes")
# ... and, with engines on a pool of their own (`megarl.rollout.service.PoolRollout`), the sync's figures over both
# pools: bytes sent per actor rank and received per rollout rank (max, mean, each rank), verified or not.
POOL_METRICS = "reshard/pool/"


@dataclasses.dataclass
class StepResult:
    """What one RL step produced (all floats are means over the step's samples unless named otherwise)."""

    step: int
    metrics: dict[str, float]


class RLLoop:
    """The RL loop on the controller: drives `workers` (a `WorkerGroup` of `HybridWorker`, or of `ActorWorker` with
    `rollout.pool`) through `cfg.trainer.total_steps` RL steps (`step`: rollout -> rewards -> log-probs ->
    advantages -> updates -> weight sync; `fit`: every remaining step with validation, checkpoints and logging).

    Internal: a `megarl.trainer.session.TrainingSession` builds it; users drive a run through the Python API
    `megarl.RLTrainer` (`megarl.api`) or `megarl train`, never this class directly."""

    def __init__(self, cfg: JobConfig, workers, loader, encoder, reward_fn, role_groups: Optional[dict] = None,
                 val_records: Optional[list] = None, metrics_path: Optional[str] = None,
                 stop: Optional[StopRequest] = None, rollout: Optional[RolloutService] = None,
                 judge: Optional[Any] = None, engine_teachers: Optional[dict] = None) -> None:
        """`workers`: the actor pool's group (HybridWorker; ActorWorker with rollout.pool). `role_groups`: for each
        enabled reference / critic / reward_model, the group that hosts it (`workers` itself when colocated, else its
        own RoleWorker group), and "teacher/<name>": the group hosting distillation teacher <name> when it is on a
        pool of its own (a `TeacherWorker` group; default: `workers`). `stop`: the controller's SIGTERM/SIGINT handlers
        (`megarl.trainer.stop`); `fit` ends after the step in flight, checkpointed, once it is requested. `rollout`:
        where samples come from and weights go (default `ColocatedRollout(workers)`: the actor pool's engines; the
        session passes a `PoolRollout` with rollout.pool). `judge`: the `megarl.rollout.judge.Judge` of reward.judge
        (the session's), scoring instead of reward_fn or beside it by weights. `engine_teachers`: the vLLM-served
        teachers (backend vllm) by name, each a `megarl.rollout.teacher_engine.EngineTeacher` (the session's)."""
        self.stop = stop
        self.cfg = cfg
        self.workers = workers
        # sync: one thread runs every phase, whose start and stop leave the critical path (`overlap_phase_ends`)
        self.rollout = rollout if rollout is not None else ColocatedRollout(
            workers, serving_backend=serving, overlap_phase_ends=cfg.trainer.mode == "sync")
        self.role_groups = dict(role_groups or {})
        self.engine_teachers = dict(engine_teachers or {})
        self.loader = loader
        self.encoder = encoder
        self.reward_fn = reward_fn
        self.val_records = val_records or []
        self.metrics_path = metrics_path
        # TensorBoard etc. (`logging.backends`), beside metrics.jsonl in the run directory
        self.sinks = build_sinks(cfg.logging.backends, os.path.dirname(os.path.abspath(metrics_path)), cfg.logging,
                                 to_dict(cfg)) if metrics_path else []
        self.sampling = SamplingSettings.from_config(cfg.rollout)
        self.estimator = cfg.algorithm.estimator
        kl = cfg.algorithm.kl
        self.kl_in_reward = cfg.reference.enabled and kl.placement == "reward" and kl.coef > 0
        # KL in the reward: a fixed coefficient, or Ziegler et al.'s adaptive controller when kl.target is set.
        self.kl_ctl = build_kl_controller("adaptive" if kl.target is not None else "fixed", kl.coef, kl.target,
                                          kl.horizon)
        self.old_log_probs_from_update = old_log_probs_from_update(cfg)
        # on-policy distillation: the teachers (on the actor's pool, a pool of their own, or vLLM engines) score the
        # sampled tokens
        self.teachers = [name for name, t in cfg.distillation.teachers.items() if t.enabled]
        self.megatron_teachers = [n for n in self.teachers if cfg.distillation.teachers[n].backend == "megatron"]
        self.update_reads_rollout_log_probs = update_reads_rollout_log_probs(cfg)
        self._actor_corrects_rollout: Optional[bool] = None  # asked of the actor's ranks on first use
        d = cfg.distillation  # the top-k forward KL's weight in the actor's loss, sent with each update
        self.top_k_kl_coef = d.top_k_coef if d.enabled and d.top_k else 0.0
        self.skip_streak: dict[str, int] = {}  # role -> optimizer steps skipped in a row (non-finite loss/grad norm)
        self.next_step = 0  # 0 until `start`; then the step `run_step` runs next
        self.last_saved: Optional[int] = None  # the last step checkpointed by this process
        self.progress: Optional[ConsoleProgress] = None  # made by `start` (the bar starts at the resumed step)
        # multi-turn episodes (rollout.env, `megarl.envs.episode`); None: one response per prompt
        self.episodes = None
        if cfg.rollout.env is not None:
            from megarl.serving.agents import is_agent_spec

            if is_agent_spec(cfg.rollout.env):  # an agent against the openai client (`megarl.serving.agents`)
                from megarl.serving.agents import runner_from_config as agent_runner

                self.episodes = agent_runner(cfg, encoder)
            else:
                from megarl.envs.episode import runner_from_config

                self.episodes = runner_from_config(cfg, encoder, reward_fn)
        # where every rollout batch comes from (draw -> requests -> scores -> filters), and when rollouts run
        # against training (trainer.mode, `megarl.trainer.schedule`)
        self.producer = BatchProducer(cfg, loader, encoder, reward_fn, self.episodes, self.sampling, judge=judge)
        self.schedule = build_schedule(cfg, self.rollout, self.producer)
        # everything a checkpoint holds: the controller's Stateful objects, restored in this order (the RNG last),
        # and the trained roles' groups, which save their own distributed checkpoints and RNG
        self.checkpoints = CheckpointManager(
            states={"loop": self, "loader": loader, "schedule": self.schedule, "kl": self.kl_ctl,
                    "rng": ProcessRNG()},
            shards=self._checkpointed_groups())

    # --------------------------------------------------------------------------------------------- the loop
    def fit(self) -> list[StepResult]:
        """Run steps `next_step..cfg.trainer.total_steps` (from 1, the resumed checkpoint's step + 1, or after the
        steps already run by `run_step`); one `StepResult` per step run, in order.

        Once `self.stop` is requested (SIGTERM/SIGINT) no further step starts: the last finished step is checkpointed
        (if not already) and `fit` returns early.
        """
        results: list[StepResult] = []
        self.start()
        while self.next_step <= self.cfg.trainer.total_steps and not self._stop_requested():
            results.append(self.run_step())
        if self._stop_requested() and self.cfg.checkpoint.dir and results and self.last_saved != results[-1].step:
            self.save(results[-1].step)  # the signal came after this step's save decision
        return results

    def start(self) -> int:
        """Once: resume from `checkpoint.dir` when asked, and reshard the actor's weights into the rollout engine (it
        starts random). Returns the next step to run."""
        if self.next_step == 0:
            self.next_step = self._resume() + 1
            if self.next_step == 1 and self.metrics_path:  # a run of its own: never append to another run's steps
                moved = set_aside_earlier_metrics(self.metrics_path)
                if moved:
                    logger.info("%s held the steps of an earlier run (not resumed): moved to %s",
                                self.metrics_path, moved)
            self.rollout.push_weights(version=self.next_step - 1)
            self.schedule.start(self.next_step)
            self.progress = ConsoleProgress(self.cfg.trainer.total_steps, self.next_step, self.cfg.logging.progress,
                                            self.cfg.trainer.log_every)
        return self.next_step

    def close(self) -> None:
        """Stop the rollout schedule's driver, collect the rollout service's last serving phase (`ColocatedRollout.
        close`: its stop's error raised), end the progress bar and flush and close the metric sinks (TensorBoard,
        W&B). Idempotent."""
        try:
            self.schedule.close()
            close_rollout = getattr(self.rollout, "close", None)  # a phase's stop not collected yet (colocated)
            if close_rollout is not None:
                close_rollout()
        finally:
            if self.progress is not None:
                self.progress.close()
            for sink in self.sinks:
                sink.close()
            self.sinks = []

    def run_step(self) -> StepResult:
        """Step `next_step` and what follows it: validation every `trainer.val_every` steps (`val/reward_mean`), a
        checkpoint every `checkpoint.save_every` steps, at the last step, or once a stop was requested, when
        `checkpoint.dir` is set (`checkpoint/save_s`, seconds), then the metrics (console, metrics.jsonl, sinks)."""
        step, total = self.start(), self.cfg.trainer.total_steps
        if step > total:
            raise RuntimeError(f"all trainer.total_steps={total} steps have run; raise trainer.total_steps to train on")
        result = self.step(step)
        if self.val_records and self.cfg.trainer.val_every and step % self.cfg.trainer.val_every == 0:
            result.metrics.update(self.validate())
        every = self.cfg.checkpoint.save_every
        if self.cfg.checkpoint.dir and (step == total or (every and step % every == 0) or self._stop_requested()):
            saving = time.perf_counter()
            self.save(step)
            self.last_saved = step
            result.metrics["checkpoint/save_s"] = time.perf_counter() - saving
        self.next_step = step + 1
        self._log(result)
        self._check_skips(result)
        return result

    def _stop_requested(self) -> bool:
        return self.stop is not None and self.stop.requested

    # --------------------------------------------------------------------------------------------- checkpoints
    def _resume(self) -> int:
        """Load the newest complete checkpoint when `checkpoint.resume`; returns the step it ended (0: none)."""
        ckpt = self.cfg.checkpoint
        if not ckpt.dir:
            return 0
        if not ckpt.resume:
            existing = checkpointing.complete_steps(ckpt.dir)
            if existing:  # never overwrite another run's checkpoints
                raise RuntimeError(
                    f"checkpoint.dir {ckpt.dir} holds checkpoints of an earlier run (steps {existing}); set "
                    "checkpoint.resume=true to continue it, or choose another checkpoint.dir"
                )
            return 0
        path = checkpointing.latest(ckpt.dir)
        if path is None:
            return 0
        record = checkpointing.read_state(path)
        for line in checkpointing.check_resume_config(record.get("config"), self.cfg, path):
            logger.info(line)
        step, loaded = self.checkpoints.load(path)
        logger.info("resumed from %s (step %d of %d; loaded %s)", path, step, self.cfg.trainer.total_steps,
                    ", ".join(loaded))
        if not all(name.endswith("+optimizer") for name in loaded):
            logger.warning("%s holds model weights only for %s: their Adam moments restart, so this run is not the "
                           "uninterrupted one", path, [n for n in loaded if not n.endswith("+optimizer")])
        return step

    def state_dict(self) -> dict:
        """The loop's own state (plain data): {"skip_streak": {role: optimizer steps skipped in a row}}. The step
        is the checkpoint's (`CheckpointManager`); the loader, schedule, KL controller and RNG save themselves."""
        return {"skip_streak": {role: int(n) for role, n in self.skip_streak.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.skip_streak = {role: int(n) for role, n in state["skip_streak"].items()}

    def _checkpointed_groups(self) -> list:
        """Groups holding trained roles: the actor's, and the critic's when it has its own pool."""
        groups = [self.workers]
        critic = self.role_groups.get("critic")
        if critic is not None and critic is not self.workers:
            groups.append(critic)
        return groups

    def save(self, step: int, root: Optional[str] = None) -> str:
        """Checkpoint everything the next step depends on into `root/step_NNNNNN` (`root`: default
        `checkpoint.dir`), atomically, through `self.checkpoints`: the trained roles' full state and every worker's
        RNG (their groups write them), then the controller's states (this loop, the loader position, the schedule's
        finished rollout batches not yet trained on, the KL coefficient, the controller's RNG) and the config,
        written while the schedule is paused (nothing in flight). Returns the step directory."""
        with self.schedule.pause():
            root = root or self.cfg.checkpoint.dir
            path = self.checkpoints.save(root, step, {"config": checkpointing.config_record(self.cfg)},
                                         keep_last=self.cfg.checkpoint.keep_last)
        logger.info("saved checkpoint %s", path)
        return path

    def step(self, step: int) -> StepResult:
        """One RL step (`step` is 1-based; it also offsets the sampling seed: `rollout.seed + step`).

        Data path, all on the controller except the worker calls: the schedule's batch (`megarl.trainer.producer.
        BatchProducer`: next prompt batch from the loader -> the rollout service's request servers, samples n per
        prompt -> rule scores [B], each group scored as it finishes; with `algorithm.dynamic_sampling`, more rounds of
        prompts until the groups with unequal scores fill the step) -> trajectories (`megarl.data.trajectory`;
        weights version step - 1, group = prompt) -> `trajectories_to_batch` ([B, S] token tensors and `loss_mask`,
        B = samples) -> the learned reward model's scores when enabled (the rule mean then logged as
        `reward/rule_mean`) + the soft overlong penalty ->
        old log-probs [B, S] from the actor (skipped when the update takes them from its own forward:
        `old_log_probs_from_update`) -> reference log-probs and critic values [B, S] when enabled ->
        advantages (and returns) on the controller -> critic update (overlapping the actor's when the critic has
        its own pool) -> actor update -> `rollout.push_weights` (the reshard into the engines). Returns the step's
        metrics: rewards, lengths (tokens), per-phase times in seconds (`time/<phase>_s`), tokens/s, the roles'
        update metrics (`actor/...`, `critic/...`), the reshard's bytes and time, and the batch's row pieces put into
        the object store for the role calls (`dispatch/batch_pieces_put`, `dispatch/batch_put_bytes`: each once;
        `dispatch/batch_pieces_inline`, `dispatch/batch_inline_bytes`: small [B] pieces sent with the calls instead;
        `dispatch/batch_pieces_by_reference`: pieces of the token keys the ranks built from the rollout's packages;
        `dispatch/token_rows_packed_pieces` / `_bytes`: pieces of the token keys built from rows the controller put
        once as one object per piece, e.g. multi-turn episodes' -- one crossing, `TokenRowSource.from_rows`),
        and the token-sized tensors ([B, S] and up) that crossed the controller: `dispatch/token_tensors_down` (the
        batch's, each put once), `dispatch/token_results_up` (role results fetched) and `dispatch/token_crossings`
        (those plus generation's output: token ids and vLLM's log-probs).
        """
        t: dict[str, float] = {}
        start = time.perf_counter()
        metrics: dict[str, float] = {}
        rollout = self.schedule.take(step, t)  # sync: generated and scored now; else generated beside training
        samples, dropped, scores = rollout.samples, rollout.dropped, rollout.scores
        metrics.update(rollout.metrics)
        trajectories = rollout.trajectories if rollout.trajectories is not None else samples_to_trajectories(
            samples, policy_version=rollout.version, uid_prefix=f"{step}/", token_versions=rollout.token_versions)
        batch = trajectories_to_batch(trajectories, pad_id=self.encoder.pad_token_id or 0)
        # the batch's token ids and masks go down once: each DP share of each key is put into the object store
        # once and every role call below passes the same references (`megarl.controller.shares`)
        with BatchShares(self._share_calls()) as shares:
            # the token keys stay on the rollout ranks where every row is one completion they kept: the training
            # ranks build their rows from those packages (`megarl.data.token_rows`); else (rows the controller built:
            # multi-turn episodes, restored or changed samples) each piece's rows are put once as one object
            pad = self.encoder.pad_token_id or 0
            shares.by_reference(TokenRowSource.from_trajectories(trajectories, batch, pad)
                                or TokenRowSource.from_rows(batch, pad))
            with _timer(t, "reward"):
                metrics.update(rollout.reward_metrics)
                if "reward_model" in self.role_groups:  # the learned reward is what is trained on
                    metrics["reward/rule_mean"] = float(scores.mean())
                    scores = self.role_groups["reward_model"].score(batch).tensors["scores"].float()
                scores = scores + self.producer.overlong_penalty(trajectories, metrics)
            batch.tensors["scores"] = scores
            stay = self._results_stay(len(batch))
            kept_actor: dict[str, tuple[str, str]] = {}  # batch key -> (name, result key) kept on the actor's ranks
            kept_critic: dict[str, tuple[str, str]] = {}
            ref_pending = None  # the reference's call when its results stay on the actor's ranks
            if not self.old_log_probs_from_update:  # else the update's own forward gives them (and the mismatch)
                with _timer(t, "old_log_probs"):
                    keep = f"{step}/old_log_probs" if stay["old"] else None
                    # the ranks compute the mismatch rows ([B] numbers come up); the log-probs come up only where the
                    # controller computes with them (KL in the reward) or must send them back down (not kept);
                    # entropy stays where it was made
                    versions = _versions(batch)
                    mixed = len(versions) > 1
                    fetch_old = keep is None or self.kl_in_reward or bool(self.teachers)
                    band = self.cfg.algorithm.rollout_correction.c
                    old = self.workers.compute_log_probs(
                        batch if mixed else _without(batch, {"policy_version"}), keep=keep,
                        fetch=(("log_probs",) if fetch_old else ()) + ("routed_experts",),
                        mismatch={"c": band, "versions": versions if mixed else None})
                    if fetch_old:
                        batch.tensors["old_log_probs"] = old.tensors["log_probs"]
                    if keep is not None:
                        kept_actor["old_log_probs"] = (keep, "log_probs")
                    if "routed_experts" in old.tensors:  # algorithm.router_replay=old|rollout: the update replays them
                        batch.tensors["routed_experts"] = old.tensors["routed_experts"]
                    diff = old.meta.get("moe_rollout_routing_diff_frac")  # rollout: vLLM's experts vs the actor's own
                    if diff is not None:
                        metrics["actor/moe_rollout_routing_diff_frac"] = float(diff)
                metrics.update(mismatch_from_forward(old.tensors, trained_version=step - 1,
                                                     versions=versions if mixed else []))
            if "reference" in self.role_groups:
                with _timer(t, "ref_log_probs"):
                    if stay["ref"]:  # read by the actor's loss only: they stay on the ranks that made them
                        keep = f"{step}/ref_log_probs"
                        # submitted, not waited on: the controller forms the advantages meanwhile and submits the
                        # actor's update behind it (the same ranks run one caller's role calls in submission order,
                        # `WorkerGroup`), and collects this call's answer first, so a failure here is named as the
                        # reference's
                        ref_pending = self.role_groups["reference"].compute_ref_log_probs.submit(
                            batch, keep=keep, fetch=())
                        kept_actor["ref_log_probs"] = (keep, "log_probs")
                    else:
                        ref = self.role_groups["reference"].compute_ref_log_probs(batch, fetch=("log_probs",))
                        batch.tensors["ref_log_probs"] = ref.tensors["log_probs"]
            teacher_log_probs: dict[str, Batch] = {}
            if self.teachers:  # the controller forms the advantages from them: [B, S] float32 each come up
                top_k = self.cfg.distillation.top_k  # and the top-k distributions [B, S, k], for the actor's loss
                fetch_teacher = ("log_probs", "top_k_ids", "top_k_log_probs") if top_k else ("log_probs",)
                with _timer(t, "teacher_log_probs"):
                    for name in self.teachers:
                        if self.cfg.distillation.teachers[name].backend == "vllm":  # log-probs only (top_k refused)
                            log_probs = self._engine_teacher(name).log_probs(
                                batch["input_ids"], batch["attention_mask"], batch.with_loss_mask()["loss_mask"])
                            teacher_log_probs[name] = Batch({"log_probs": log_probs})
                            continue
                        teacher_log_probs[name] = self._teacher_group(name).compute_teacher_log_probs(
                            batch, teacher=name, fetch=fetch_teacher, top_k=top_k)
            critic = self.role_groups.get("critic")
            gae_here = critic is not None and self._gae_on_ranks(stay)
            if critic is not None:
                with _timer(t, "values"):
                    keep = f"{step}/values" if stay["values"] else None
                    if gae_here:  # GAE on the critic's ranks: values, returns and advantages stay there
                        gae = {"gamma": self.cfg.algorithm.gamma, "lam": self.cfg.algorithm.lam,
                               "keep_advantages": f"{step}/advantages"}
                        critic.compute_values(batch, keep=keep, fetch=(), gae=gae)
                        kept_critic["returns"] = (keep, "returns")
                        kept_actor["advantages"] = (gae["keep_advantages"], "advantages")
                    else:  # the advantages need them here; the critic's update reads its own copy
                        values = critic.compute_values(_without(batch, {"scores"}), keep=keep, fetch=("values",))
                        batch.tensors["old_values"] = values.tensors["values"]
                    if keep is not None:
                        kept_critic["old_values"] = (keep, "values")
            with _timer(t, "advantages"):
                extra = {} if gae_here else self._advantages(batch)
                if teacher_log_probs:
                    extra.update(self._distill(batch, teacher_log_probs, rollout, trajectories))
            train_batch = self._filter_overlong(batch, trajectories, metrics)
            # the update reads neither the results kept on its ranks nor, unless this config asks, vLLM's log-probs
            unread = set(kept_actor) | (set() if self._update_reads_rollout() else {"rollout_log_probs"})
            actor_batch, critic_batch = _without(train_batch, unread), _without(train_batch, kept_critic)
            # score-based advantages (one number per sequence) go down as [B] and are expanded on the ranks
            actor_batch, per_sequence = _sequence_advantages(actor_batch)
            pending = None
            if critic is not None and critic is not self.workers:
                pending = critic.update_critic.submit(critic_batch, kept=kept_critic or None,  # overlaps the actor's
                                                      exchange_kept=bool(kept_critic) and stay["exchange_critic"])
            elif critic is not None:
                with _timer(t, "update_critic"):
                    metrics.update({f"critic/{k}": v for k, v in critic.update_critic(
                        critic_batch, kept=kept_critic or None,
                        exchange_kept=bool(kept_critic) and stay["exchange_critic"]).items()})
            # the actor's update exchanges its kept rows among DP peers when any of them was cut differently
            exchange = (("old_log_probs" in kept_actor or "ref_log_probs" in kept_actor) and stay["exchange_actor"]
                        or "advantages" in kept_actor and stay["exchange_advantages"])
            with _timer(t, "update_actor"):
                update = self.workers.update_actor.submit(actor_batch, kept=kept_actor or None,
                                                          per_sequence=per_sequence, exchange_kept=exchange,
                                                          top_k_kl_coef=self.top_k_kl_coef)
                # sync mode, colocated: the weight push submitted behind the update (collected below, after it)
                push = self.schedule.submit_after_update(step)
            if ref_pending is not None:  # time/ref_log_probs_s: its submission and the wait for its answer
                with _timer(t, "ref_log_probs"):
                    ref_pending.result()  # bounded as every role call: heartbeats and call_timeout_s
            with _timer(t, "update_actor"):
                for k, v in update.result().items():
                    metrics[f"mismatch/{k[len('mismatch_'):]}" if k.startswith("mismatch_") else f"actor/{k}"] = v
            if pending is not None:
                with _timer(t, "update_critic_wait"):
                    metrics.update({f"critic/{k}": v for k, v in pending.result().items()})
        # what of the step's batch crossed down: row pieces put (each once) and their tensor bytes; and the
        # token-sized tensors that crossed the controller, counted from what moved: generation's output up (token
        # ids, and vLLM's log-probs where the samples carry them), the batch's keys down, role results up
        generation = 1 + int("rollout_log_probs" in batch.tensors)
        down, up = len(shares.token_tensors_down), len(shares.token_results_up)
        metrics.update({"dispatch/batch_pieces_put": float(shares.puts), "dispatch/batch_put_bytes":
                        float(shares.put_bytes), "dispatch/batch_pieces_inline": float(shares.inline_pieces),
                        "dispatch/batch_inline_bytes": float(shares.inline_bytes_sent),
                        "dispatch/batch_pieces_by_reference": float(shares.by_reference_pieces),
                        "dispatch/token_rows_packed_pieces": float(shares.packed_pieces),
                        "dispatch/token_rows_packed_bytes": float(shares.packed_put_bytes),
                        "dispatch/token_tensors_down": float(down),
                        "dispatch/token_results_up": float(up),
                        "dispatch/token_crossings": float(generation + down + up)})
        self._count_skips(metrics)
        with _timer(t, "sync_weights"):
            reshard = push()
        lengths = batch.tensors["loss_mask"].float().sum(-1)  # sampled tokens per trajectory
        tokens = float(batch.tensors["attention_mask"].sum())
        step_time = time.perf_counter() - start
        metrics.update({
            "reward/mean": float(scores.mean()), "reward/max": float(scores.max()), "reward/min": float(scores.min()),
            "response_length/mean": float(lengths.mean()), "samples": float(len(trajectories)),
            "prompts_dropped": float(len(dropped)), "tokens": tokens, "tokens_per_s": tokens / step_time,
            "time/step_s": step_time, **{f"time/{k}_s": v for k, v in t.items()}, **extra,
        })
        if reshard:
            first = reshard[0] if isinstance(reshard, list) else reshard
            metrics.update({k: v for k, v in first.items() if k in RESHARD_METRICS or k.startswith(POOL_METRICS)})
        metrics.update(self.schedule.step_metrics(rollout, step))
        if self.schedule.mode != "sync":  # the share of the step the trainer computed (not waiting on rollouts)
            waited = t.get("rollout_wait", 0.0) + t.get("sync_weights", 0.0)
            metrics["async/train_busy_frac"] = max(0.0, 1.0 - waited / step_time)
        return StepResult(step, metrics)

    # --------------------------------------------------------------------------------------------- pieces
    def _share_calls(self) -> list[tuple[Any, str]]:
        """(group, method) of every role call `step` makes with the step's batch: where `BatchShares` cuts its
        pieces (each DP share of each call a whole number of them)."""
        calls = []
        if "reward_model" in self.role_groups:
            calls.append((self.role_groups["reward_model"], "score"))
        if not self.old_log_probs_from_update:
            calls.append((self.workers, "compute_log_probs"))
        if "reference" in self.role_groups:
            calls.append((self.role_groups["reference"], "compute_ref_log_probs"))
        if self.teachers:
            groups = {id(g): g for g in map(self._teacher_group, self.megatron_teachers)}  # one per hosting group
            calls += [(g, "compute_teacher_log_probs") for g in groups.values()]
        if "critic" in self.role_groups:
            calls += [(self.role_groups["critic"], "compute_values"), (self.role_groups["critic"], "update_critic")]
        calls.append((self.workers, "update_actor"))
        return calls

    def _engine_teacher(self, name: str):
        """The `EngineTeacher` of vLLM-served teacher `name` (the session started its engines)."""
        if name not in self.engine_teachers:
            raise RuntimeError(f"distillation.teachers.{name}: backend vllm, but this loop has no engines serving it "
                               f"(serving: {sorted(self.engine_teachers)}); the session starts them when the teacher "
                               "is enabled in its own config")
        return self.engine_teachers[name]

    def _teacher_group(self, name: str):
        """The group hosting distillation teacher `name`: its `TeacherWorker` group on a pool of its own
        (role_groups["teacher/<name>"]), else the actor pool's."""
        return self.role_groups.get(f"teacher/{name}", self.workers)

    def _update_reads_rollout(self) -> bool:
        """Whether the actor's update reads rollout_log_probs: by this config (`update_reads_rollout_log_probs`) or by
        the loss its ranks were built with (`actor_corrects_rollout`, asked once: a session reused for another run
        keeps its workers' loss settings)."""
        if self.update_reads_rollout_log_probs:
            return True
        if self._actor_corrects_rollout is None:
            self._actor_corrects_rollout = bool(self.workers.actor_corrects_rollout())
        return self._actor_corrects_rollout

    def _results_stay(self, rows: int) -> dict[str, bool]:
        """Which forward results of this step stay on the ranks that compute them and feed the update there instead
        of travelling controller -> rank: "old" (old log-probs: the controller still fetches them, for the mismatch
        metrics, unless kept; not with router replay, whose experts travel with them), "ref" (reference log-probs: the
        same pool with the same pipeline stages; not fetched unless KL is in the reward), "values" (the critic's:
        fetched for the advantages unless GAE runs on its ranks, `_gae_on_ranks`) and "advantages" (GAE's advantages,
        kept by the critic's forward for the actor's update: the critic on the actor's group with the actor's
        layout). A result stays where each rank's forward share holds the rows of its update share
        (`WorkerGroup.results_stay`: one DP replica, or one mini-batch cut as the forward was), or where the update
        is cut differently over the same DP ranks and the ranks exchange the rows among their DP peers
        (`WorkerGroup.results_exchange`: several mini-batches over several DP ranks) -- then "exchange_actor" /
        "exchange_critic" say that the actor's / critic's update must ask for that exchange (`exchange_kept=True`)."""
        a = self.cfg.actor.parallel
        ref = self.role_groups.get("reference")
        critic = self.role_groups.get("critic")
        same_as_actor = lambda p: (p.tp, p.pp, p.cp, p.ep) == (a.tp, a.pp, a.cp, a.ep)  # noqa: E731

        def reach(group, producer: str, consumer: str, exchangeable: bool = True) -> tuple[bool, bool]:
            """(stays, only by the DP peers' exchange)"""
            if group.results_stay(producer, consumer, rows):
                return True, False
            return (True, True) if exchangeable and group.results_exchange(producer, consumer, rows) else (False,
                                                                                                           False)

        no = (False, False)
        old = (reach(self.workers, "compute_log_probs", "update_actor")
               if not self.old_log_probs_from_update and self.cfg.algorithm.router_replay == "none" else no)
        ref_ = (reach(self.workers, "compute_ref_log_probs", "update_actor",
                      exchangeable=same_as_actor(self.cfg.reference.parallel))
                if ref is self.workers and not self.kl_in_reward and self.cfg.reference.parallel.pp == a.pp else no)
        values = reach(critic, "compute_values", "update_critic") if critic is not None else no
        adv = (reach(self.workers, "compute_values", "update_actor",
                     exchangeable=same_as_actor(self.cfg.critic.parallel))
               if critic is self.workers and values[0] else no)
        return {"old": old[0], "ref": ref_[0], "values": values[0], "advantages": adv[0],
                "exchange_actor": (old[1] and old[0]) or (ref_[1] and ref_[0]), "exchange_advantages": adv[1],
                "exchange_critic": values[1]}

    def _gae_on_ranks(self, stay: dict[str, bool]) -> bool:
        """Whether GAE runs on the critic's ranks (`RoleHost.compute_values(gae=)`: bit for bit the controller's),
        so that neither the values nor the advantages and returns cross the controller: GAE with the token rewards
        made of the scores alone (no KL in the reward: its log-probs are on other ranks; no distillation: it adds to
        the advantages here), the critic's values staying for its update and its advantages for the actor's
        (`_results_stay`)."""
        return (self.estimator == "gae" and stay["values"] and stay["advantages"] and not self.kl_in_reward
                and not self.teachers)

    def _filter_overlong(self, batch: Batch, trajectories, metrics: dict[str, float]) -> Batch:
        """The batch the updates train on: with `algorithm.overlong.filter`, truncated trajectories' (finish_reason
        'length') sampled tokens masked out of the loss (`overlong/filtered_samples`); else `batch` itself."""
        if not self.cfg.algorithm.overlong.filter:
            return batch
        truncated = torch.tensor([t.finish_reason == "length" for t in trajectories])
        metrics["overlong/filtered_samples"] = float(truncated.sum())
        return batch.update({"loss_mask": filter_truncated(batch.tensors["loss_mask"], truncated)})

    def _count_skips(self, metrics: dict[str, float]) -> None:
        """`<role>/skipped_streak`: optimizer steps skipped in a row (non-finite loss or gradient norm, see
        `MegatronEngine.step`), continued across RL steps from the roles' `skipped_steps` / `skipped_trailing`."""
        for role in ("actor", "critic"):
            if f"{role}/skipped_steps" not in metrics:
                continue
            trailing = int(metrics[f"{role}/skipped_trailing"])
            all_skipped = trailing == int(metrics[f"{role}/optimizer_steps"])
            self.skip_streak[role] = self.skip_streak.get(role, 0) + trailing if all_skipped else trailing
            metrics[f"{role}/skipped_streak"] = float(self.skip_streak[role])

    def _check_skips(self, result: StepResult) -> None:
        """Stop the run (`RunAborted`) once a role's skipped-step streak reaches `trainer.max_skipped_steps`."""
        limit = self.cfg.trainer.max_skipped_steps
        for role, streak in self.skip_streak.items():
            if streak >= limit:
                norm = result.metrics.get(f"{role}/grad_norm", float("nan"))
                raise RunAborted(
                    f"step {result.step}: {streak} {role} optimizer steps in a row were skipped for a non-finite loss "
                    f"or gradient norm (last grad_norm {norm}); stopping "
                    f"at trainer.max_skipped_steps={limit}. Check the rewards/advantages and lower the learning rate"
                )

    def _advantages(self, batch: Batch) -> dict[str, float]:
        """Fill `advantages` (and `returns` with a critic); returns KL metrics when KL is in the reward."""
        algo = self.cfg.algorithm
        tensors = batch.tensors
        mask = tensors["loss_mask"]
        metrics: dict[str, float] = {}
        estimator = get_advantage(self.estimator)
        if self.estimator in SCORE_ESTIMATORS:
            kwargs: dict[str, Any] = dict(scores=tensors["scores"], group_ids=tensors["group_ids"], response_mask=mask)
            if self.estimator == "grpo":
                kwargs["norm_by_std"] = algo.setting("grpo_norm_by_std")
            advantages, returns = estimator(**kwargs)
        else:
            token_rewards = scores_to_token_rewards(tensors["scores"], mask)
            if self.kl_in_reward:
                token_rewards, kl_metrics = apply_kl_penalty(
                    token_rewards, tensors["old_log_probs"], tensors["ref_log_probs"], mask, self.kl_ctl.value,
                    algo.kl.kind,
                )
                metrics.update({f"kl/{k}": float(v) for k, v in kl_metrics.items()})
                metrics["kl/coef"] = self.kl_ctl.value
                # the controller's quantity is the per-sequence KL; n_steps counts samples (kl.horizon's unit)
                self.kl_ctl.update(float(kl_metrics["kl_seq_sum"]), n_steps=int(mask.shape[0]))
            if self.estimator == "gae":
                advantages, returns = estimator(token_rewards, tensors["old_values"], mask, algo.gamma, algo.lam)
            else:
                advantages, returns = estimator(token_rewards, mask, algo.gamma)
        tensors["advantages"] = advantages
        tensors["returns"] = returns
        return metrics

    def _distill(self, batch: Batch, teacher_outputs: dict[str, Batch], rollout,
                 trajectories) -> dict[str, float]:
        """On-policy distillation: `advantages` becomes distillation.coef * (teacher log-prob - old log-prob) on
        each sampled token, from each row's teacher (by its prompt's data source when there are several), plus
        distillation.task_reward_coef * the estimator's advantage already there; with distillation.top_k, the batch
        also gets each row's teacher's top-k distribution (`teacher_top_k_ids` [B, S, k] int64,
        `teacher_top_k_log_probs` [B, S, k] float32) for the actor's top-k forward KL term. `teacher_outputs`: each
        teacher's `compute_teacher_log_probs` result over the whole batch. Returns `distill/reverse_kl/<teacher>`:
        the sampled-token reverse KL (student - teacher log-prob), mean over that teacher's rows' loss-mask tokens
        (nats per token)."""
        d = self.cfg.distillation
        tensors = batch.tensors
        mask, old = tensors["loss_mask"], tensors["old_log_probs"]
        if len(self.teachers) == 1:
            rows = {self.teachers[0]: torch.ones(mask.shape[0], dtype=torch.bool)}
        else:
            rows = rows_by_source(self._data_sources(rollout, trajectories),
                                  {n: d.teachers[n].data_source for n in self.teachers})
        teacher = torch.zeros_like(old)
        first = teacher_outputs[self.teachers[0]].tensors
        top_k = {k: torch.zeros_like(first[k]) for k in ("top_k_ids", "top_k_log_probs")} if d.top_k else {}
        metrics = {}
        for name, take in rows.items():
            out = teacher_outputs[name].tensors
            teacher[take] = out["log_probs"][take].to(old.dtype)
            for k, v in top_k.items():
                v[take] = out[k][take]
            metrics[f"distill/reverse_kl/{name}"] = reverse_kl_mean(out["log_probs"][take], old[take], mask[take])
        distill = reverse_kl_advantages(teacher, old, mask, d.coef)
        tensors["advantages"] = combine_advantages(distill, tensors["advantages"], d.task_reward_coef)
        for k, v in top_k.items():
            tensors[f"teacher_{k}"] = v
        return metrics

    def _data_sources(self, rollout, trajectories) -> list:
        """Each row's data source (the `distillation.data_source_key` column of its prompt's dataset record; None
        where the record has none), from the rollout's records: single-turn, each sample's prompt index (dynamic
        sampling renumbers both in training order); multi-turn, the episodes are record-major, samples_per_prompt
        per record (`megarl.envs.episode.EpisodeResult`)."""
        key = self.cfg.distillation.data_source_key
        records = rollout.records
        if rollout.trajectories is not None:
            n = self.cfg.rollout.samples_per_prompt
            if len(trajectories) != len(records) * n:
                raise RuntimeError(f"distillation: {len(trajectories)} episodes for {len(records)} records x "
                                   f"samples_per_prompt={n}: cannot route them to their teachers by data source")
            return [records[i // n].record.get(key) for i in range(len(trajectories))]
        if len(rollout.samples) != len(trajectories):
            raise RuntimeError(f"distillation: {len(trajectories)} rows for {len(rollout.samples)} samples: cannot "
                               "route them to their teachers by data source")
        return [records[s.prompt_index].record.get(key) for s in rollout.samples]

    def sample(self, prompts: list[list[int]], sampling: SamplingSettings):
        """(samples ordered by (prompt_index, sample_index), dropped prompt indices) of `prompts` through the engines'
        request servers (`BatchProducer.sample`), unscored: the Python API's `generate`. The caller holds
        `schedule.exclusive()` where the engines are shared (async)."""
        with self.rollout.serving() as client:
            return self.producer.sample(prompts, client, sampling)

    def validate(self) -> dict[str, float]:
        """Greedy (rollout.val_temperature) responses to the validation prompts (or one episode each, with
        rollout.env), through the engines' request servers; mean reward (`BatchProducer.validate`)."""
        with self.schedule.exclusive(), self.rollout.serving() as client:  # async: the engines are shared
            return self.producer.validate(self.val_records, client, self.rollout.weight_version or 0)

    def _log(self, result: StepResult) -> None:
        m = result.metrics
        if self.progress is not None:
            self.progress.update(result.step, m)
        if self.metrics_path:
            os.makedirs(os.path.dirname(os.path.abspath(self.metrics_path)), exist_ok=True)
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps({"step": result.step, **m}) + "\n")
        for sink in self.sinks:
            sink.log(result.step, m)


def set_aside_earlier_metrics(path: str) -> Optional[str]:
    """Rename a non-empty `path` (an earlier run's metrics.jsonl in the same logging.dir) to the first free
    `<stem>.<n>.jsonl` (n = 1, 2, ...) and return the new path; None when there is nothing to move. A fresh run then
    starts its own file instead of appending to another run's steps (a resumed run appends: `plots.load_rows` keeps
    a step's last row); nothing is deleted."""
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return None
    stem, ext = os.path.splitext(path)
    n = 1
    while os.path.exists(f"{stem}.{n}{ext}"):
        n += 1
    os.replace(path, f"{stem}.{n}{ext}")
    return f"{stem}.{n}{ext}"


def old_log_probs_from_update(cfg: JobConfig) -> bool:
    """Whether the actor's update takes the old-policy log-probs from its own forward (`algorithm.old_log_probs`).

    Exact only while the step is a single optimizer step (one mini-batch, one epoch): the update's forward then runs
    on the weights a separate pass would have used, so its detached log-probs are the old policy's. Not taken when
    something needs them before the update: KL in the reward (advantages), rollout correction (its weights and
    masks are computed from them), router replay (`old` records the routing there, `rollout` replays vLLM's),
    distillation (its advantages are formed from them)."""
    algo = cfg.algorithm
    if algo.old_log_probs == "recompute" or algo.ppo_epochs != 1 or algo.router_replay != "none":
        return False
    if cfg.distillation.enabled:  # the distillation advantage is formed from them before the update
        return False
    mini = cfg.actor.mini_batch_prompts
    if mini is not None and mini < cfg.data.prompts_per_step:
        return False
    kl_in_reward = cfg.reference.enabled and algo.kl.placement == "reward" and algo.kl.coef > 0
    rc = algo.rollout_correction
    return not kl_in_reward and rc.tis == "off" and rc.mask == "off"


def update_reads_rollout_log_probs(cfg: JobConfig) -> bool:
    """Whether the actor's update reads vLLM's log-probs (`rollout_log_probs`): with a rollout correction
    (algorithm.rollout_correction tis or mask: its weights and masks), or when it takes the old log-probs from its own
    forward (`old_log_probs_from_update`: it measures the mismatch there). Else the old log-prob forward measured the
    mismatch and the update is sent none."""
    rc = cfg.algorithm.rollout_correction
    return old_log_probs_from_update(cfg) or rc.tis != "off" or rc.mask != "off"


def _versions(batch: Batch) -> list[int]:
    """The weights versions the batch's sampled tokens (`loss_mask`) were generated with, ascending."""
    t = batch.tensors
    return [int(v) for v in t["policy_version"][t["loss_mask"].bool()].unique().tolist()]


def mismatch_from_forward(rows: dict[str, torch.Tensor], trained_version: int, versions=()) -> dict[str, float]:
    """`mismatch/*`: vLLM's log-probs of the sampled tokens (`rollout_log_probs`) against the actor's old-policy
    log-probs recomputed by Megatron before the update, over the sampled tokens, from the [B] rows the old log-prob
    forward computed on the actor's ranks (`megarl.algorithms.rollout_correction.mismatch_rows`; its band is
    algorithm.rollout_correction.c). With `versions` (a batch mixing policy versions: asynchronous modes), also
    `mismatch/lag<d>/*` over the tokens sampled d versions before `trained_version` (the weights the old log-probs
    come from)."""
    out = {f"mismatch/{k}": float(v) for k, v in mismatch_from_rows(rows).items()}
    for v in versions:
        lag = mismatch_from_rows(rows, prefix=f"v{int(v)}/")
        out.update({f"mismatch/lag{trained_version - int(v)}/{k}": float(x) for k, x in lag.items()})
    return out


def _sequence_advantages(batch: Batch) -> tuple[Batch, Optional[str]]:
    """The actor's update batch with its advantages [B, S] as sequence_advantages [B] when they are one number per
    sequence over the batch's loss mask, exactly (`per_sequence_advantages`: GRPO, RLOO, REINFORCE++ with a
    baseline; the expansion on the ranks is bit-identical to the tensor computed here), and that expansion; else
    `batch` itself and None (GAE, REINFORCE++, an SFT batch without advantages, or a loss mask changed after the
    advantages were computed, e.g. the overlong filter's)."""
    t = batch.tensors
    mask = t.get("loss_mask", t.get("response_mask"))
    if "advantages" not in t or mask is None:
        return batch, None
    found = per_sequence_advantages(t["advantages"], mask)
    if found is None:
        return batch, None
    values, expansion = found
    tensors = {k: v for k, v in t.items() if k != "advantages"}
    tensors["sequence_advantages"] = values
    return Batch(tensors, dict(batch.meta)), expansion


def _without(batch: Batch, keys) -> Batch:
    """`batch` without `keys` (the results its update reads where they were kept); itself when there are none."""
    if not keys:
        return batch
    return Batch({k: v for k, v in batch.tensors.items() if k not in keys}, dict(batch.meta))


class _timer:
    def __init__(self, into: dict[str, float], name: str) -> None:
        self.into, self.name = into, name

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.into[self.name] = self.into.get(self.name, 0.0) + time.perf_counter() - self.start
        return False
