"""The two ends of a weight sync across pools (`rollout.pool` set; `megarl.rollout.service.PoolRollout`):

  ActorWorker    one rank of the actor's pool: a `RoleHost` (the actor and any role placed on its pool, no vLLM) that
                 sends its Megatron shards over the bridge (`send_weights`); it only sends.
  RolloutWorker  one rank of the rollout pool: a `RolloutHost` (vLLM engine, replica = rank // rollout.tp of the
                 pool's own world) that receives its whole vLLM shard over the bridge (`receive_weights`); it
                 only receives. The engine never sleeps: the pool is its own.

Both ends compute the same plan (`megarl.reshard.pool_plan.plan_pool_sync`, cached) from the actor's spec and
topology, which the controller reads from the actor group (`ActorWorker.sync_source`) and hands to the rollout
group; both run `execute_reshard` concurrently over the bridge's `GroupTransport` (`megarl.controller.bridge`),
verification per `rollout.verify_sync`.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megarl.config.schema import JobConfig
from megarl.controller.bridge import Bridge, BridgeSpec, connect_bridge
from megarl.controller.dispatch import Dispatch, dispatch
from megarl.reshard.executor import execute_reshard
from megarl.reshard.planner import ReshardPlan, check_engine_mapping
from megarl.reshard.pool_plan import plan_pool_sync
from megarl.workers.role_host import ROLES, RoleHost
from megarl.workers.rollout_host import RolloutHost

WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _sync_metrics(report, plan: ReshardPlan, rank: int, version: int) -> dict[str, float]:
    """A rank's reshard report as metrics, with the pieces the plan routes into it (what `verified_pieces` must
    reach) and the weights version."""
    planned = sum(1 for op in plan.ops if op.dst == rank and op.src != rank)
    return {**report.as_metrics(), "reshard/bridge_rank": float(rank), "reshard/planned_pieces": float(planned),
            "reshard/version": float(version)}


class ActorWorker(RoleHost):
    """One rank of the actor's pool when the engines have a pool of their own (see the module docstring)."""

    def __init__(self, cfg: JobConfig) -> None:
        from megarl.config.validate import check_supported

        check_supported(cfg)
        pool = cfg.actor.pool
        super().__init__(cfg, [r for r in ROLES if r == "actor" or (cfg.role(r).enabled and cfg.role(r).pool == pool)],
                         pool)
        self.bridge: Bridge | None = None
        self.plan: ReshardPlan | None = None
        self.bucket_bytes = cfg.rollout.reshard_bucket_mb << 20

    @dispatch(Dispatch.RANK_ZERO)
    def sync_source(self) -> tuple:
        """(the actor's ModelSpec, its RoleTopology in this pool's world): what the rollout ranks plan with."""
        return self.actor.engine.spec, self.actor.groups.topology

    @dispatch(Dispatch.ONE_TO_ALL)
    def connect_bridge(self, spec: BridgeSpec) -> int:
        """Join the bridge as bridge rank = this pool rank (collective with the rollout pool's `connect_bridge`);
        plans the sync. Returns the bridge rank."""
        self.bridge = connect_bridge(spec, spec.rank("train", dist.get_rank()))
        self.plan = plan_pool_sync(self.cfg, self.actor.engine.spec, self.actor.groups.topology, spec.rollout_ranks)
        return self.bridge.rank

    @dispatch(Dispatch.ONE_TO_ALL)
    def send_weights(self, version: int) -> dict[str, float]:
        """Send this rank's share of the actor's current weights (after update `version`) to the rollout ranks the
        plan routes them to; returns this rank's reshard metrics (bytes sent, seconds). Runs concurrently with the
        rollout pool's `receive_weights` (the controller submits both)."""
        from megarl.reshard.lora_sync import actor_sync_sources

        if self.bridge is None:
            raise RuntimeError("send_weights before connect_bridge: the controller connects the bridge at start-up")
        self.offload["actor"].before_use(("params",))
        report = execute_reshard(self.plan, actor_sync_sources(self.actor.engine), None, bucket_bytes=self.bucket_bytes,
                                 transport=self.bridge.transport, rank=self.bridge.rank,
                                 verify=self.cfg.rollout.verify_sync)
        moved = self._offload("actor", self.offload["actor"].after_use)
        return {**_sync_metrics(report, self.plan, self.bridge.rank, version), "offload/actor_bytes": float(moved)}

    @dispatch(Dispatch.RANK_ZERO)
    def process_info(self) -> dict[str, object]:
        return {"pid": os.getpid(), "rank": dist.get_rank(), "world_size": dist.get_world_size(),
                "actor_layout": self.actor.groups.topology.describe()}


class RolloutWorker(RolloutHost):
    """One rank of the rollout pool: the vLLM engine + the weight receiver (see the module docstring)."""

    sleeps_between_rollouts = False  # the pool is the engine's own: nothing else needs its memory

    def __init__(self, cfg: JobConfig, engine_model_dir: str) -> None:
        from megarl.config.validate import check_supported
        from megarl.reshard.vllm_sink import VllmShardSink

        check_supported(cfg)
        RolloutHost.__init__(self, cfg, engine_model_dir)
        self.cfg = cfg
        self.sink = VllmShardSink(self.engine)
        self.bridge: Bridge | None = None
        self.plan: ReshardPlan | None = None
        self.bucket_bytes = cfg.rollout.reshard_bucket_mb << 20
        self.events = self.engine.events

    @dispatch(Dispatch.ONE_TO_ALL)
    def connect_bridge(self, spec: BridgeSpec, source: tuple) -> int:
        """Join the bridge as bridge rank T + this pool rank (collective with the actor pool's `connect_bridge`);
        plans the sync from `source` = `ActorWorker.sync_source()` and checks the engine's TP rank against it.
        Returns the bridge rank."""
        self.bridge = connect_bridge(spec, spec.rank("rollout", dist.get_rank()))
        model_spec, topology = source
        self.plan = plan_pool_sync(self.cfg, model_spec, topology, spec.rollout_ranks)
        check_engine_mapping(self.plan, self.bridge.rank, self.engine.tp_rank)
        return self.bridge.rank

    @dispatch(Dispatch.ONE_TO_ALL)
    def receive_weights(self, version: int) -> dict[str, float]:
        """Receive this rank's whole vLLM shard of the actor's weights after update `version` into the engine
        (checked piece by piece against the senders' checksums with `rollout.verify_sync`); returns this rank's
        reshard metrics (bytes received, the lower bound, pieces verified, seconds)."""
        if self.bridge is None:
            raise RuntimeError("receive_weights before connect_bridge: the controller connects the bridge at start-up")
        self._wake(("weights",))
        report = execute_reshard(self.plan, {}, self.sink, bucket_bytes=self.bucket_bytes,
                                 transport=self.bridge.transport, rank=self.bridge.rank,
                                 verify=self.cfg.rollout.verify_sync, dtype=WIRE_DTYPES[self.cfg.model.dtype])
        self.weight_version = version
        self.engine.set_weight_version(version)  # the label of the tokens sampled from now on
        return _sync_metrics(report, self.plan, self.bridge.rank, version)

    @dispatch(Dispatch.ONE_TO_ALL)
    def serve_receive_weights(self, version: int, timeout_s: float = 1800.0) -> dict[str, float]:
        """`receive_weights` while serving (`RolloutHost.start_server`): queued on this rank's server as a call at a
        round boundary (`EngineServer.call`, key "push-<version>": every TP rank of a replica runs it in the same
        round) that pauses the engine with the requests in flight kept, receives the weights over the bridge (the
        actor ranks' `send_weights` pairs with it), labels them `version` and resumes: each request in flight
        continues from its tokens under the new weights (its KV recomputed), its tokens recording their versions.
        Waits up to `timeout_s` for the round to run it. Returns `receive_weights`'s metrics plus
        `reshard/continued_requests` (requests in this rank's engine across the push) and `reshard/tp_rank`."""
        server = self._serving("serve_receive_weights")
        crossed: list[int] = []

        def push(engine) -> dict[str, float]:
            engine.pause()
            try:
                crossed.append(len(engine.in_flight))
                metrics = self.receive_weights(version)  # labels the engine's tokens `version` from now on
            finally:
                engine.resume()
            return metrics

        future = server.call(push, key=f"push-{version}")
        try:
            metrics = future.result(timeout=timeout_s)
        except TimeoutError:
            raise TimeoutError(f"serve_receive_weights: replica {self.engine.replica_index} (TP rank "
                               f"{self.engine.tp_rank}) did not run the push of version {version} within {timeout_s} "
                               "s (waited for its engine server's next round boundary and the bridge transfer)") \
                from None
        return {**metrics, "reshard/continued_requests": float(crossed[0]),
                "reshard/tp_rank": float(self.engine.tp_rank)}
