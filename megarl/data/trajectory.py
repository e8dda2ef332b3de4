"""Trajectories: the unit that leaves the rollout side, and the [B, S] `Batch` the roles train on.

A trajectory is one sequence of token ids -- the prompt, then everything after it in order: tokens the policy
sampled and, in multi-turn rollouts, context the policy did not sample (tool output, environment observations,
chat-template glue) -- with per-token annotations::

    position t:       0 .. prompt_len-1    sampled span    tool / env tokens    sampled span    ...
    token_ids         prompt               policy          environment          policy
    loss_mask         0                    1               0                    1
    log_probs         0.0                  vLLM's          0.0                  vLLM's
    policy_version    -1                   v               -1                   v'

- ``loss_mask``: 1 on the tokens the policy sampled (they are trained and scored), 0 on context (the prompt, tool
  and environment tokens). Context tokens still go through the model (they condition what follows) but never enter
  a loss, an advantage, a KL or a metric. Single-turn rollouts have one contiguous span of 1s after the prompt.
- ``log_probs``: the rollout engine's log-prob of each sampled token (vLLM's raw log-probs, nats, see
  `megarl.rollout.engine.RolloutSample`), 0.0 where ``loss_mask`` is 0.
- ``policy_version``: the weights version that sampled the token: the number of actor updates (RL steps) those
  weights had received, so the initial weights are version 0. Context tokens hold **-1** ("sampled by no policy"):
  0 is a real version, and -1 makes a staleness computed over the wrong tokens stand out. One trajectory may mix
  versions (a rollout that continues across a weight update).
- ``uid``: unique per trajectory; ``group_uid``: the GRPO group, i.e. one prompt's samples share it.
- ``routed_experts`` (MoE, when the engine captured routing): [len(token_ids) - 1, L, k] int, the k experts each of
  the model's L MoE layers chose for the tokens at positions 0..len-2 (the last token is never fed back).

`trajectories_to_batch` lays trajectories out as right-padded rows (see `megarl.data.batch` for the batch protocol).
Nothing here imports the rollout layer (it sits above data): `Trajectory.from_rollout_sample` takes a
`megarl.rollout.engine.RolloutSample` by its attributes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import torch

from megarl.data.batch import Batch
from megarl.data.token_rows import attach_ref, token_ref

CONTEXT_VERSION = -1  # `policy_version` of a token the policy did not sample (prompt, tool / env output, padding)


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """One rollout: token ids with a per-token loss mask, sampling log-probs and policy versions (module docstring).

    Attributes:
        token_ids: prompt + everything after it; int token ids, length n.
        prompt_len: tokens of the prompt (>= 1: the first sampled token needs a token before it).
        loss_mask: [n] 0/1; 0 on the prompt.
        log_probs: [n] float, nats; 0.0 where loss_mask is 0.
        policy_version: [n] int; >= 0 where loss_mask is 1, -1 (`CONTEXT_VERSION`) where it is 0.
        uid: unique id of this trajectory. group_uid: its group (one prompt's samples share it).
        finish_reason: why the rollout ended: 'stop' (EOS / stop string / stop id) or 'length' (a token limit).
        routed_experts: None, or [n - 1, L, k] int (numpy or torch), see the module docstring.
    """

    token_ids: list[int]
    prompt_len: int
    loss_mask: list[int]
    log_probs: list[float]
    policy_version: list[int]
    uid: str
    group_uid: str
    finish_reason: str
    routed_experts: Optional[Any] = None

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        lens = {"loss_mask": len(self.loss_mask), "log_probs": len(self.log_probs),
                "policy_version": len(self.policy_version)}
        if any(v != n for v in lens.values()):
            raise ValueError(f"trajectory {self.uid}: {n} token_ids but {lens}; every per-token list needs one entry "
                             "per token")
        if not 1 <= self.prompt_len <= n:
            raise ValueError(f"trajectory {self.uid}: prompt_len={self.prompt_len} outside 1..{n} (a trajectory needs "
                             "at least one prompt token before its first sampled token)")
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError(f"trajectory {self.uid}: loss_mask must hold 0/1, got {sorted(set(self.loss_mask))}")
        if any(self.loss_mask[: self.prompt_len]):
            raise ValueError(f"trajectory {self.uid}: loss_mask is 1 inside the prompt (positions < {self.prompt_len})")
        for t, (m, lp, v) in enumerate(zip(self.loss_mask, self.log_probs, self.policy_version)):
            if m and v < 0:
                raise ValueError(f"trajectory {self.uid}: sampled token {t} has policy_version {v} (needs >= 0)")
            if not m and (lp != 0.0 or v != CONTEXT_VERSION):
                raise ValueError(f"trajectory {self.uid}: context token {t} (loss_mask 0) has log_prob {lp} and "
                                 f"policy_version {v}; context tokens hold 0.0 and {CONTEXT_VERSION}")

    # ------------------------------------------------------------------------------------------- views
    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_ids(self) -> list[int]:
        return list(self.token_ids[: self.prompt_len])

    @property
    def response_ids(self) -> list[int]:
        """Everything after the prompt (sampled and context tokens alike): what a reward function decodes."""
        return list(self.token_ids[self.prompt_len:])

    @property
    def num_sampled(self) -> int:
        """Tokens the policy sampled (loss_mask 1)."""
        return sum(self.loss_mask)

    # ------------------------------------------------------------------------------------------- builders
    @classmethod
    def from_rollout_sample(cls, sample: Any, *, policy_version: "int | Sequence[int]", group_uid: Optional[str] = None,
                            uid: Optional[str] = None) -> "Trajectory":
        """A single-turn `megarl.rollout.engine.RolloutSample` (prompt_ids, response_ids, response_log_probs,
        finish_reason, prompt_index, sample_index, routed_experts) as a trajectory: loss_mask 1 on the whole
        response, every response token sampled by `policy_version` (an int), or token t of the response by
        `policy_version[t]` (a partial rollout continued across weight pushes). `group_uid` defaults to the prompt index and
        `uid` to "<group_uid>/<sample_index>" (unique within one `generate` call; pass step-qualified ids to make them
        unique across calls)."""
        p, r = len(sample.prompt_ids), len(sample.response_ids)
        if len(sample.response_log_probs) != r:
            raise ValueError(f"sample {sample.prompt_index}/{sample.sample_index}: {r} response tokens but "
                             f"{len(sample.response_log_probs)} log-probs")
        group_uid = str(sample.prompt_index) if group_uid is None else group_uid
        versions = [int(policy_version)] * r if isinstance(policy_version, int) else [int(v) for v in policy_version]
        if len(versions) != r:
            raise ValueError(f"sample {sample.prompt_index}/{sample.sample_index}: {r} response tokens but "
                             f"{len(versions)} policy versions")
        return attach_ref(cls(
            token_ids=list(sample.prompt_ids) + list(sample.response_ids),
            prompt_len=p,
            loss_mask=[0] * p + [1] * r,
            log_probs=[0.0] * p + [float(x) for x in sample.response_log_probs],
            policy_version=[CONTEXT_VERSION] * p + versions,
            uid=f"{group_uid}/{sample.sample_index}" if uid is None else uid,
            group_uid=group_uid,
            finish_reason=sample.finish_reason,
            routed_experts=sample.routed_experts,
        ), token_ref(sample))  # the rollout's package of this very completion (`megarl.data.token_rows`)


class TrajectoryBuilder:
    """Build a trajectory by appending tokens as they come: what the policy sampled (`sampled`) and what it did not
    (`context`: tool output, environment observations, template glue). Token ids, never text.

        t = (TrajectoryBuilder([1, 2, 3], uid="a/0", group_uid="a")
             .sampled([7, 8], [-0.1, -0.2], policy_version=4).context([50, 51, 52])
             .sampled([9], [-0.3], policy_version=4).build("stop"))
    """

    def __init__(self, prompt_ids: Sequence[int], *, uid: str, group_uid: str) -> None:
        self.prompt_len = len(prompt_ids)
        self.uid, self.group_uid = uid, group_uid
        self.token_ids = list(prompt_ids)
        self.loss_mask = [0] * self.prompt_len
        self.log_probs = [0.0] * self.prompt_len
        self.policy_version = [CONTEXT_VERSION] * self.prompt_len

    def sampled(self, ids: Sequence[int], log_probs: Sequence[float],
                policy_version: "int | Sequence[int]") -> "TrajectoryBuilder":
        """Append tokens the policy sampled, with the rollout engine's log-probs (nats) and the weights version: one
        for all of them, or [len(ids)] per token (a request that ran across a weight push)."""
        if len(ids) != len(log_probs):
            raise ValueError(f"{len(ids)} sampled tokens but {len(log_probs)} log-probs")
        versions = [int(v) for v in policy_version] if isinstance(policy_version, (list, tuple)) else \
            [int(policy_version)] * len(ids)
        if len(versions) != len(ids):
            raise ValueError(f"{len(ids)} sampled tokens but {len(versions)} per-token versions")
        self.token_ids += list(ids)
        self.loss_mask += [1] * len(ids)
        self.log_probs += [float(x) for x in log_probs]
        self.policy_version += versions
        return self

    def context(self, ids: Sequence[int]) -> "TrajectoryBuilder":
        """Append tokens the policy did not sample (loss_mask 0)."""
        self.token_ids += list(ids)
        self.loss_mask += [0] * len(ids)
        self.log_probs += [0.0] * len(ids)
        self.policy_version += [CONTEXT_VERSION] * len(ids)
        return self

    def build(self, finish_reason: str, routed_experts: Optional[Any] = None) -> Trajectory:
        return Trajectory(list(self.token_ids), self.prompt_len, list(self.loss_mask), list(self.log_probs),
                          list(self.policy_version), self.uid, self.group_uid, finish_reason, routed_experts)


def trajectories_to_batch(trajectories: Sequence[Trajectory], pad_id: int = 0) -> Batch:
    """Row i = trajectories[i], right-padded with `pad_id` to the longest (S = its length). Pure, controller side.

    Returns a `Batch` with:
        input_ids [B, S] int64: token ids, `pad_id` after the end.
        attention_mask [B, S] int64: 1 on the trajectory's tokens (a prefix of ones).
        loss_mask [B, S] int64: the trajectories' loss masks, 0 on padding.
        rollout_log_probs [B, S] float32: the rollout engine's log-probs, token-aligned, 0 where loss_mask is 0.
        policy_version [B, S] int64: the weights version per token, -1 on context tokens and padding.
        group_ids [B] int64: 0, 1, ... in order of each `group_uid`'s first appearance (the GRPO/RLOO group).
        rollout_routed_experts [B, S, L, k] int64 and rollout_routing_mask [B, S] int64: only when the trajectories
            carry `routed_experts` (all of them or none): the experts per token at positions 0..n-2 (mask 1 there;
            0 at the last token and on padding, whose experts are 0).
    Raises ValueError on an empty list (a step with nothing to train on must be reported).
    """
    if not trajectories:
        raise ValueError("no trajectories to train on (were all prompts dropped as overlong?)")
    B, S = len(trajectories), max(len(t) for t in trajectories)
    lengths = torch.tensor([len(t) for t in trajectories], dtype=torch.long)
    # the B x S positions that hold a token (a prefix of each row), in row-major order: each key's rows, concatenated,
    # land there with one masked assignment (one tensor per key instead of one per row and key)
    tokens = torch.arange(S)[None, :] < lengths[:, None]
    attention_mask = tokens.long()

    def laid_out(fill: float, dtype: torch.dtype, per_row: Callable[[Trajectory], Sequence]) -> torch.Tensor:
        out = torch.full((B, S), fill, dtype=dtype)
        out[tokens] = torch.tensor([x for t in trajectories for x in per_row(t)], dtype=dtype)
        return out

    input_ids = laid_out(pad_id, torch.long, lambda t: t.token_ids)
    loss_mask = laid_out(0, torch.long, lambda t: t.loss_mask)
    rollout_log_probs = laid_out(0.0, torch.float32, lambda t: t.log_probs)
    policy_version = laid_out(CONTEXT_VERSION, torch.long, lambda t: t.policy_version)
    group_index: dict[str, int] = {}
    for t in trajectories:
        group_index.setdefault(t.group_uid, len(group_index))
    group_ids = torch.tensor([group_index[t.group_uid] for t in trajectories], dtype=torch.long)
    out = {
        "input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask,
        "rollout_log_probs": rollout_log_probs, "policy_version": policy_version, "group_ids": group_ids,
    }
    with_routing = [t.routed_experts is not None for t in trajectories]
    if any(with_routing):
        if not all(with_routing):
            raise ValueError(f"{with_routing.count(False)} of {B} samples carry no routed experts: the rollout "
                             "engine captured routing for some samples only")
        out.update(_rollout_routing(trajectories, S))
    return Batch(out)


def _rollout_routing(trajectories: Sequence[Trajectory], S: int) -> dict[str, torch.Tensor]:
    """`rollout_routed_experts` [B, S, L, k] int64 and `rollout_routing_mask` [B, S] int64 from each trajectory's
    `routed_experts` [n - 1, L, k]."""
    first = trajectories[0].routed_experts
    L, k = first.shape[1], first.shape[2]
    experts = torch.zeros((len(trajectories), S, L, k), dtype=torch.long)
    mask = torch.zeros((len(trajectories), S), dtype=torch.long)
    for i, t in enumerate(trajectories):
        routed = torch.as_tensor(t.routed_experts).long()
        n = len(t) - 1
        if tuple(routed.shape) != (n, L, k):
            raise ValueError(f"sample {i}: routed_experts has shape {tuple(routed.shape)}, expected {(n, L, k)} "
                             "(all tokens but the last, MoE layers, top-k)")
        experts[i, :n] = routed
        mask[i, :n] = 1
    return {"rollout_routed_experts": experts, "rollout_routing_mask": mask}
