"""A role's `offload` flags applied between the phases of an RL step.

After a role's last use in a step its chosen state (parameters, gradients, optimizer state) goes to host memory,
freeing device memory for the rollout engine; it comes back just before the role's next use. On CPU machines this is
bookkeeping only (host and device are the same memory), which the tests use to check that the state comes back
exactly.
"""

from __future__ import annotations

from typing import Optional


class OffloadPolicy:
    def __init__(self, role, flags) -> None:
        """`role`: a `megarl.roles` role (or None: no-op); `flags`: its `OffloadConfig`."""
        self.role = role
        self.flags = flags
        self.enabled = role is not None and flags is not None and (flags.params or flags.grads or flags.optimizer)

    def before_use(self, kinds: Optional[tuple[str, ...]] = None) -> None:
        """Bring the role's state back to the device: all of it (None), or only `kinds` (("params",) for a phase
        that only reads the weights)."""
        if self.enabled and self.role.engine.offloaded:
            self.role.reload(kinds)

    def after_update(self) -> int:
        """After a trained role's update: offload its gradients and optimizer state (per the flags), keeping the
        parameters on the device for what still reads them this step (the actor's reshard). Returns bytes moved."""
        if self.enabled and self.role.engine.trainable:
            moved = self.role.offload(params=False, grads=self.flags.grads, optimizer=self.flags.optimizer)
            return int(sum(moved.values()))
        return 0

    def after_use(self) -> int:
        """Offload per the flags (kinds already offloaded stay so); returns the bytes moved to host memory (0 when
        nothing is configured)."""
        if self.enabled:
            trained = self.role.engine.trainable
            moved = self.role.offload(params=self.flags.params, grads=self.flags.grads and trained,
                                      optimizer=self.flags.optimizer and trained)
            return int(sum(moved.values()))
        return 0
