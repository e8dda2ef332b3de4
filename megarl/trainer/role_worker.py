"""`RoleWorker`: a Megatron role on its own resource pool (critic, reference or reward model away from the actor).

HybridFlow's heterogeneous placement: a role in another pool gets its own worker group, its own torch.distributed
world (its ranks start at 0) and its own layout and model size. The controller passes it batches like any other
group; calls on different pools can overlap (`group.method.submit(...)`). Method names match `HybridWorker`'s, so
the trainer addresses a role the same way wherever it is placed.
"""

from __future__ import annotations

from typing import Optional

from megarl.config.schema import JobConfig
from megarl.controller.dispatch import Dispatch, dispatch
from megarl.data.batch import Batch
from megarl.roles.factory import build_role
from megarl.trainer.offload_policy import OffloadPolicy


class RoleWorker:
    """One rank of a role's own pool."""

    def __init__(self, cfg: JobConfig, role: str) -> None:
        if role not in ("critic", "reference", "reward_model"):
            raise ValueError(f"RoleWorker hosts critic, reference or reward_model, not {role!r}")
        self.role_name = role
        self.role = build_role(cfg, role, rank_offset=0)
        self.offload = OffloadPolicy(self.role, cfg.role(role).offload)

    def _need(self, name: str):
        if self.role_name != name:
            raise RuntimeError(f"this worker group hosts the {self.role_name}, not the {name}")
        self.offload.before_use()
        return self.role

    @dispatch(Dispatch.LAST_STAGE_FIRST_RESULT)
    def compute_values(self, batch: Batch) -> Optional[Batch]:
        return self._need("critic").compute_values(batch)

    @dispatch(Dispatch.RANK_ZERO)
    def update_critic(self, batch: Batch) -> dict[str, float]:
        out = self._need("critic").update(batch)
        self.offload.after_use()
        return out

    @dispatch(Dispatch.LAST_STAGE_FIRST_RESULT)
    def compute_ref_log_probs(self, batch: Batch) -> Optional[Batch]:
        out = self._need("reference").compute_log_probs(batch, with_entropy=False)
        self.offload.after_use()
        return out

    @dispatch(Dispatch.LAST_STAGE_FIRST_RESULT)
    def score(self, batch: Batch) -> Optional[Batch]:
        """Reward-model scores [B] read at each sequence's last real token."""
        out = self._need("reward_model").score(batch)
        self.offload.after_use()
        return out

    @dispatch(Dispatch.RANK_ZERO)
    def save_checkpoint(self, step_dir: str) -> list[str]:
        import os

        from megarl.checkpoint.dist_ckpt import save_engine_checkpoint

        if self.role_name != "critic":
            return []
        self.offload.before_use()
        save_engine_checkpoint(self.role.engine, os.path.join(step_dir, "critic"))
        return ["critic"]

    @dispatch(Dispatch.RANK_ZERO)
    def load_checkpoint(self, step_dir: str) -> list[str]:
        import os

        from megarl.checkpoint.dist_ckpt import load_engine_checkpoint

        if self.role_name != "critic":
            return []
        self.offload.before_use()
        load_engine_checkpoint(self.role.engine, os.path.join(step_dir, "critic"))
        return ["critic"]
