"""What a device slot of a pool runs, as composable hosts (one instance per rank; every dispatch method SPMD; the
request server's `server_submit` / `server_abort` / `server_poll` are per-rank calls on a replica's first rank):

  RoleHost      role_host.py     the Megatron roles placed on the pool, their offload policies, checkpoints and the
                                 controller-callable role methods (compute_log_probs, compute_ref_log_probs,
                                 compute_values, score, update_actor, update_critic), written once
  RoleWorker    role_host.py     a RoleHost only: a critic, reference or reward model on a pool of its own
  RolloutHost   rollout_host.py  the vLLM engine, its sleep/wake bookkeeping, the request server
                                 (`start_server` .. `stop_server`), /dev/shm segments
  HybridWorker  hybrid.py        RoleHost + RolloutHost + the local reshard (the colocated "hybrid engine")
  ActorWorker   pool_sync.py     RoleHost on the actor's pool when the engines have a pool of their own; sends weights
  RolloutWorker pool_sync.py     RolloutHost on the rollout pool (`rollout.pool`) + the weight receiver
  OffloadPolicy offload.py       a role's `offload` flags applied between the phases of a step

Names are imported lazily (`from megarl.workers import HybridWorker`): building a worker imports megatron-core and
vLLM, which the controller never needs.
"""

from __future__ import annotations

import importlib

_HOMES = {"RoleHost": "role_host", "RoleWorker": "role_host", "RolloutHost": "rollout_host",
          "HybridWorker": "hybrid", "OffloadPolicy": "offload",
          "ActorWorker": "pool_sync", "RolloutWorker": "pool_sync", "JudgeHost": "judge_host"}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(f"megarl.workers.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'megarl.workers' has no attribute {name!r}")
