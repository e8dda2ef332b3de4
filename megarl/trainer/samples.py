"""Rollout samples -> the `Batch` the Megatron roles consume (pure, controller side): the single-turn special case
of `megarl.data.trajectory.trajectories_to_batch`, kept for callers that hold `RolloutSample`s.

Each sample becomes one row: prompt tokens then response tokens, right-padded with `pad_id` to the longest row.
The mask of the response tokens (what is trained and scored) is returned under its legacy name `response_mask`,
which the roles accept as an alias of `loss_mask` (`megarl.data.batch`); `group_ids` [B] int64 numbers the prompts
0, 1, ... in order of first appearance (the GRPO/RLOO group); `rollout_log_probs` keeps vLLM's log-probs of the
sampled tokens, token-aligned; `policy_version` [B, S] int64 is `policy_version` on response tokens and -1
elsewhere. When the engine captured routing (`algorithm.router_replay: rollout`), `rollout_routed_experts`
[B, S, L, k] int64 and `rollout_routing_mask` [B, S] int64 as `trajectories_to_batch` lays them out.
"""

from __future__ import annotations

from typing import Optional, Sequence

from megarl.controller.dispatch import chunk_bounds  # noqa: F401  (how a step's prompts are shared among replicas)
from megarl.data.batch import Batch
from megarl.data.trajectory import Trajectory, trajectories_to_batch
from megarl.rollout.engine import RolloutSample


def samples_to_trajectories(samples: Sequence[RolloutSample], policy_version: int = 0,
                            uid_prefix: str = "",
                            token_versions: Optional[Sequence[Sequence[int]]] = None) -> list[Trajectory]:
    """`Trajectory.from_rollout_sample` of each sample, in order; group uid "<uid_prefix><prompt_index>". Every
    response token has `policy_version`, or, with `token_versions`, token t of sample i has token_versions[i][t]
    (partial rollouts). Raises ValueError on an empty list or an empty prompt (naming the sample)."""
    if not samples:
        raise ValueError("no rollout samples to train on (were all prompts dropped as overlong?)")
    for i, s in enumerate(samples):
        if not s.prompt_ids:
            raise ValueError(f"sample {i} has an empty prompt: a response needs at least one prompt token")
    if token_versions is not None and len(token_versions) != len(samples):
        raise ValueError(f"{len(samples)} samples but {len(token_versions)} per-token version lists")
    return [Trajectory.from_rollout_sample(
        s, policy_version=policy_version if token_versions is None else token_versions[i],
        group_uid=f"{uid_prefix}{s.prompt_index}") for i, s in enumerate(samples)]


def samples_to_batch(samples: Sequence[RolloutSample], pad_id: int = 0, policy_version: int = 0) -> Batch:
    """Rows in the order given (module docstring). Raises ValueError on an empty list (a step with no samples must
    be reported)."""
    batch = trajectories_to_batch(samples_to_trajectories(samples, policy_version), pad_id)
    tensors = dict(batch.tensors)
    tensors["response_mask"] = tensors.pop("loss_mask")
    return Batch(tensors, batch.meta)
