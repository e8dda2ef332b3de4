"""The RL trainer: `run(cfg)` is what `megarl train CONFIG` calls after the config validated.

It joins a Ray cluster (`RAY_ADDRESS`, e.g. from `launch/ray_submit.sh`) or starts a local one, places a
`HybridWorker` on every device slot of the actor's pool (the actor, the vLLM engine and any role configured on the
same pool), a `RoleWorker` group on each other pool (a critic, reference or reward model of its own layout and
size), and runs `RLTrainer.fit` on this process, the single controller. Metrics go to the console and to
`<logging.dir>/metrics.jsonl`.

SIGTERM / SIGINT during training (Slurm's warning signal, Ctrl-C) stop the run after the step in flight, with a
checkpoint of it when `checkpoint.dir` is set and a logged command that resumes it, exit status 0; a second signal,
or the first without `checkpoint.dir`, aborts at once (`megarl.trainer.stop`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Optional

from megarl.config import ConfigError
from megarl.config.memory import check_fits, device_memory_bytes, job_memory_estimate
from megarl.config.schema import JobConfig
from megarl.config.validate import SIDE_ROLES, check_supported  # noqa: F401  (re-exported: the trainer's refusals)
from megarl.controller.resource_pool import ResourcePool
from megarl.controller.worker_group import WorkerGroup
from megarl.data.dataset import PromptDataset, PromptLoader
from megarl.data.tokenization import PromptEncoder
from megarl.rewards import build_reward_fn
from megarl.trainer.checkpointing import complete_steps, latest
from megarl.trainer.engine_model_dir import engine_model_dir
from megarl.trainer.shm import remove_shm_segments
from megarl.trainer.stop import StopRequest

logger = logging.getLogger("megarl.trainer")


@contextlib.contextmanager
def _config_key(key: str):
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


def run(cfg: JobConfig, resume_command: Optional[str] = None) -> Optional[int]:
    """Train `cfg`; returns 0 (also after a graceful stop on SIGTERM/SIGINT). `resume_command`: the command line
    that resumes this run, logged when a signal stops it (the CLI passes the one it was started with)."""
    import ray

    from megarl.platform.device import device_kind  # torch
    from megarl.trainer.hybrid_worker import HybridWorker  # torch, megatron-core, vLLM
    from megarl.trainer.rl_trainer import RLTrainer
    from megarl.trainer.role_worker import RoleWorker  # torch, megatron-core

    check_supported(cfg)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run_dir = os.path.abspath(cfg.logging.dir)
    os.makedirs(run_dir, exist_ok=True)
    # Everything the controller needs is checked before any worker starts; problems name their config key.
    with _config_key("data.train_path"):
        dataset = PromptDataset.from_config(cfg.data, split="train")
    with _config_key("data.val_path"):
        val = PromptDataset.from_config(cfg.data, split="val") if cfg.data.val_path else None
    loader = PromptLoader(dataset, cfg.data.prompts_per_step, shuffle=cfg.data.shuffle, seed=cfg.data.seed)
    with _config_key("model.tokenizer"):
        encoder = PromptEncoder(cfg.model.tokenizer or cfg.model.path, cfg.data.chat_template)
    with _config_key("reward.function"):
        reward_fn = build_reward_fn(cfg.reward)
    with _config_key("model.tokenizer"):
        model_dir = engine_model_dir(cfg, run_dir)
    if cfg.checkpoint.dir and not cfg.checkpoint.resume:
        existing = complete_steps(cfg.checkpoint.dir)
        if existing:
            raise ConfigError(f"checkpoint.dir: {cfg.checkpoint.dir} holds checkpoints of an earlier run (steps "
                              f"{existing}); set checkpoint.resume=true to continue it, or choose another directory")
    # pre-flight: a layout whose static memory exceeds the GPU's (when known) is refused before Ray starts
    check_fits(job_memory_estimate(cfg, device_memory_bytes(cfg)))

    started_ray = not ray.is_initialized()
    if started_ray:
        address = os.environ.get("RAY_ADDRESS")
        # A local cluster gets one logical CPU per device slot (at least the machine's cores): Ray CPUs are only
        # accounting here, the workers share the real cores.
        slots = sum(p.nodes * p.devices_per_node for p in cfg.resources.pools.values())
        ray.init(address=address, include_dashboard=False, log_to_driver=True,
                 **({} if address else {"num_cpus": max(slots, os.cpu_count() or 2)}))
    device = device_kind(cfg.resources.device)

    def make_pool(name: str):
        p = cfg.resources.pools[name]
        return ResourcePool(name, nodes=p.nodes, devices_per_node=p.devices_per_node, device=device)

    threads = str(worker_threads(cfg, joined_cluster=bool(os.environ.get("RAY_ADDRESS"))))
    logger.info("worker processes use %s CPU thread(s) each (resources.threads_per_worker)", threads)
    env = {"VLLM_CPU_KVCACHE_SPACE": str(max(1, int(-(-cfg.rollout.kv_cache_gib // 1)))), "OMP_NUM_THREADS": threads}
    groups: list = []
    shm_reports: list = []
    results: list = []
    stop = StopRequest(graceful=bool(cfg.checkpoint.dir))
    try:
        workers = WorkerGroup(make_pool(cfg.actor.pool), HybridWorker, cfg, model_dir, env=env)
        groups.append(workers)
        shm_reports = workers.shm_segments()  # removed after the workers are gone, however the run ends
        logger.info("worker processes: %s", ", ".join(f"rank {i} pid {r['pid']}" for i, r in enumerate(shm_reports)))
        role_groups = {}
        for role in SIDE_ROLES:
            r = cfg.role(role)
            if not r.enabled:
                continue
            if r.pool == cfg.actor.pool:
                role_groups[role] = workers
            else:  # its own pool, world and layout
                role_groups[role] = WorkerGroup(make_pool(r.pool), RoleWorker, cfg, role,
                                                env={"OMP_NUM_THREADS": threads})
                groups.append(role_groups[role])
        trainer = RLTrainer(cfg, workers, loader, encoder, reward_fn, role_groups=role_groups,
                            val_records=list(val) if val is not None else None,
                            metrics_path=os.path.join(run_dir, "metrics.jsonl"), stop=stop)
        with stop:
            results = trainer.fit()
        last = results[-1].metrics if results else {}
        logger.info("finished %d steps; last reward %.3f; metrics in %s", len(results),
                    last.get("reward/mean", float("nan")), os.path.join(run_dir, "metrics.jsonl"))
    finally:
        for group in reversed(groups):
            group.shutdown()  # kills the actors and removes the pool's placement groups
        removed = remove_shm_segments(shm_reports)
        if removed:
            logger.info("removed the workers' vLLM shared-memory segments from /dev/shm: %s", removed)
        if started_ray:
            ray.shutdown()
    done = results[-1].step if results else None
    if stop.requested and (done or 0) < cfg.trainer.total_steps:
        logger.warning(stopped_message(cfg, stop.signal_name, done, resume_command))
    return 0


def stopped_message(cfg: JobConfig, signal_name: Optional[str], step: Optional[int],
                    resume_command: Optional[str]) -> str:
    """The last line of a run stopped by a signal: which step finished, the checkpoint that holds it, and the
    command that resumes the run (`resume_command`, else a template)."""
    command = resume_command or "megarl train CONFIG [the same overrides] checkpoint.resume=true"
    path = latest(cfg.checkpoint.dir) if cfg.checkpoint.dir else None
    what = f"after step {step} of {cfg.trainer.total_steps}" if step else "before its first step"
    held = f"checkpoint {path} holds step {complete_steps(cfg.checkpoint.dir)[-1]}" if path else "no checkpoint yet"
    return f"stopped by {signal_name} {what}; {held}. To resume: {command}"
