"""One training job on the controller: its inputs, its Ray worker groups and its `RLLoop`, from start to clean
shutdown. `megarl train` (through `megarl.trainer.run`) and the Python API (`megarl.api.RLTrainer`) both drive a job
through this class, so they run the same engine.

    session = TrainingSession(cfg)          # checks every input (data, tokenizer, reward, checkpoints, memory)
    session.start()                         # Ray, worker groups (HybridWorker on the actor's pool, RoleWorkers)
    session.fit() / session.step()          # RLLoop.fit / RLLoop.run_step, under the SIGTERM/SIGINT handlers
    session.close()                         # sinks, workers, /dev/shm segments, the Ray cluster it started

It is the one place a run is wired (`megarl train`, the Python API, both quickstarts, the benchmarks and the e2e
runs all build their runs here). Two more ways to drive it:

    session = TrainingSession(cfg, sft=True)   # quickstarts: an SFT warm-up on the same workers, then RL
    session.start_workers(); session.sft_step(batch, lr); ...; session.fit()
    session.train_from(step0, run_dir, overrides)   # a run of its own from a checkpoint, on the started workers

Placement: it joins a Ray cluster (`RAY_ADDRESS`, e.g. from `launch/ray_submit.sh`) or starts a local one, places a
`HybridWorker` on every device slot of the actor's pool (the actor, the vLLM engine and any role configured on the
same pool) and a `RoleWorker` group on each other pool (a critic, reference or reward model of its own layout). With
`rollout.pool` set, an `ActorWorker` group replaces the `HybridWorker` (the roles only), a `RolloutWorker` group runs
the engines on that pool, and a bridge joins the two (`megarl.controller.bridge`; the trainer gets a `PoolRollout`).
With `reward.judge`, a `JudgeHost` group on the judge's pool serves the judge model for the whole run (a
`RolloutRouter` over its replicas, never weight-synced) and a `megarl.rollout.judge.Judge` scores the responses.
The vendor log level (`logging.vendor_level`, `megarl.platform.vendor_logs`) is applied here and in every worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import threading
from typing import Callable, Mapping, Optional, Sequence

from megarl.config import ConfigError
from megarl.config.memory import check_fits, device_memory_bytes, job_memory_estimate, judge_pool_memory
from megarl.config.schema import JobConfig
from megarl.config.validate import SIDE_ROLES, check_supported, rollout_pool
from megarl.controller.group_start import start_groups
from megarl.controller.resource_pool import ResourcePool
from megarl.controller.worker_group import WorkerGroup
from megarl.data.dataset import PromptDataset, PromptLoader
from megarl.data.tokenization import PromptEncoder
from megarl.platform.vendor_logs import quiet_vendors, ray_init_kwargs, vendor_env
from megarl.rewards import build_reward_fn
from megarl.trainer.checkpointing import complete_steps, refuse_breaking_resume
from megarl.trainer.engine_model_dir import engine_model_dir
from megarl.trainer.shm import remove_shm_segments
from megarl.trainer.stop import StopRequest

logger = logging.getLogger("megarl.trainer")


@contextlib.contextmanager
def config_key(key: str):
    """Re-raise a setup error (missing file, bad tokenizer, unknown reward) as a ConfigError naming `key`."""
    try:
        yield
    except ConfigError:
        raise
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"{key}: {e.args[0] if e.args else e}") from None


def worker_threads(cfg: JobConfig, joined_cluster: bool = False, cores: Optional[int] = None) -> int:
    """CPU threads per worker process: `resources.threads_per_worker`, else this machine's cores shared evenly by
    every pool's device slots (at least 1); 1 when joining a Ray cluster (its nodes' cores are not visible here)."""
    if cfg.resources.threads_per_worker:
        return cfg.resources.threads_per_worker
    if joined_cluster:
        return 1
    cores = cores or len(os.sched_getaffinity(0))
    slots = sum(p.nodes * p.devices_per_node for p in cfg.resources.pools.values())
    return max(1, cores // max(slots, 1))


def call_bounds(cfg: JobConfig) -> dict[str, Optional[float]]:
    """The worker groups' call bounds from the config (`WorkerGroup` keywords): `resources.heartbeat_timeout_s`
    (a rank's silence) and `resources.call_timeout_s` (a call's optional wall bound)."""
    return {"heartbeat_timeout_s": cfg.resources.heartbeat_timeout_s, "call_timeout_s": cfg.resources.call_timeout_s}


def load_judge_tokenizer(judge):
    """The tokenizer of `reward.judge.model`, checked before any worker starts: an HF directory whose tokenizer has
    a chat template (it renders the judge's prompt) and encodes the two yes_no words to different first tokens."""
    from transformers import AutoTokenizer

    from megarl.rollout.judge import candidate_tokens

    if not os.path.isfile(os.path.join(judge.model, "config.json")):
        raise ConfigError(f"reward.judge.model: {judge.model!r} is not an HF model directory (no config.json)")
    tokenizer = AutoTokenizer.from_pretrained(judge.model)
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"reward.judge.model: the tokenizer in {judge.model!r} has no chat template, which renders "
                          "the judge's prompt; use a chat model's directory")
    if judge.parse == "yes_no_logprob":
        try:
            candidate_tokens(tokenizer, judge.yes_no)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return tokenizer


# Seconds one long-poll of a judge replica waits for results (it answers at once when one is ready)
JUDGE_POLL_WAIT_S = 0.5


def placement_summary(cfg: JobConfig, device: str, threads: int) -> str:
    """A few lines: each pool's processes, each enabled role's Megatron layout and pool, the rollout engines."""
    lines = []
    for name, p in cfg.resources.pools.items():
        roles = [r for r in cfg.enabled_roles() if cfg.role(r).pool == name]
        if name == rollout_pool(cfg):
            roles.append("rollout")
        if cfg.reward.judge is not None and name == cfg.reward.judge.pool:
            roles.append("judge")
        roles += [f"teacher/{t}" for t, tc in cfg.distillation.teachers.items()
                  if tc.enabled and (tc.pool if tc.pool is not None else cfg.actor.pool) == name]
        lines.append(f"pool {name}: {p.nodes} node(s) x {p.devices_per_node} {device} worker(s), {threads} thread(s) "
                     f"each: {', '.join(roles) or 'unused'}")
    for role in cfg.enabled_roles():
        q = cfg.role(role).parallel
        lines.append(f"  {role:<12} Megatron tp {q.tp} pp {q.pp} cp {q.cp} dp {q.dp}" + (f" ep {q.ep}" if q.ep > 1
                                                                                           else "")
                     + (f" etp {q.etp}" if q.etp is not None and q.etp != q.tp else "")
                     + (f" vpp {q.vpp}" if q.vpp > 1 else ""))
    engines = cfg.resources.pools[rollout_pool(cfg)]
    devices = engines.nodes * engines.devices_per_node
    if cfg.rollout.pool is None:
        lines.append(f"  {'rollout':<12} vLLM tp {cfg.rollout.tp} x {devices // cfg.rollout.tp} engine(s), weights "
                     "resharded from the actor every step")
    else:
        lines.append(f"  {'rollout':<12} vLLM tp {cfg.rollout.tp} x {devices // cfg.rollout.tp} engine(s) on pool "
                     f"{cfg.rollout.pool!r}, weights sent from the actor's pool over the bridge every step")
        from megarl.reshard.pool_plan import pool_sync_lines

        lines.extend("  " + line for line in pool_sync_lines(cfg))
    j = cfg.reward.judge
    if j is not None:
        judges = cfg.resources.pools[j.pool]
        lines.append(f"  {'judge':<12} vLLM tp {j.tp} x {judges.nodes * judges.devices_per_node // j.tp} engine(s) on "
                     f"pool {j.pool!r}, {j.model}, never weight-synced; parse {j.parse}")
    d, r = cfg.data, cfg.rollout
    lines.append(f"{cfg.trainer.total_steps} steps of {d.prompts_per_step} prompts x {r.samples_per_prompt} samples, "
                 f"algorithm {cfg.algorithm.name}; run dir {os.path.abspath(cfg.logging.dir)}")
    return "\n".join(lines)


def _ranks_and_pids(pids: list[int]) -> str:
    """'rank 0 pid P, rank 1 pid Q, ...' (the log line tools read a group's processes from)."""
    return ", ".join(f"rank {i} pid {p}" for i, p in enumerate(pids))


class TrainingSession:
    """A job's controller side. `reward_fn`: a Python callable `fn(response_text, answer, record) -> float` used
    instead of the one `cfg.reward` names (the API's `reward=`); it runs here, on the controller, and is never sent to
    a worker. Construction checks every input and starts nothing; `start` starts Ray and the workers."""

    def __init__(self, cfg: JobConfig, reward_fn: Optional[Callable] = None, sft: bool = False) -> None:
        """`sft`: the actor pool's workers are `megarl.trainer.sft.SFTWorker` (a `HybridWorker` that also takes
        supervised steps, `sft_step`), for a warm-up on the same workers before RL (the quickstarts); only with the
        hybrid engine (no `rollout.pool`)."""
        check_supported(cfg)
        if sft and cfg.rollout.pool is not None:
            raise ConfigError(f"rollout.pool: a session with an SFT phase runs the engines in the actor's processes "
                              f"(the hybrid engine); set rollout.pool=null (it is {cfg.rollout.pool!r}) or drop the "
                              "SFT phase")
        self.sft = sft
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        self.cfg = cfg
        self.run_dir = os.path.abspath(cfg.logging.dir)
        os.makedirs(self.run_dir, exist_ok=True)
        self.metrics_path = os.path.join(self.run_dir, "metrics.jsonl")
        # Everything the controller needs is checked before any worker starts; problems name their config key.
        with config_key("data.train_path"):
            dataset = PromptDataset.from_config(cfg.data, split="train")
        with config_key("data.val_path"):
            self.val = list(PromptDataset.from_config(cfg.data, split="val")) if cfg.data.val_path else None
        self.loader = PromptLoader(dataset, cfg.data.prompts_per_step, shuffle=cfg.data.shuffle, seed=cfg.data.seed)
        with config_key("model.tokenizer"):
            self.encoder = PromptEncoder(cfg.model.tokenizer or cfg.model.path, cfg.data.chat_template)
        if cfg.distillation.enabled:  # a teacher must score the student's token ids as the student's tokens
            from megarl.data.tokenizer_match import check_teacher_tokenizers

            with config_key("distillation.teachers"):
                check_teacher_tokenizers(cfg, self.encoder.tokenizer)
        if reward_fn is None:
            with config_key("reward.function"):
                reward_fn = build_reward_fn(cfg.reward)
        self.reward_fn = reward_fn
        self.judge_tokenizer = load_judge_tokenizer(cfg.reward.judge) if cfg.reward.judge is not None else None
        with config_key("model.tokenizer"):
            self.model_dir = engine_model_dir(cfg, self.run_dir)
        if cfg.checkpoint.dir and not cfg.checkpoint.resume:
            existing = complete_steps(cfg.checkpoint.dir)
            if existing:
                raise ConfigError(f"checkpoint.dir: {cfg.checkpoint.dir} holds checkpoints of an earlier run (steps "
                                  f"{existing}); set checkpoint.resume=true to continue it, or choose another "
                                  "directory")
        refuse_breaking_resume(cfg)  # a resume this config breaks: refused now, not after the workers started
        # pre-flight: a layout whose static memory exceeds the GPU's (when known) is refused before Ray starts
        check_fits(job_memory_estimate(cfg, device_memory_bytes(cfg)))
        judge_pool_memory(cfg, device_memory_bytes(cfg))  # the judge's weight shard within vLLM's share
        self.stop = StopRequest(graceful=bool(cfg.checkpoint.dir))
        self.trainer = None  # megarl.trainer.rl_trainer.RLLoop, once started
        self.workers = None  # the actor pool's WorkerGroup, once the workers started (`start_workers`)
        self.judge = None  # the reward.judge `Judge`, once its engines serve (`_serve_judge`)
        self.engine_teachers: dict = {}  # vLLM-served teachers: name -> `EngineTeacher` (`_serve_engine_teacher`)
        self._teacher_serving: list = []  # their (group, router), stopped at `close`
        self.rollout = None  # its RolloutService: None (the loop's ColocatedRollout) or the PoolRollout
        # reference / critic / reward_model, and "teacher/<name>" for a teacher on a pool of its own -> its group
        self.role_groups: dict = {}
        self.groups: list = []
        self.shm_reports: list = []
        self.started_ray = False
        self.closed = False

    def start(self):
        """Start (once) the Ray cluster if none is running, the worker groups and the `RLLoop`; returns it."""
        if self.trainer is None:
            self.start_workers()
            self.trainer = self._loop(self.cfg, self.metrics_path, stop=self.stop)
        return self.trainer

    def start_workers(self):
        """Start (once) the Ray cluster if none is running and the worker groups, without the RL loop (what an SFT
        phase before it needs, `sft_step`); returns the actor pool's group. The groups (the actor's, the rollout
        pool's, each role's, teacher's and judge's on a pool of its own) start side by side
        (`megarl.controller.group_start`); the bridge and the judge's and teachers' servers are set up after."""
        if self.workers is not None:
            return self.workers
        if self.closed:
            raise RuntimeError("this training session was closed; build a new one")
        # this process, before the vendor imports below; the workers get it through their environment
        quiet_vendors(self.cfg.logging.vendor_level)
        import ray

        from megarl.platform.device import device_kind  # torch
        from megarl.trainer.sft import SFTWorker
        from megarl.workers.hybrid import HybridWorker  # torch, megatron-core, vLLM
        from megarl.workers.role_host import RoleWorker  # torch, megatron-core

        cfg = self.cfg
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            # A local cluster gets one logical CPU per device slot (at least the machine's cores): Ray CPUs are only
            # accounting here, the workers share the real cores.
            slots = sum(p.nodes * p.devices_per_node for p in cfg.resources.pools.values())
            ray.init(address=address, include_dashboard=False, log_to_driver=True,
                     **ray_init_kwargs(cfg.logging.vendor_level),
                     **({} if address else {"num_cpus": max(slots, os.cpu_count() or 2)}))
            self.started_ray = True
        device = device_kind(cfg.resources.device)
        threads = worker_threads(cfg, joined_cluster=bool(os.environ.get("RAY_ADDRESS")))
        logger.info("placement (megarl train CONFIG --dry-run prints every rank):\n%s",
                    placement_summary(cfg, device, threads))
        quiet = vendor_env(cfg.logging.vendor_level)
        env = {"VLLM_CPU_KVCACHE_SPACE": str(max(1, int(-(-cfg.rollout.kv_cache_gib // 1)))),
               "OMP_NUM_THREADS": str(threads), **quiet}

        def make_pool(name: str):
            p = cfg.resources.pools[name]
            return ResourcePool(name, nodes=p.nodes, devices_per_node=p.devices_per_node, device=device)

        bounds = call_bounds(cfg)
        role_env = {"OMP_NUM_THREADS": str(threads), **quiet}
        # name -> the start of one worker group; they all start at once (`start_groups`: nothing in one group's start
        # waits for another's), and self.groups holds them in this order
        starts: dict[str, Callable[[], WorkerGroup]] = {}
        engine_groups = {"rollout", "judge"}  # the groups whose vLLM engines leave /dev/shm segments to remove
        if cfg.rollout.pool is None:  # the hybrid engine: vLLM in the actor's processes
            starts["actor"] = lambda: WorkerGroup(make_pool(cfg.actor.pool), SFTWorker if self.sft else HybridWorker,
                                                  cfg, self.model_dir, env=env, **bounds)
            engine_groups.add("actor")
        else:  # the engines on a pool of their own, joined to the actor's by the bridge (`_join_pools`, below)
            from megarl.workers.pool_sync import ActorWorker, RolloutWorker

            starts["actor"] = lambda: WorkerGroup(make_pool(cfg.actor.pool), ActorWorker, cfg, env=role_env, **bounds)
            starts["rollout"] = lambda: WorkerGroup(make_pool(cfg.rollout.pool), RolloutWorker, cfg, self.model_dir,
                                                    env=env, **bounds)
        for role in SIDE_ROLES:  # a role on a pool of its own: its own world and layout
            r = cfg.role(role)
            if r.enabled and r.pool != cfg.actor.pool:
                starts[role] = lambda role=role, pool=r.pool: WorkerGroup(make_pool(pool), RoleWorker, cfg, role,
                                                                          env=role_env, **bounds)
        from megarl.roles.teacher import engine_teachers, teacher_pools

        teachers_on = {}  # distillation teachers away from the actor: a group per pool -> the teachers it holds
        for pool, names in teacher_pools(cfg).items():
            if pool == cfg.actor.pool:
                continue
            from megarl.workers.role_host import TeacherWorker

            teachers_on[f"teachers@{pool}"] = names
            starts[f"teachers@{pool}"] = lambda pool=pool: WorkerGroup(make_pool(pool), TeacherWorker, cfg, pool,
                                                                       env=role_env, **bounds)
        if cfg.reward.judge is not None:
            from megarl.workers.judge_host import JudgeHost

            starts["judge"] = lambda: WorkerGroup(make_pool(cfg.reward.judge.pool), JudgeHost, cfg, env=env, **bounds)
        for name in engine_teachers(cfg):  # vLLM-served teachers (`backend: vllm`)
            from megarl.workers.teacher_host import TeacherEngineHost

            engine_groups.add(f"teacher/{name}")
            starts[f"teacher/{name}"] = lambda name=name: WorkerGroup(
                make_pool(cfg.distillation.teachers[name].pool), TeacherEngineHost, cfg, name, env=env, **bounds)

        def keep(name: str, group: WorkerGroup) -> None:
            self.groups.append(group)
            if name in engine_groups:  # removed after the workers are gone, however the run ends
                self.shm_reports = list(self.shm_reports) + list(group.shm_segments())

        groups = start_groups(starts, keep)
        workers = groups["actor"]
        rollout = None
        if "rollout" in groups:
            rollout = self._join_pools(workers, groups["rollout"])
            logger.info("worker processes: actor pool %r: %s; rollout pool %r: %s", cfg.actor.pool,
                        _ranks_and_pids(workers.pids()), cfg.rollout.pool, _ranks_and_pids(groups["rollout"].pids()))
        else:
            logger.info("worker processes: %s", _ranks_and_pids(workers.pids()))
        role_groups = {role: groups.get(role, workers) for role in SIDE_ROLES if cfg.role(role).enabled}
        for key, names in teachers_on.items():
            role_groups.update({f"teacher/{name}": groups[key] for name in names})
            logger.info("teachers %s on pool %r: %s", ", ".join(names), key.split("@", 1)[1],
                        _ranks_and_pids(groups[key].pids()))
        self.workers, self.rollout, self.role_groups = workers, rollout, role_groups
        if "judge" in groups:
            self._serve_judge(groups["judge"])
        for name in engine_teachers(cfg):
            self._serve_engine_teacher(name, groups[f"teacher/{name}"])
        return workers

    def _serve_engine_teacher(self, name: str, group: WorkerGroup) -> None:
        """A vLLM-served teacher's started `TeacherEngineHost` group: serving until `close` (a `RolloutRouter` over
        its replicas), and the `EngineTeacher` the loop scores with."""
        from megarl.controller import serving
        from megarl.rollout.teacher_engine import EngineTeacher

        t = self.cfg.distillation.teachers[name]
        router = serving.start_serving(group, poll_wait_s=JUDGE_POLL_WAIT_S, default_timeout_s=t.request_timeout_s)
        self._teacher_serving.append((group, router))
        self.engine_teachers[name] = EngineTeacher(name, router, max_concurrent=t.max_concurrent,
                                                   timeout_s=t.request_timeout_s)
        logger.info("teacher %s: vLLM tp %d x %d engine(s) on pool %r (pids %s), never weight-synced", name,
                    t.parallel.tp, group.world_size // t.parallel.tp, t.pool, _ranks_and_pids(group.pids()))

    def _serve_judge(self, group: WorkerGroup) -> None:
        """`reward.judge`: the judge's started `JudgeHost` group, serving until `close` (a `RolloutRouter` over its
        replicas), and the `Judge` that the producer scores with."""
        from megarl.controller import serving
        from megarl.rollout.judge import Judge

        j = self.cfg.reward.judge
        # a long-poll answers as soon as a result is ready: its wait only bounds idle polling over the whole run
        router = serving.start_serving(group, poll_wait_s=JUDGE_POLL_WAIT_S, default_timeout_s=j.timeout_s)
        self._judge_serving = (group, router)
        self.judge = Judge(j, self.judge_tokenizer, router)
        logger.info("judge %s: vLLM tp %d x %d engine(s) on pool %r (pids %s), parse %s", j.model, j.tp,
                    group.world_size // j.tp, j.pool, _ranks_and_pids(group.pids()), j.parse)

    def _loop(self, cfg: JobConfig, metrics_path: str, stop: Optional[StopRequest] = None, rollout=None):
        """The one place an `RLLoop` is built: over this session's worker groups, inputs and rollout service
        (`rollout`, when given, instead), with `cfg` (this session's or a run's, `train_from`)."""
        from megarl.trainer.rl_trainer import RLLoop

        # the session's judge scores the runs that ask for one (reward.judge set); a run without it (train_from with
        # reward.judge=null) scores with reward.function alone, as its config says
        if cfg.reward.judge is not None and self.judge is None:
            raise ValueError("this run sets reward.judge, but the session was started without one (its judge engines "
                             "start with the session): set reward.judge in the session's own config")
        return RLLoop(cfg, self.workers, self.loader, self.encoder, self.reward_fn, role_groups=self.role_groups,
                      val_records=self.val, metrics_path=metrics_path, stop=stop,
                      rollout=rollout if rollout is not None else self.rollout,
                      judge=self.judge if cfg.reward.judge is not None else None,
                      engine_teachers=self.engine_teachers)

    def _join_pools(self, actors: WorkerGroup, engines: WorkerGroup):
        """`rollout.pool` set: the bridge between the started `ActorWorker` group (the actor and the roles placed
        there) and `RolloutWorker` group (its store on actor rank 0's node, at a port the controller picks there) ->
        the `PoolRollout` over them."""
        from megarl.controller import serving
        from megarl.controller.bridge import BridgeSpec
        from megarl.rollout.service import PoolRollout

        host, port = actors.rank_address(0)
        spec = BridgeSpec(host, port, train_ranks=actors.world_size, rollout_ranks=engines.world_size)
        source = actors.sync_source()
        joining = [actors.connect_bridge.submit(spec), engines.connect_bridge.submit(spec, source)]
        ranks = [r for call in joining for r in call.result()]
        logger.info("bridge %r over %s:%d: actor ranks -> bridge %s, rollout ranks -> bridge %s", spec.name, host,
                    port, ranks[:spec.train_ranks], ranks[spec.train_ranks:])
        return PoolRollout(actors, engines, serving_backend=serving)

    def signals(self):
        """SIGTERM/SIGINT handlers around training (`megarl.trainer.stop`); none off the main thread, where Python
        cannot install them (Ctrl-C then interrupts as usual)."""
        if threading.current_thread() is threading.main_thread():
            return self.stop
        return contextlib.nullcontext()

    def fit(self) -> list:
        """`RLLoop.fit`: the remaining steps; a list of `StepResult`."""
        trainer = self.start()
        with self.signals():
            results = trainer.fit()
        trainer.close()  # ends the progress bar before the closing lines
        last = results[-1].metrics if results else {}
        logger.info("finished %d steps; last reward %.3f; metrics in %s", len(results),
                    last.get("reward/mean", float("nan")), self.metrics_path)
        return results

    def step(self):
        """`RLLoop.run_step`: the next step (with its validation / checkpoint / logging); a `StepResult`."""
        trainer = self.start()
        with self.signals():
            return trainer.run_step()

    def sft_step(self, batch, lr: float) -> dict[str, float]:
        """One supervised optimizer step of the actor on the session's workers (`SFTWorker.update_actor_sft`:
        cross-entropy on `batch`'s response tokens, `input_ids` / `attention_mask` / `response_mask` [B, S]) at
        learning rate `lr`; the RL loop (`fit`, `step`) continues from the weights and optimizer state it leaves.
        The session must be built with `sft=True`. Returns the update's metrics ("loss", ...)."""
        if not self.sft:
            raise RuntimeError("sft_step: this session's workers take no SFT steps; build it with "
                               "TrainingSession(cfg, sft=True)")
        return self.start_workers().update_actor_sft(batch, lr)

    def export_hf(self, out: str) -> dict:
        """Write the actor's current weights (on the started workers: after SFT steps, between runs) as a HuggingFace
        model directory `out` that transformers loads (safetensors, config.json, the tokenizer), atomically: a
        checkpoint of the session's loop (`RLLoop.save`, step 0) and its export (`megarl.checkpoint.export.
        export_hf`) go to a temporary directory beside `out`, which is renamed to `out` when complete and the
        checkpoint removed; a failure leaves no `out`. Refuses an existing `out`. Returns {"out", "bytes"}."""
        import tempfile

        from megarl.checkpoint.atomic import commit_dir
        from megarl.checkpoint.export import export_hf

        out = os.path.abspath(out)
        if os.path.exists(out):
            raise FileExistsError(f"{out} exists; export_hf writes a new directory (remove it or choose another)")
        parent = os.path.dirname(out)
        os.makedirs(parent, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f".{os.path.basename(out)}.tmp-", dir=parent) as tmp:
            checkpoint = self.start().save(0, root=os.path.join(tmp, "checkpoint"))
            model = os.path.join(tmp, "model")
            stats = export_hf(checkpoint, model)
            if not os.path.exists(os.path.join(model, "tokenizer_config.json")):  # a model built from model.arch
                self.encoder.tokenizer.save_pretrained(model)
            commit_dir(model, out)
        logger.info("wrote the actor's weights as a HuggingFace model: %s", out)
        return {"out": out, "bytes": stats.get("bytes", 0)}

    def train_from(self, source: str, run_dir: str, overrides: Sequence[str] = (), raw: Optional[Mapping] = None,
                   rollout=None) -> list:
        """A run of its own on this session's started workers, from checkpoint `source` (a step directory, e.g.
        `self.start().save(0, root=...)`): copy it into `run_dir`/ckpt, validate `raw` (a config mapping; default
        this session's config) plus `overrides` with that checkpoint directory (checkpoint.resume and
        checkpoint.allow_config_change on), log into `run_dir` (metrics.jsonl there), and fit a new `RLLoop` over
        the session's groups, loader and reward (`rollout`: a service to use instead of the session's; the session's
        judge only when the run's config sets reward.judge, which needs one in the session's config). Runs that
        differ only in their options share one start-up this way (tests/e2e/async_runs.py, benchmarks/async.py).
        Returns the run's `StepResult`s."""
        from megarl.config import to_dict
        from megarl.config.loader import parse_config
        from megarl.config.validate import validate

        self.start()
        ckpt = os.path.join(run_dir, "ckpt")
        shutil.copytree(source, os.path.join(ckpt, os.path.basename(os.path.normpath(source))))
        cfg = validate(parse_config(dict(raw) if raw is not None else to_dict(self.cfg),
                                    [*overrides, f"checkpoint.dir={ckpt}", "checkpoint.resume=true",
                                     "checkpoint.allow_config_change=true"]))
        cfg = dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, dir=run_dir))
        loop = self._loop(cfg, os.path.join(run_dir, "metrics.jsonl"), rollout=rollout)
        try:
            return loop.fit()
        finally:
            loop.close()

    def close(self) -> None:
        """Close the sinks, kill the workers (and their placement groups), remove their /dev/shm segments and stop the
        Ray cluster this session started. Idempotent; safe after a failed start."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.trainer is not None:
                self.trainer.close()
        finally:
            if self.judge is not None:
                self.judge.close()
                from megarl.controller import serving

                try:
                    serving.stop_serving(*self._judge_serving)
                except Exception as e:  # the workers are killed below anyway
                    logger.warning("stopping the judge's servers: %s: %s", type(e).__name__, e)
            for serving_pair in self._teacher_serving:
                from megarl.controller import serving

                try:
                    serving.stop_serving(*serving_pair)
                except Exception as e:  # the workers are killed below anyway
                    logger.warning("stopping a teacher's servers: %s: %s", type(e).__name__, e)
            for group in reversed(self.groups):
                group.shutdown()
            self.groups = []
            removed = remove_shm_segments(self.shm_reports)
            if removed:
                logger.info("removed the workers' vLLM shared-memory segments from /dev/shm: %s", removed)
            if self.started_ray:
                import ray

                ray.shutdown()
                self.started_ray = False
