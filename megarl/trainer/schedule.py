"""When rollouts run against training: the schedules of `trainer.mode` behind one interface (docs/async.md).

The trainer's step body (advantages, updates) is written once (`RLLoop.step`); every batch comes from one
`megarl.trainer.producer.BatchProducer` (draw -> requests -> scores -> filters), and a schedule only decides when it
is produced, on which weights, and when the actor's weights go into the engines:

    batch = schedule.take(step, timers)      # the rollout batch step `step` trains on
    ... old / reference log-probs, advantages, updates (weights version step - 1 -> step) ...
    reshard = schedule.after_update(step)    # the weight push (or nothing), its metrics (`RLLoop.step` uses
                                             # `submit_after_update`: sync mode submits the push behind the update)
    metrics |= schedule.step_metrics(batch, step)

- `Schedule` (sync): generate step k's batch with the weights of version k - 1, train, push version k. Today's
  loop, call for call (the golden curve holds).
- `OneStepOffSchedule`: step k+1's batch is produced on a background thread through the engines' request servers
  (`rollout.serving()`, the engines still holding version k - 1) while step k trains; after update k the trainer
  joins it, then pushes version k. Every batch but the first is one version stale; deterministic for a seed (the
  generation of batch k+1 always sees version k - 1), and the finished next batch is part of a checkpoint, so a
  resumed run repeats the uninterrupted one exactly. On a rollout pool generation overlaps the whole training step;
  colocated, the engine's server runs in the actor's processes beside the training calls (its engine awake).
- `AsyncSchedule` (needs rollout.pool): the rollout pool serves requests for the whole run (its engines' request
  servers, started by `start` and stopped by `close`; `PoolRollout.start_serving`) and a driver thread on the
  controller produces batch after batch through the router (`PoolRollout.client`, `BatchProducer.produce`: single-turn
  one request per prompt; multi-turn one coroutine per episode) into a bounded buffer; the trainer takes the oldest
  batch whose oldest token is at most `trainer.max_staleness` versions behind the weights it updates (per sample).
  `stale_policy: wait` keeps the driver from starting a batch that would be too stale when trained (so nothing is
  wasted); `drop` lets it run ahead and drops (counts) what became too stale. Weights are pushed every
  `trainer.sync_every` updates, as a server op at a round boundary of every rollout rank (pause(keep) -> receive ->
  resume).
  `rollout.partial`: `finish` = a push waits for the batch in flight (it completes on the old weights);
  `continue` = a push lands at once, mid-request: every request in flight keeps the tokens it has and continues on
  the new weights (vLLM recomputes its KV), every token recording the version that sampled it (`Completion.
  versions` -> `RolloutBatch.token_versions`); a request in a tool call is not in the engines and its next turn is
  simply sampled by the new weights. Requests that crossed a push are counted (`async/continued_requests`).

The trainer's own use of the engines (a push, a validation) goes through `exclusive()`: with `finish` it waits for
the batch in flight and the driver starts nothing until the trainer is done; with `continue` nothing waits (the
servers order a push against the requests themselves). Every wait is bounded (`wait_timeout_s`) and names what it
waited for; an error on the driver thread is raised in the trainer's next call.

Checkpoints: `pause()` holds the driver between batches (the batch in flight is finished first, so nothing is in
flight at a save); a schedule's `state_dict()` (plain data: the finished batches not yet trained on, as
`RolloutBatch.state_dict`s, and its counters) is one of the states `megarl.trainer.checkpoint_manager` saves, and
`load_state_dict` puts the batches back on resume and counts them (`async/restored_batches`).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Optional

import torch

logger = logging.getLogger("megarl.trainer")

# Bound on every wait of a schedule (a batch, the engines' turn, the driver's pause), seconds.
WAIT_TIMEOUT_S = 1800.0


@dataclasses.dataclass
class RolloutBatch:
    """One step's rollouts, scored (what `RLLoop.step` trains on).

    index: the batch's number (1-based; the step it was drawn for, or the driver's count in async mode); its
        sampling seed is rollout.seed + index.
    records: the prompts' dataset records (prompts_per_step; with dynamic sampling the selected groups', in
        training order: records[s.prompt_index] is sample s's); samples: `RolloutSample`s ordered by (prompt_index,
        sample_index); dropped: prompt indices the prompt-length policy dropped; scores: [len(samples)] float32 rule
        scores; reward_metrics: `reward/errors|timeouts|error_frac`.
    version: the weights version that sampled it (the oldest, for a partial rollout).
    token_versions: None (every response token has `version`), or per sample the version of each response token.
    trajectories: with rollout.env, the episodes' `Trajectory`s (`samples` is then empty; `lags` read their
        per-token versions).
    metrics: the batch's own metrics (dynamic sampling's counts; single-turn `time/reward_overlap_s`, the scoring
        seconds that ran while requests were generating; with rollout.oversample `rollout/oversampled_aborted_groups`).
        rollout_s / reward_s: seconds generating (the engines' wall time) and scoring (summed over groups).
    """

    index: int
    records: list
    samples: list
    dropped: list
    scores: torch.Tensor
    reward_metrics: dict
    version: int
    token_versions: Optional[list] = None
    metrics: dict = dataclasses.field(default_factory=dict)
    rollout_s: float = 0.0
    reward_s: float = 0.0
    trajectories: Optional[list] = None  # multi-turn episodes (rollout.env): the trajectories themselves

    def state_dict(self) -> dict:
        """The batch as plain data (dicts, lists, str, numbers, None, tensors) for `torch.save`: what
        `torch.load(weights_only=True)` reads back, so a checkpoint never executes code. Routing records (numpy or
        torch) travel as tensors."""
        return {"index": int(self.index),
                "records": [{"prompt_record": dataclasses.asdict(r)} if dataclasses.is_dataclass(r) else {"plain": r}
                            for r in self.records],
                "samples": [{**{f.name: getattr(x, f.name) for f in dataclasses.fields(x)},
                             "routed_experts": _experts_state(x.routed_experts)} for x in self.samples],
                "dropped": [int(i) for i in self.dropped], "scores": self.scores,
                "reward_metrics": _plain_numbers(self.reward_metrics), "version": int(self.version),
                "token_versions": self.token_versions, "metrics": _plain_numbers(self.metrics),
                "rollout_s": float(self.rollout_s), "reward_s": float(self.reward_s),
                "trajectories": None if self.trajectories is None else [
                    {**{f.name: getattr(t, f.name) for f in dataclasses.fields(t)},
                     "routed_experts": _experts_state(t.routed_experts)} for t in self.trajectories]}

    @classmethod
    def from_state_dict(cls, state: dict) -> "RolloutBatch":
        """Inverse of `state_dict`."""
        from megarl.data.dataset import PromptRecord
        from megarl.data.trajectory import Trajectory
        from megarl.rollout.engine import RolloutSample

        trajectories = state["trajectories"]
        return cls(index=state["index"], records=[PromptRecord(**r["prompt_record"]) if "prompt_record" in r
                                                  else r["plain"] for r in state["records"]],
                   samples=[RolloutSample(**{**x, "routed_experts": _experts_from_state(x["routed_experts"])})
                            for x in state["samples"]],
                   dropped=list(state["dropped"]), scores=state["scores"], reward_metrics=state["reward_metrics"],
                   version=state["version"], token_versions=state["token_versions"], metrics=state["metrics"],
                   rollout_s=state["rollout_s"], reward_s=state["reward_s"],
                   trajectories=None if trajectories is None else [
                       Trajectory(**{**t, "routed_experts": _experts_from_state(t["routed_experts"])})
                       for t in trajectories])

    @property
    def num_samples(self) -> int:
        """The batch's samples: its responses, or with rollout.env its episodes (`samples` is then empty)."""
        return len(self.trajectories) if self.trajectories is not None else len(self.samples)

    def lags(self, trained_version: int) -> list[int]:
        """Per sample: how many versions its oldest token lags `trained_version` (the weights the update starts
        from)."""
        if self.trajectories is not None:
            return [trained_version - min((v for v in t.policy_version if v >= 0), default=self.version)
                    for t in self.trajectories]
        if self.token_versions is None:
            return [trained_version - self.version] * len(self.samples)
        return [trained_version - (min(v) if v else self.version) for v in self.token_versions]

    def token_lags(self, trained_version: int) -> dict[int, int]:
        """{lag: number of response tokens sampled that many versions before `trained_version`}."""
        out: collections.Counter = collections.Counter()
        if self.trajectories is not None:
            for t in self.trajectories:
                out.update(trained_version - v for v in t.policy_version if v >= 0)
            return dict(out)
        for i, s in enumerate(self.samples):
            if self.token_versions is None:
                out[trained_version - self.version] += len(s.response_ids)
            else:
                out.update(trained_version - v for v in self.token_versions[i])
        return dict(out)


def _plain_numbers(metrics: dict) -> dict:
    """A metrics dict with numpy scalars as Python numbers (numpy objects do not load with weights_only=True)."""
    return {k: v.item() if hasattr(v, "item") and not isinstance(v, torch.Tensor) else v for k, v in metrics.items()}


def _experts_state(experts: Any) -> Optional[dict]:
    """A routing record (None, numpy or torch array) as {"kind": "numpy" | "torch", "tensor": ...}."""
    if experts is None:
        return None
    if isinstance(experts, torch.Tensor):
        return {"kind": "torch", "tensor": experts}
    return {"kind": "numpy", "tensor": torch.from_numpy(experts)}


def _experts_from_state(state: Optional[dict]) -> Any:
    if state is None:
        return None
    return state["tensor"] if state["kind"] == "torch" else state["tensor"].numpy()


def wait_for(cond: threading.Condition, ready, what: str, timeout_s: float) -> None:
    """Wait on `cond` (held by the caller) until `ready()`; raise TimeoutError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"waited {timeout_s:.0f} s for {what}; the rollout schedule is stuck (see the worker "
                               "logs for a dead or hung engine)")
        cond.wait(min(left, 1.0))


class Schedule:
    """trainer.mode=sync: generate, train, push (see the module docstring). Also the base of the other schedules.

    `cfg`: the job's config; `rollout`: the rollout service (`megarl.rollout.service`: its `serving()` client, its
    pushes); `producer`: the `megarl.trainer.producer.BatchProducer` every batch comes from (`produce(index, client,
    version)`: draw -> requests -> scores -> filters)."""

    mode = "sync"

    def __init__(self, cfg: Any, rollout: Any, producer: Any, wait_timeout_s: float = WAIT_TIMEOUT_S) -> None:
        self.cfg = cfg
        self.rollout = rollout
        self.producer = producer
        self.wait_timeout_s = wait_timeout_s

    # the interface -------------------------------------------------------------------------------------------
    def start(self, next_step: int) -> None:
        """Called once after the initial push (engines at version next_step - 1)."""

    def take(self, step: int, t: dict[str, float]) -> RolloutBatch:
        """The batch step `step` trains on; `t` collects the step's phase seconds (`time/<phase>_s`): generated now
        through the engines' request servers with the weights of version step - 1, each group scored as it finishes
        (dynamic sampling's extra rounds, or multi-turn episodes, included)."""
        started, reward_before = time.perf_counter(), t.get("reward", 0.0)
        with self.rollout.serving() as client:
            batch = self.producer.produce(step, client, step - 1, t)
        # the rollout phase: all but the scoring left after the last request (the servers' start and stop included;
        # colocated, the controller only submits them: `ColocatedRollout.overlap_phase_ends`)
        t["rollout"] = time.perf_counter() - started - (t.get("reward", 0.0) - reward_before)
        return batch

    def after_update(self, step: int) -> list[dict[str, float]]:
        """After update `step` (weights now version `step`): push them (or not); the push's metrics (or [])."""
        return self.rollout.push_weights(version=step)

    def submit_after_update(self, step: int) -> Callable[[], list[dict[str, float]]]:
        """`after_update(step)` submitted right behind update `step`, before its answer is collected: returns the
        function that waits for the push and gives its metrics. Sync mode with a rollout service that can submit its
        push (`ColocatedRollout.submit_push`: the same workers run the push after the update, Ray's order of one
        caller's calls) saves the controller's round trip between the two; otherwise the push starts when the
        function is called (the other schedules: their push waits on the batch generated meanwhile)."""
        submit = getattr(self.rollout, "submit_push", None)
        if submit is None or type(self).after_update is not Schedule.after_update:
            return lambda: self.after_update(step)
        return submit(version=step)

    def step_metrics(self, batch: RolloutBatch, step: int) -> dict[str, float]:
        """Metrics of the schedule for the step (sync: none, the step's metrics stay exactly today's)."""
        return {}

    @contextlib.contextmanager
    def exclusive(self):
        """The engines for the trainer alone (nothing else generates in sync mode)."""
        yield

    @contextlib.contextmanager
    def pause(self):
        """Nothing in flight while a checkpoint is written (always true in sync mode)."""
        yield

    def state_dict(self) -> dict:
        """The schedule's state as plain data: {"mode", "batches": finished batches not yet trained on (as
        `RolloutBatch.state_dict`s; none in sync mode), ...counters}. Taken inside `pause()`."""
        return {"mode": self.mode, "batches": []}

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()` (before `start`). Sync mode trains nothing ahead: batches saved by another
        mode (a resume with `checkpoint.allow_config_change`) are generated again."""
        if state.get("batches"):
            logger.warning("trainer.mode=sync: the checkpoint's %d finished rollout batch(es) of trainer.mode=%s are "
                           "not used (generated again)", len(state["batches"]), state.get("mode"))

    def close(self) -> None:
        """Stop what runs beside training (idempotent)."""

    # shared pieces -------------------------------------------------------------------------------------------
    def _staleness_metrics(self, batch: RolloutBatch, step: int) -> dict[str, float]:
        """`async/staleness_mean|max` (versions, per sample: its oldest token), `async/lag_frac/<d>` (fraction of
        response tokens sampled d versions before the weights updated at `step`), `async/version` and
        `async/batch_index` (the batch's)."""
        lags = batch.lags(step - 1)
        tokens = batch.token_lags(step - 1)
        total = sum(tokens.values()) or 1
        out = {"async/staleness_mean": sum(lags) / max(len(lags), 1),
               "async/staleness_max": float(max(lags, default=0)),
               "async/version": float(batch.version), "async/batch_index": float(batch.index),
               "async/rollout_s": batch.rollout_s}
        out.update({f"async/lag_frac/{d}": n / total for d, n in sorted(tokens.items())})
        return out

    @staticmethod
    def _batches(state: dict) -> list[RolloutBatch]:
        """The `RolloutBatch`es of a `state_dict()`."""
        return [RolloutBatch.from_state_dict(b) for b in state.get("batches", [])]


class OneStepOffSchedule(Schedule):
    """trainer.mode=one_step_off (see the module docstring): the next step's batch is produced on a background
    thread (`producing`) through the engines' request servers (`rollout.serving()`) while this step trains, and
    joined before the push."""

    mode = "one_step_off"

    def __init__(self, cfg: Any, rollout: Any, producer: Any, wait_timeout_s: float = WAIT_TIMEOUT_S) -> None:
        super().__init__(cfg, rollout, producer, wait_timeout_s)
        self.producing: Optional[tuple] = None  # (index, thread, {"batch" | "error": ...}) in flight
        self.ready: Optional[RolloutBatch] = None  # the next batch, finished (after the update, or restored)
        self.restored = 0

    def take(self, step: int, t: dict[str, float]) -> RolloutBatch:
        started = time.perf_counter()
        if self.ready is not None and self.ready.index == step:
            batch, self.ready = self.ready, None
        elif self.producing is not None and self.producing[0] == step:
            batch = self._finish()
        else:  # the first step (or after a resume without a saved batch): nothing was generated ahead
            self._start(step)
            batch = self._finish()
        t["rollout_wait"] = time.perf_counter() - started
        if step < self.cfg.trainer.total_steps:  # the next step's batch, on the weights this step trains
            self._start(step + 1)
        return batch

    def after_update(self, step: int) -> list[dict[str, float]]:
        if self.producing is not None:  # it must finish on version step - 1 before version `step` goes in
            self.ready = self._finish()
        return self.rollout.push_weights(version=step)

    def step_metrics(self, batch: RolloutBatch, step: int) -> dict[str, float]:
        """The staleness figures, and `async/rollout_busy_frac`: the engines' seconds on the batch generated
        during this step (the next one) over the step's wall time."""
        now = time.perf_counter()
        wall, self.mark = max(now - self.mark, 1e-9), now
        busy = self.ready.rollout_s if self.ready is not None else 0.0
        return {**self._staleness_metrics(batch, step), "async/restored_batches": float(self.restored),
                "async/rollout_busy_frac": min(busy / wall, 1.0)}

    def start(self, next_step: int) -> None:
        self.mark = time.perf_counter()

    def state_dict(self) -> dict:
        """{"mode", "batches": [the next step's finished batch] (or none)}."""
        return {"mode": self.mode, "batches": [self.ready.state_dict()] if self.ready is not None else []}

    def load_state_dict(self, state: dict) -> None:
        batches = self._batches(state)
        if batches:
            self.ready = batches[0]
            self.restored = len(batches)
            logger.info("one_step_off: restored the next step's finished batch (index %d, version %d)",
                        self.ready.index, self.ready.version)

    def close(self) -> None:
        """Wait (bounded) for a batch still being produced (its serving phase ends with it)."""
        if self.producing is not None:
            _, thread, _ = self.producing
            thread.join(self.wait_timeout_s)
            if thread.is_alive():
                logger.warning("one_step_off: the thread producing the next batch did not end within %.0f s",
                               self.wait_timeout_s)
            self.producing = None

    def _start(self, index: int) -> None:
        """Produce batch `index` on a thread of its own, on the weights the engines hold now."""
        version = self.rollout.weight_version or 0
        result: dict[str, Any] = {}

        def produce() -> None:
            try:
                with self.rollout.serving() as client:
                    result["batch"] = self.producer.produce(index, client, version)
            except BaseException as e:  # raised in the trainer's next take / after_update
                result["error"] = e

        thread = threading.Thread(target=produce, name=f"megarl-one-step-off-{index}", daemon=True)
        self.producing = (index, thread, result)
        thread.start()

    def _finish(self) -> RolloutBatch:
        index, thread, result = self.producing
        self.producing = None
        thread.join(self.wait_timeout_s)
        if thread.is_alive():
            raise TimeoutError(f"waited {self.wait_timeout_s:.0f} s for rollout batch {index} (one_step_off: the "
                               "next step's batch); the rollout schedule is stuck (see the worker logs for a dead or "
                               "hung engine)")
        if "error" in result:
            raise RuntimeError(f"one_step_off: producing rollout batch {index} failed: {result['error']!r}") \
                from result["error"]
        return result["batch"]


class AsyncSchedule(Schedule):
    """trainer.mode=async (see the module docstring). State shared with the driver thread is guarded by `cond`:
    `buffer` (finished batches, oldest first), `engine_version`, `push_wanted` / `engine_busy` (turns on the
    engines: with partial=finish the driver holds them for a batch, a push or a validation for its call), `paused`,
    `error` (the driver's exception, raised in the trainer). `client`: the rollout pool's router while serving."""

    mode = "async"

    def __init__(self, cfg: Any, rollout: Any, producer: Any, wait_timeout_s: float = WAIT_TIMEOUT_S) -> None:
        super().__init__(cfg, rollout, producer, wait_timeout_s)
        self.max_staleness = cfg.trainer.max_staleness
        self.stale_policy = cfg.trainer.stale_policy
        self.sync_every = cfg.trainer.sync_every
        self.partial = cfg.rollout.partial
        self.client = None  # the RolloutClient of the serving engines (start .. close)
        self.capacity = self.max_staleness + 1  # batches; also the most 'wait' lets the driver run ahead
        self.cond = threading.Condition()
        self.buffer: collections.deque = collections.deque()
        self.next_index = 1  # the driver's next batch
        self.trained_upto = 0  # updates done by the trainer (the weights it holds: version trained_upto)
        self.engine_version = 0
        self.push_wanted = False
        self.engine_busy = False
        self.in_batch = False  # the driver is between drawing a batch and buffering it
        self.paused = False
        self.stopping = False
        self.error: Optional[BaseException] = None
        self.thread: Optional[threading.Thread] = None
        self.counts = collections.Counter()  # dropped_batches/samples, restored_batches, continued_requests
        self.busy_s = 0.0  # the engines' generating seconds since the last step's metrics
        self.mark = time.perf_counter()

    # trainer side ---------------------------------------------------------------------------------------------
    def start(self, next_step: int) -> None:
        """Start serving on the rollout pool (`start_serving`: its servers stay up until `close`) and the driver."""
        if not hasattr(self.rollout, "start_serving"):
            raise RuntimeError("trainer.mode=async needs engines that serve requests (a rollout pool: set "
                               f"rollout.pool); {type(self.rollout).__name__} does not")
        with self.cond:
            self.trained_upto = next_step - 1
            self.engine_version = self.rollout.weight_version or 0
            if self.next_index < next_step:
                self.next_index = next_step
        self.client = self.rollout.start_serving()
        self.thread = threading.Thread(target=self._drive, name="megarl-rollout-driver", daemon=True)
        self.thread.start()
        self.mark = time.perf_counter()

    def take(self, step: int, t: dict[str, float]) -> RolloutBatch:
        """The oldest buffered batch within `max_staleness` of version step - 1; older ones are dropped (counted).
        One bound (`wait_timeout_s`) covers the whole call, the batches dropped on the way included: a driver
        that only ever produces too-stale batches raises TimeoutError naming them instead of looping for ever."""
        started = time.perf_counter()
        deadline = time.monotonic() + self.wait_timeout_s
        trained = step - 1  # the version the update starts from
        dropped: list[int] = []  # indices of the batches this call dropped as too stale
        with self.cond:
            while True:
                wanted = f"a rollout batch for step {step}"
                if dropped:
                    wanted += (f" at most {self.max_staleness} version(s) behind version {trained} (dropped "
                               f"{len(dropped)} too-stale batch(es) {dropped} on the way; the engines hold version "
                               f"{self.engine_version})")
                left = deadline - time.monotonic()
                if dropped and left <= 0:
                    raise TimeoutError(f"waited {self.wait_timeout_s:.0f} s for {wanted}; the rollout driver "
                                       "produces only batches too stale to train (are the weight pushes landing?)")
                wait_for(self.cond, lambda: self.buffer or self.error is not None,
                         wanted + ("" if dropped else " (buffer empty)"), max(left, 0.0))
                self._raise()
                batch = self.buffer.popleft()
                self.cond.notify_all()
                if max(batch.lags(trained)) <= self.max_staleness:
                    break
                dropped.append(batch.index)
                self.counts["dropped_batches"] += 1
                self.counts["dropped_samples"] += batch.num_samples
                logger.info("step %d: dropped rollout batch %d (version %d, oldest token %d versions behind; "
                            "trainer.max_staleness=%d)", step, batch.index, batch.version, max(batch.lags(trained)),
                            self.max_staleness)
            self.buffered_at_take = len(self.buffer)
        t["rollout_wait"] = time.perf_counter() - started
        return batch

    def after_update(self, step: int) -> list[dict[str, float]]:
        with self.cond:
            self.trained_upto = step
            self.cond.notify_all()
        if step % self.sync_every:
            return []
        with self.exclusive():
            out = self.rollout.push_weights(version=step)
            with self.cond:
                self.engine_version = step
                self.counts["continued_requests"] += int(out[0].get("reshard/pool/continued_requests", 0)) if out else 0
                self.cond.notify_all()
        return out

    def step_metrics(self, batch: RolloutBatch, step: int) -> dict[str, float]:
        now = time.perf_counter()
        with self.cond:
            busy, self.busy_s = self.busy_s, 0.0
            counts = dict(self.counts)
            version = self.engine_version
        wall = max(now - self.mark, 1e-9)
        self.mark = now
        out = self._staleness_metrics(batch, step)
        out.update({"async/buffer_batches": float(getattr(self, "buffered_at_take", 0)),
                    "async/engine_version": float(version), "async/rollout_busy_frac": min(busy / wall, 1.0)})
        for key in ("dropped_batches", "dropped_samples", "restored_batches", "continued_requests"):
            out[f"async/{key}"] = float(counts.get(key, 0))
        return out

    @contextlib.contextmanager
    def exclusive(self):
        """The engines for the trainer (a push, a validation). partial=finish: waits for the batch in flight, and the
        driver starts nothing until the trainer is done; continue: only one such caller at a time (the driver's
        requests stay in flight: the servers apply a push between two of their rounds)."""
        with self.cond:
            self.push_wanted = True
            try:
                wait_for(self.cond, lambda: not self.engine_busy or self.error is not None,
                         "the engines to finish the rollout in flight", self.wait_timeout_s)
                self._raise()
            except BaseException:
                self.push_wanted = False
                raise
            self.engine_busy = True
        try:
            yield
        finally:
            with self.cond:
                self.engine_busy = False
                self.push_wanted = False
                self.cond.notify_all()

    @contextlib.contextmanager
    def pause(self):
        """Hold the driver between batches (the one in flight finishes and is buffered first)."""
        with self.cond:
            self.paused = True
            self.cond.notify_all()
            try:
                wait_for(self.cond, lambda: not self.in_batch or self.error is not None,
                         "the rollout in flight to finish before the checkpoint", self.wait_timeout_s)
                self._raise()
            except BaseException:  # no checkpoint: the driver goes on
                self.paused = False
                self.cond.notify_all()
                raise
        try:
            yield
        finally:
            with self.cond:
                self.paused = False
                self.cond.notify_all()

    def state_dict(self) -> dict:
        """{"mode", "batches": the buffered finished batches (oldest first), "next_index": the driver's next batch,
        "counts": dropped / restored / continued counters}. Taken inside `pause()` (nothing in flight)."""
        with self.cond:
            return {"mode": self.mode, "batches": [b.state_dict() for b in self.buffer],
                    "next_index": int(self.next_index), "counts": {k: int(v) for k, v in self.counts.items()}}

    def load_state_dict(self, state: dict) -> None:
        batches = self._batches(state)
        with self.cond:
            self.buffer.extend(batches)
            self.next_index = int(state.get("next_index", self.next_index))
            self.counts.update({k: v for k, v in state.get("counts", {}).items() if k != "restored_batches"})
            self.counts["restored_batches"] += len(batches)
        logger.info("async: restored %d finished rollout batch(es) (indices %s); the driver continues at batch %d",
                    len(batches), [b.index for b in batches], self.next_index)

    def close(self) -> None:
        """Stop the driver and the servers (a batch in flight is aborted: its requests fail and the driver ends)."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        try:
            if self.client is not None:
                self.client = None
                self.rollout.stop_serving()
        finally:
            self._join()

    def _join(self) -> None:
        if self.thread is not None:
            self.thread.join(timeout=self.wait_timeout_s)
            if self.thread.is_alive():
                logger.warning("the rollout driver thread did not stop within %.0f s", self.wait_timeout_s)
            self.thread = None

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"the rollout driver thread failed: {self.error!r}") from self.error

    # driver side ----------------------------------------------------------------------------------------------
    def _may_start(self, index: int) -> bool:
        """Whether batch `index` may start now: not paused, no push waiting, buffer not full and, with 'wait', the
        batch (trained at step `index` at the earliest, on version index - 1) would be within the bound."""
        if self.paused or self.push_wanted or self.engine_busy:
            return False
        if len(self.buffer) >= self.capacity:
            return False
        if self.stale_policy == "wait" and (index - 1) - self.engine_version > self.max_staleness:
            return False
        return True

    def _turn(self, ready) -> bool:
        """Wait (holding `cond`) for the engines' turn under `ready`; False when stopping. partial=finish: the
        driver then holds the engines (`engine_busy`) until its batch is generated."""
        while not self.stopping and not ready():
            self.cond.wait(1.0)
        if self.stopping:
            return False
        self.engine_busy = self.partial == "finish"
        return True

    def _drive(self) -> None:
        try:
            while True:
                with self.cond:
                    index = self.next_index
                    if not self._turn(lambda i=index: self._may_start(i)):
                        return
                    self.next_index += 1
                    self.in_batch = True
                started = time.perf_counter()
                try:  # single-turn one request per prompt, multi-turn one coroutine per episode, through the router
                    batch = self.producer.produce(index, self.client, lambda: self.engine_version)
                finally:
                    with self.cond:
                        self.busy_s += time.perf_counter() - started
                        self.engine_busy = False
                        self.cond.notify_all()
                with self.cond:
                    self.buffer.append(batch)
                    self.in_batch = False
                    self.cond.notify_all()
        except BaseException as e:  # raised in the trainer's next take / push
            with self.cond:
                if self.stopping:  # closed with a batch in flight: its requests were aborted, nothing waits for it
                    self.engine_busy = self.in_batch = False
                    self.cond.notify_all()
                    return
            logger.exception("the rollout driver thread failed")
            with self.cond:
                self.error = e
                self.engine_busy = self.in_batch = False
                self.cond.notify_all()


SCHEDULES = {"sync": Schedule, "one_step_off": OneStepOffSchedule, "async": AsyncSchedule}


def describe_schedule(cfg: Any) -> str:
    """What `trainer.mode` and its options do for this config, for `megarl train --dry-run`."""
    t, r = cfg.trainer, cfg.rollout
    if t.mode == "sync":
        return "sync: each step generates its batch with the weights of the previous update (on-policy)"
    where = f"on rollout pool {r.pool!r}" if r.pool else "in the actor's processes (colocated)"
    rc = cfg.algorithm.rollout_correction
    correction = f"off-policy correction: tis={rc.tis}, mask={rc.mask} (c={rc.c})"
    if t.mode == "one_step_off":
        return (f"one_step_off: step k+1's batch is generated {where} on the weights before update k while step k "
                f"trains (staleness 1); {correction}")
    partial = ("rollout.partial=continue: a push lands mid-request (the requests in flight keep their tokens)"
               if r.partial == "continue" else "rollout.partial=finish: a push waits for the batch in flight")
    return (f"async: a driver generates through the serving engines {where} into a buffer of at most "
            f"{t.max_staleness + 1} batches; trained tokens at most {t.max_staleness} version(s) old "
            f"(stale_policy={t.stale_policy}); weights pushed every {t.sync_every} update(s); {partial}; {correction}")


def build_schedule(cfg: Any, rollout: Any, producer: Any) -> Schedule:
    """The schedule of `cfg.trainer.mode` over the rollout service `rollout`, its batches from `producer` (a
    `megarl.trainer.producer.BatchProducer`)."""
    return SCHEDULES[cfg.trainer.mode](cfg, rollout, producer)
