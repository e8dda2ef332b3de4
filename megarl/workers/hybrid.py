"""`HybridWorker`: everything one device slot of the actor's pool runs (the colocated "hybrid engine") =
`RoleHost` (the actor, and the reference, critic and reward model when enabled and placed on the actor's pool) +
`RolloutHost` (the vLLM engine, one replica per `rollout.tp` consecutive ranks) + the local reshard (actor layout ->
rollout TP, planned once) that is the engine's only weight source.

One instance per rank of the actor's pool, all in one torch.distributed world; every method is SPMD. Data path of
one RL step (controller view, `megarl.trainer.rl_trainer` through `megarl.rollout.service.ColocatedRollout`):
  prompts -> requests to each replica's server (`start_server` .. `stop_server`; rewards on the controller as the
  groups finish) -> Batch -> `compute_log_probs`
  (+ `compute_ref_log_probs`, `compute_values`; DP_SPLIT) -> advantages (controller) -> `update_critic`,
  `update_actor` (DP_SPLIT_MINI_BATCHES: a replica receives its part of every mini-batch) -> `sync_weights`
  (reshard into vLLM for the next rollout).
"""

from __future__ import annotations

import os

import torch.distributed as dist

from megarl.config.schema import JobConfig
from megarl.controller.dispatch import Dispatch, dispatch
from megarl.platform.device import empty_device_cache
from megarl.reshard.executor import execute_reshard
from megarl.reshard.layouts import TrainLayout
from megarl.reshard.lora_sync import actor_sync_sources
from megarl.reshard.planner import check_engine_mapping, plan_reshard
from megarl.reshard.vllm_sink import VllmShardSink
from megarl.workers.role_host import ROLES, RoleHost
from megarl.workers.rollout_host import RolloutHost

ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


class HybridWorker(RoleHost, RolloutHost):
    """One rank of the actor's pool: Megatron roles + vLLM engine + reshard (see the module docstring)."""

    def __init__(self, cfg: JobConfig, engine_model_dir: str) -> None:
        from megarl.config.validate import check_supported

        check_supported(cfg)
        # This pool is its own torch.distributed world: roles start at rank 0 in it.
        pool = cfg.actor.pool
        RoleHost.__init__(self, cfg, [r for r in ROLES if r == "actor" or (cfg.role(r).enabled
                                                                            and cfg.role(r).pool == pool)], pool)
        # vLLM sizes its memory from what is free when it starts: the Megatron roles' offloadable state goes to host
        # first, and the allocator's cached blocks are returned (they would count as used). Each role comes back
        # on its first use.
        for policy in self.offload.values():
            policy.after_use()
        empty_device_cache()
        RolloutHost.__init__(self, cfg, engine_model_dir)
        # Element size of the weights on the wire: the model dtype's (a CPU bf16 engine keeps fp32 norms, cast).
        elem = ELEMENT_BYTES[cfg.model.dtype]
        # The engine's mapping (vLLM's external launcher: TP rank = position in the block), checked, not searched.
        self.plan = plan_reshard(self.actor.engine.spec, self.actor.groups.topology, cfg.rollout.tp, dtype_bytes=elem,
                                 search_mapping=False, train_layout=TrainLayout.from_parallel(cfg.actor.parallel),
                                 infer_ep=cfg.rollout.ep)
        check_engine_mapping(self.plan, dist.get_rank(), self.engine.tp_rank)
        self.sink = VllmShardSink(self.engine)
        # The step's phases in call order, on every device (CPU too): the engine's own calls (sleep, wake,
        # update_weights, submit, ...) and the roles' ("update", role) and ("offload", role, kinds moved).
        self.events = self.engine.events
        self.bucket_bytes = cfg.rollout.reshard_bucket_mb << 20

    @dispatch(Dispatch.ONE_TO_ALL)
    def sync_weights(self) -> dict[str, float]:
        """Reshard the actor's current weights into the vLLM engine; returns this rank's reshard metrics.

        Engine phase order per step (recorded in `self.engine.events`): serving (submit ...) -> sleep(level=2) at
        `stop_server` -> ... actor update ... -> wake(("weights",)) -> reshard (update_weights per bucket) ->
        wake(("kv_cache",)) at the next `start_server` -> serving.
        """
        return self._reshard()

    def _refill_weights(self) -> None:
        self._reshard()

    def _reshard(self) -> dict[str, float]:
        # Weights only: the KV cache is allocated after the reshard (`start_server`), so the reshard's buffers and the
        # actor's weights never share the GPU with it. Never write into a sleeping engine's weights.
        self._wake(("weights",))
        self.offload["actor"].before_use(("params",))  # gradients and optimizer state stay in host memory
        sources = actor_sync_sources(self.actor.engine)  # global layer and expert names; LoRA merged
        report = execute_reshard(self.plan, sources, self.sink,
                                 bucket_bytes=self.bucket_bytes, verify=self.cfg.rollout.verify_sync)
        # the actor's last use in a step: its parameters (per actor.offload) make room for the rollout
        moved = self._offload("actor", self.offload["actor"].after_use)
        return {**report.as_metrics(), "offload/actor_bytes": float(moved)}

    @dispatch(Dispatch.RANK_ZERO)
    def process_info(self) -> dict[str, object]:
        """Where this worker runs (for logs): pid, rank, the actor's layout, the engine's replica."""
        return {
            "pid": os.getpid(), "rank": dist.get_rank(), "world_size": dist.get_world_size(),
            "actor_layout": self.actor.groups.topology.describe(), "rollout_replicas": self.engine.replicas,
        }
