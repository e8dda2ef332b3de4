"""`RoleWorker`: a Megatron role on its own resource pool (critic, reference or reward model away from the actor).

HybridFlow's heterogeneous placement: a role in another pool gets its own worker group, its own torch.distributed
world (its ranks start at 0) and its own layout and model size. The controller passes it batches like any other
group; calls on different pools can overlap (`group.method.submit(...)`). Method names match `HybridWorker`'s, so
the trainer addresses a role the same way wherever it is placed.
"""

from __future__ import annotations

import os
from typing import Optional

import torch.distributed as dist

from megarl.config.schema import JobConfig
from megarl.controller.dispatch import Dispatch, dispatch
from megarl.data.batch import Batch
from megarl.trainer.offload_policy import OffloadPolicy


class RoleWorker:
    """One rank of a role's own pool."""

    def __init__(self, cfg: JobConfig, role: str) -> None:
        """`cfg`: the whole job config (the role reads `cfg.role(role)`: model, layout, optimizer, offload).
        `role`: 'critic', 'reference' or 'reward_model'. Collective over the pool: every rank builds its share."""
        if role not in ("critic", "reference", "reward_model"):
            raise ValueError(f"RoleWorker hosts critic, reference or reward_model, not {role!r}")
        self.role_name = role
        self.pool = cfg.role(role).pool
        from megarl.roles.factory import build_role  # megatron-core: imported on the workers, not the controller

        self.role = build_role(cfg, role, rank_offset=0)
        self.offload = OffloadPolicy(self.role, cfg.role(role).offload)

    def _need(self, name: str):
        if self.role_name != name:
            raise RuntimeError(f"this worker group hosts the {self.role_name}, not the {name}")
        self.offload.before_use()
        return self.role

    def role_dp(self) -> tuple[int, int]:
        """(this rank's DP rank, DP size) of the hosted role: the replicas of its DP_SPLIT calls."""
        return self.role.dp_rank, self.role.dp

    @dispatch(Dispatch.DP_SPLIT, replica_attr="role_dp")
    def compute_values(self, batch: Batch) -> Optional[Batch]:
        """`batch`: this DP rank's share of the step's samples (input_ids, attention_mask, response_mask [b, S]),
        cut by the controller -> values [b, S] float32 (token-aligned, 0 outside the response) on the last stage;
        the controller concatenates the shares."""
        return self._need("critic").compute_values(batch, share=True)

    @dispatch(Dispatch.RANK_ZERO)
    def update_critic(self, batch: Batch) -> dict[str, float]:
        """`batch`: as `compute_values` plus old_values and returns [B, S] float32 -> the critic's update metrics
        (value_loss, value_clip_frac, value_mean, grad_norm, lr, tokens, ...) from rank 0."""
        out = self._need("critic").update(batch)
        self.offload.after_use()
        return out

    @dispatch(Dispatch.DP_SPLIT, replica_attr="role_dp")
    def compute_ref_log_probs(self, batch: Batch) -> Optional[Batch]:
        """`batch`: this DP rank's share, input_ids, attention_mask, response_mask [b, S] -> the reference's
        log_probs [b, S] float32 of each response token (0 elsewhere) on the last stage; shares concatenated."""
        out = self._need("reference").compute_log_probs(batch, with_entropy=False, share=True)
        self.offload.after_use()
        return out

    @dispatch(Dispatch.DP_SPLIT, replica_attr="role_dp")
    def score(self, batch: Batch) -> Optional[Batch]:
        """`batch`: this DP rank's share, input_ids, attention_mask [b, S] -> reward-model scores [b] float32 read at
        each sequence's last real token, on the last stage; shares concatenated by the controller."""
        out = self._need("reward_model").score(batch, share=True)
        self.offload.after_use()
        return out

    @dispatch(Dispatch.RANK_ZERO)
    def save_checkpoint(self, step_dir: str) -> list[str]:
        """Save the critic (the only trainable role a pool of its own can hold) under `step_dir`/critic with its
        optimizer state, and this process's RNG states; returns the names saved ([] for a frozen role)."""
        if self.role_name != "critic":
            return []
        self.offload.before_use()
        from megarl.checkpoint.dist_ckpt import save_engine_checkpoint
        from megarl.checkpoint.train_state import save_rng

        save_engine_checkpoint(self.role.engine, os.path.join(step_dir, "critic"), with_optimizer=True)
        save_rng(step_dir, self.pool, dist.get_rank(), self._rng_layout())
        return ["critic"]

    @dispatch(Dispatch.RANK_ZERO)
    def load_checkpoint(self, step_dir: str) -> list[str]:
        """Load the critic from `step_dir`/critic (any layout; its optimizer too when saved with it); returns the
        names loaded ([] for a frozen role), marked '+optimizer' when the optimizer state was restored."""
        if self.role_name != "critic":
            return []
        self.offload.before_use()
        path = os.path.join(step_dir, "critic")
        from megarl.checkpoint.dist_ckpt import has_optimizer_state, load_engine_checkpoint
        from megarl.checkpoint.train_state import load_rng

        full = has_optimizer_state(path)
        load_engine_checkpoint(self.role.engine, path, with_optimizer=full)
        load_rng(step_dir, self.pool, dist.get_rank(), self._rng_layout())
        return ["critic+optimizer" if full else "critic"]

    def _rng_layout(self) -> str:
        return f"world {dist.get_world_size()}; {self.role_name} {self.role.groups.topology.describe()}"
