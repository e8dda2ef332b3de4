"""Ray single controller: resource pools (placement groups), worker groups (one actor per device slot forming one
torch.distributed world) and dispatch modes declared on worker methods.

    pool = ResourcePool("actor_pool", nodes=1, devices_per_node=8, device="cuda")
    group = WorkerGroup(pool, HybridWorker, cfg)          # every rank: init_distributed(), HybridWorker(cfg)
    old_logp = group.compute_log_probs(batch)             # @dispatch(DP_SPLIT) on HybridWorker.compute_log_probs
    group.shutdown()

The request-level rollout path (engines as servers, a router over them): `megarl.controller.serving`, on
`WorkerGroup.rank_call` (one rank alone, beside the SPMD calls).
"""

from megarl.controller.dispatch import (
    ALL_TO_ALL,
    DP_SPLIT,
    DP_SPLIT_MINI_BATCHES,
    LAST_STAGE_FIRST_RESULT,
    ONE_TO_ALL,
    RANK_ZERO,
    Dispatch,
    DispatchError,
    dispatch,
)
from megarl.controller.resource_pool import ResourceError, ResourcePool
from megarl.controller.shares import BatchShares
from megarl.controller.worker_group import CallTimeout, PendingCall, WorkerError, WorkerGroup

__all__ = [
    "ALL_TO_ALL",
    "BatchShares",
    "DP_SPLIT",
    "DP_SPLIT_MINI_BATCHES",
    "LAST_STAGE_FIRST_RESULT",
    "ONE_TO_ALL",
    "RANK_ZERO",
    "CallTimeout",
    "Dispatch",
    "PendingCall",
    "DispatchError",
    "ResourceError",
    "ResourcePool",
    "WorkerError",
    "WorkerGroup",
    "dispatch",
]
