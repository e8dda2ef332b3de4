"""`HybridWorker`: everything one device slot of the actor's pool runs (the colocated "hybrid engine").

One instance per rank of the actor's pool, all in one torch.distributed world. It owns:
  - the Megatron roles placed on this pool (the actor; reference, critic and reward model when enabled and placed
    on the actor's pool -- roles on other pools run in a `RoleWorker` group), built from the job config
    at their configured layouts (`megarl.roles.factory.build_role`), HF weights loaded directly;
  - the vLLM rollout engine (one replica per `rollout.tp` consecutive ranks), built with random weights: its
    weights only ever come from the actor through the reshard, before the first rollout and after every update;
  - the reshard plan (actor layout -> rollout TP), built once.
Every method is SPMD: the controller calls it on every rank (`megarl.controller` dispatch), because the roles'
collectives need all ranks. Data path of one RL step (controller view):
  prompts -> `generate` (DP_SPLIT: a replica receives its chunk) -> rewards (controller) -> Batch -> `compute_log_probs`
  (+ `compute_ref_log_probs`, `compute_values`) -> advantages (controller) -> `update_critic`, `update_actor`
  -> `sync_weights` (reshard into vLLM for the next rollout).
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch.distributed as dist

from megarl.config.schema import JobConfig
from megarl.controller.dispatch import Dispatch, dispatch
from megarl.data.batch import Batch
from megarl.platform.device import empty_device_cache
from megarl.reshard.executor import execute_reshard
from megarl.reshard.layouts import TrainLayout
from megarl.reshard.planner import check_engine_mapping, plan_reshard
from megarl.reshard.sources import megatron_sources
from megarl.reshard.vllm_sink import VllmShardSink
from megarl.rollout.engine import SamplingSettings
from megarl.trainer.offload_policy import OffloadPolicy

logger = logging.getLogger("megarl.trainer")
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


class HybridWorker:
    """One rank of the actor's pool: Megatron roles + vLLM engine + reshard (see module docstring)."""

    def __init__(self, cfg: JobConfig, engine_model_dir: str) -> None:
        from megarl.rollout.vllm_adapter import VllmEngineSettings, VllmRolloutEngine
        from megarl.trainer import check_supported

        check_supported(cfg)
        self.cfg = cfg
        # This pool is its own torch.distributed world: roles start at rank 0 in it.
        from megarl.roles.factory import build_role  # megatron-core: imported on the workers, not the controller

        self.actor = build_role(cfg, "actor", rank_offset=0)

        def colocated(role: str):
            r = cfg.role(role)
            return build_role(cfg, role, rank_offset=0) if r.enabled and r.pool == cfg.actor.pool else None

        self.reference = colocated("reference")
        self.critic = colocated("critic")
        self.reward_model = colocated("reward_model")
        self.offload = {
            "actor": OffloadPolicy(self.actor, cfg.actor.offload),
            "reference": OffloadPolicy(self.reference, cfg.reference.offload),
            "critic": OffloadPolicy(self.critic, cfg.critic.offload),
            "reward_model": OffloadPolicy(self.reward_model, cfg.reward_model.offload),
        }
        # vLLM sizes its memory from what is free when it starts: the Megatron roles' offloadable state goes to host
        # first, and the allocator's cached blocks are returned (they would count as used). Each role comes back
        # on its first use.
        for policy in self.offload.values():
            policy.after_use()
        empty_device_cache()
        self.engine = VllmRolloutEngine(VllmEngineSettings.from_config(
            cfg.rollout, engine_model_dir, load_format="dummy", dtype=VLLM_DTYPES[cfg.model.dtype],
            return_routed_experts=cfg.algorithm.router_replay == "rollout",
        ))
        # Element size of the weights on the wire: the model dtype's (a CPU bf16 engine keeps fp32 norms, cast).
        elem = ELEMENT_BYTES[cfg.model.dtype]
        # The engine's mapping (vLLM's external launcher: TP rank = position in the block), checked, not searched.
        self.plan = plan_reshard(self.actor.engine.spec, self.actor.groups.topology, cfg.rollout.tp, dtype_bytes=elem,
                                 search_mapping=False, train_layout=TrainLayout.from_parallel(cfg.actor.parallel),
                                 infer_ep=cfg.rollout.ep)
        check_engine_mapping(self.plan, dist.get_rank(), self.engine.tp_rank)
        self.sink = VllmShardSink(self.engine)
        # The step's phases in call order, on every device (CPU too): the engine's own calls (sleep, wake,
        # update_weights, generate) and this worker's ("update", role) and ("offload", role, kinds moved).
        self.events = self.engine.events
        self._awake = {"weights", "kv_cache"}  # the parts of the engine that are awake (a new engine: all)
        self.bucket_bytes = cfg.rollout.reshard_bucket_mb << 20

    # ------------------------------------------------------------------------------------------- rollout
    @dispatch(Dispatch.ONE_TO_ALL)
    def sync_weights(self) -> dict[str, float]:
        """Reshard the actor's current weights into the vLLM engine; returns this rank's reshard metrics.

        Engine phase order per step (recorded in `self.engine.events`): generate -> sleep(level=2) -> ... actor
        update ... -> wake(("weights",)) -> reshard (update_weights per bucket) -> wake(("kv_cache",)) -> generate.
        """
        return self._reshard()

    def _reshard(self) -> dict[str, float]:
        # Weights only: the KV cache is allocated after the reshard (`generate`), so the reshard's buffers and the
        # actor's weights never share the GPU with it. Never write into a sleeping engine's weights.
        self._wake(("weights",))
        self.offload["actor"].before_use(("params",))  # gradients and optimizer state stay in host memory
        sources = megatron_sources(self.actor.engine)  # global layer and expert names
        report = execute_reshard(self.plan, sources, self.sink,
                                 bucket_bytes=self.bucket_bytes, verify=self.cfg.rollout.verify_sync)
        # the actor's last use in a step: its parameters (per actor.offload) make room for the rollout
        moved = self._offload("actor", self.offload["actor"].after_use)
        return {**report.as_metrics(), "offload/actor_bytes": float(moved)}

    def _offload(self, role: str, how) -> int:
        """Run an `OffloadPolicy` method; record ("offload", role, kinds now in host memory) when it moved bytes."""
        moved = how()
        if moved:
            self.events.append(("offload", role, tuple(getattr(self, role).engine.offloaded)))
        return moved

    def rollout_replica(self) -> tuple[int, int]:
        """(this rank's rollout replica, number of replicas): replica = rank // rollout.tp (DP_SPLIT of `generate`)."""
        return self.engine.replica_index, self.engine.replicas

    @dispatch(Dispatch.DP_SPLIT, replica_attr="rollout_replica")
    def generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> Optional[dict]:
        """Sample responses for `prompts` (token ids): this replica's contiguous chunk of the step's prompts, cut by
        the controller (`megarl.controller.dispatch.chunk_bounds`); every TP rank of the replica receives the same
        chunk and only it.

        Returns, on the first rank of each replica (None on the others): {"samples": [RolloutSample with
        prompt_index local to the chunk], "dropped": [local prompt indices], "truncated": [...]}; the controller
        adds the chunk's offset. GPU: the engine is woken for the rollout and put back to sleep after it, freeing
        memory for training.
        """
        if "weights" not in self._awake and self.engine.sleep_discards_weights:
            self._reshard()  # a rollout without a sync since the last one (validation): the weights were dropped
        self._wake(("weights", "kv_cache"))
        try:
            out = self.engine.generate(prompts, sampling)
        finally:
            # GPU: level 2 drops weights and KV cache without copying the weights to host: the next sync_weights
            # overwrites every weight anyway (a full reshard; level 1 would copy the model to host and back).
            self.engine.sleep(level=2)
            self._awake.clear()
        if self.engine.tp_rank != 0:
            return None
        return {
            "samples": list(out),
            "dropped": list(out.dropped_prompt_indices),
            "truncated": list(out.truncated_prompt_indices),
        }

    def _use(self, role: str, fn):
        """Run `fn` with `role`'s state on the device, then offload it again if its config asks to."""
        self.offload[role].before_use()
        out = fn()
        self._offload(role, self.offload[role].after_use)
        return out

    def _wake(self, tags: tuple[str, ...]) -> None:
        """Wake the parts of the engine in `tags` ("weights", "kv_cache") that are asleep."""
        asleep = tuple(t for t in tags if t not in self._awake)
        if asleep:
            self.engine.wake(asleep)
            self._awake.update(asleep)

    # ------------------------------------------------------------------------------------------- Megatron roles
    def _dp_coord(self, role: str) -> tuple[int, int]:
        r = getattr(self, role)
        if r is None:
            raise RuntimeError(f"no {role} role on this pool")
        return r.dp_rank, r.dp

    def actor_dp(self) -> tuple[int, int]:
        """(this rank's actor DP rank, actor DP size): the replicas of the actor's DP_SPLIT calls."""
        return self._dp_coord("actor")

    def reference_dp(self) -> tuple[int, int]:
        return self._dp_coord("reference")

    def critic_dp(self) -> tuple[int, int]:
        return self._dp_coord("critic")

    def reward_model_dp(self) -> tuple[int, int]:
        return self._dp_coord("reward_model")

    @dispatch(Dispatch.DP_SPLIT, replica_attr="actor_dp")
    def compute_log_probs(self, batch: Batch) -> Optional[Batch]:
        """`batch`: this actor DP rank's share (cut by the controller; the same on its TP ranks and pipeline stages)
        -> actor log-probs (and entropy) of its tokens, token-aligned [b, S]; None off the last stage. The controller
        concatenates the shares in order."""
        self.offload["actor"].before_use()
        return self.actor.compute_log_probs(batch, share=True)

    @dispatch(Dispatch.DP_SPLIT, replica_attr="reference_dp")
    def compute_ref_log_probs(self, batch: Batch) -> Optional[Batch]:
        """As `compute_log_probs`, with the reference's DP split; log_probs only."""
        if self.reference is None:
            raise RuntimeError("reference.enabled is false: no reference role to compute log-probs with")
        return self._use("reference", lambda: self.reference.compute_log_probs(batch, with_entropy=False, share=True))

    @dispatch(Dispatch.DP_SPLIT, replica_attr="critic_dp")
    def compute_values(self, batch: Batch) -> Optional[Batch]:
        """This critic DP rank's share -> values [b, S] float32 (last stage; None elsewhere)."""
        if self.critic is None:
            raise RuntimeError("critic.enabled is false: no critic to compute values with")
        self.offload["critic"].before_use()
        return self.critic.compute_values(batch, share=True)

    @dispatch(Dispatch.DP_SPLIT, replica_attr="reward_model_dp")
    def score(self, batch: Batch) -> Optional[Batch]:
        """This reward-model DP rank's share -> scores [b] (when the reward model is colocated with the actor)."""
        if self.reward_model is None:
            raise RuntimeError("no reward model in the actor's pool")
        return self._use("reward_model", lambda: self.reward_model.score(batch, share=True))

    @dispatch(Dispatch.RANK_ZERO)
    def update_actor(self, batch: Batch) -> dict[str, float]:
        """PPO/GSPO update of the actor over mini- and micro-batches (`actor.update`).

        `batch`: the whole step's batch on every rank (each rank takes its DP share inside the role): input_ids,
        attention_mask, response_mask [B, S] int64; old_log_probs, advantages [B, S] float32; ref_log_probs with
        KL in the loss; rollout_log_probs with rollout correction. Returns the update's metrics (loss, KL, clip
        fraction, entropy, grad_norm, lr), identical on every rank. Afterwards the actor's gradients and optimizer
        state go to host memory when `actor.offload` asks for them: the reshard reads only the parameters.
        """
        self.offload["actor"].before_use()
        metrics = self.actor.update(batch)
        self.events.append(("update", "actor"))
        self._offload("actor", self.offload["actor"].after_update)
        return metrics

    @dispatch(Dispatch.RANK_ZERO)
    def update_critic(self, batch: Batch) -> dict[str, float]:
        """Value-loss update of the colocated critic (`critic.update`). `batch` as in `update_actor`, with returns and
        old_values [B, S] float32 instead of the policy keys; metrics identical on every rank. The critic is
        offloaded afterwards per `critic.offload`."""
        if self.critic is None:
            raise RuntimeError("critic.enabled is false: no critic to update")
        return self._use("critic", lambda: self.critic.update(batch))

    # ------------------------------------------------------------------------------------------- checkpoints
    @dispatch(Dispatch.RANK_ZERO)
    def save_checkpoint(self, step_dir: str) -> list[str]:
        """Full-state checkpoints of the trained roles under `step_dir` (actor/, critic/: weights, distributed
        optimizer, LR scheduler, step counter; each atomic) and this process's RNG states (`rng/`)."""
        from megarl.checkpoint.dist_ckpt import save_engine_checkpoint
        from megarl.checkpoint.train_state import save_rng

        saved = []
        for name, role in (("actor", self.actor), ("critic", self.critic)):
            if role is not None:
                self.offload[name].before_use()
                save_engine_checkpoint(role.engine, os.path.join(step_dir, name), hf_dir=self.cfg.model.path,
                                       with_optimizer=True)
                saved.append(name)
        save_rng(step_dir, self.cfg.actor.pool, dist.get_rank(), self._rng_layout())
        return saved

    @dispatch(Dispatch.RANK_ZERO)
    def load_checkpoint(self, step_dir: str) -> list[str]:
        """Load the trained roles from `step_dir` (any layout they were saved at): weights, and the optimizer,
        scheduler and step counter when the checkpoint has them (`has_optimizer_state`); RNG states when saved at
        this layout. Returns the roles loaded, each marked '+optimizer' when its optimizer state was restored."""
        from megarl.checkpoint.dist_ckpt import has_optimizer_state, load_engine_checkpoint
        from megarl.checkpoint.train_state import load_rng

        loaded = []
        for name, role in (("actor", self.actor), ("critic", self.critic)):
            if role is not None:
                self.offload[name].before_use()
                path = os.path.join(step_dir, name)
                full = has_optimizer_state(path)
                load_engine_checkpoint(role.engine, path, with_optimizer=full)
                loaded.append(name + ("+optimizer" if full else ""))
        status = load_rng(step_dir, self.cfg.actor.pool, dist.get_rank(), self._rng_layout())
        if status != "restored":
            logger.warning("rank %d RNG states %s", dist.get_rank(), status)
        return loaded

    def _rng_layout(self) -> str:
        roles = ("actor", "reference", "critic", "reward_model")
        return f"world {dist.get_world_size()}; " + "; ".join(
            f"{n} {getattr(self, n).groups.topology.describe()}" for n in roles if getattr(self, n) is not None)

    @dispatch(Dispatch.ONE_TO_ALL)
    def shm_segments(self) -> dict[str, object]:
        """This rank's host name, pid and the /dev/shm segments its vLLM engine created
        (`VllmRolloutEngine.shm_segments`), for the controller to remove after the workers are gone."""
        import socket

        return {"host": socket.gethostname(), "pid": os.getpid(), "names": self.engine.shm_segments()}

    @dispatch(Dispatch.RANK_ZERO)
    def process_info(self) -> dict[str, object]:
        """Where this worker runs (for logs): pid, rank, the actor's layout, the engine's replica."""
        import torch.distributed as dist

        return {
            "pid": os.getpid(), "rank": dist.get_rank(), "world_size": dist.get_world_size(),
            "actor_layout": self.actor.groups.topology.describe(), "rollout_replicas": self.engine.replicas,
        }
