"""Rollout samples -> the `Batch` the Megatron roles consume (pure, controller side).

Each sample becomes one row: prompt tokens then response tokens, right-padded with `pad_id` to the longest row.
`response_mask` marks the response tokens (what is trained and scored); `group_ids` [B] int64 is the sample's prompt
index (the GRPO/RLOO group); `rollout_log_probs` keeps vLLM's log-probs of the sampled tokens, token-aligned, for
monitoring the train/inference mismatch. When the engine captured routing (`algorithm.router_replay: rollout`),
`rollout_routed_experts` [B, S, L, k] int64 holds the experts vLLM chose for each token and `rollout_routing_mask`
[B, S] int64 is 1 on the tokens it routed (positions 0..p+r-2: the last sampled token is never fed back; 0 there
and on padding, whose experts are 0).
"""

from __future__ import annotations

from typing import Sequence

import torch

from megarl.controller.dispatch import chunk_bounds  # noqa: F401  (how a step's prompts are shared among replicas)
from megarl.data.batch import Batch
from megarl.rollout.engine import RolloutSample


def samples_to_batch(samples: Sequence[RolloutSample], pad_id: int = 0) -> Batch:
    """Rows in the order given. Raises ValueError on an empty list (a step with no samples must be reported)."""
    if not samples:
        raise ValueError("no rollout samples to train on (were all prompts dropped as overlong?)")
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    S = max(lengths)
    B = len(samples)
    input_ids = torch.full((B, S), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, S), dtype=torch.long)
    response_mask = torch.zeros((B, S), dtype=torch.long)
    rollout_log_probs = torch.zeros((B, S), dtype=torch.float32)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        if p == 0:
            raise ValueError(f"sample {i} has an empty prompt: a response needs at least one prompt token")
        input_ids[i, : p + r] = torch.tensor(list(s.prompt_ids) + list(s.response_ids), dtype=torch.long)
        attention_mask[i, : p + r] = 1
        response_mask[i, p : p + r] = 1
        if r:
            rollout_log_probs[i, p : p + r] = torch.tensor(s.response_log_probs, dtype=torch.float32)
    group_ids = torch.tensor([s.prompt_index for s in samples], dtype=torch.long)
    out = {
        "input_ids": input_ids, "attention_mask": attention_mask, "response_mask": response_mask,
        "rollout_log_probs": rollout_log_probs, "group_ids": group_ids,
    }
    with_routing = [s.routed_experts is not None for s in samples]
    if any(with_routing):
        if not all(with_routing):
            raise ValueError(f"{with_routing.count(False)} of {B} samples carry no routed experts: the rollout "
                             "engine captured routing for some samples only")
        out.update(_rollout_routing(samples, S))
    return Batch(out)


def _rollout_routing(samples: Sequence[RolloutSample], S: int) -> dict[str, torch.Tensor]:
    """`rollout_routed_experts` [B, S, L, k] int64 and `rollout_routing_mask` [B, S] int64 from each sample's
    `routed_experts` [p + r - 1, L, k]."""
    first = samples[0].routed_experts
    L, k = first.shape[1], first.shape[2]
    experts = torch.zeros((len(samples), S, L, k), dtype=torch.long)
    mask = torch.zeros((len(samples), S), dtype=torch.long)
    for i, s in enumerate(samples):
        routed = torch.as_tensor(s.routed_experts).long()
        n = len(s.prompt_ids) + len(s.response_ids) - 1
        if tuple(routed.shape) != (n, L, k):
            raise ValueError(f"sample {i}: routed_experts has shape {tuple(routed.shape)}, expected {(n, L, k)} "
                             "(prompt + response - 1 tokens, MoE layers, top-k)")
        experts[i, :n] = routed
        mask[i, :n] = 1
    return {"rollout_routed_experts": experts, "rollout_routing_mask": mask}
