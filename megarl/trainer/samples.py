"""Rollout samples -> the `Batch` the Megatron roles consume (pure, controller side).

Each sample becomes one row: prompt tokens then response tokens, right-padded with `pad_id` to the longest row.
`response_mask` marks the response tokens (what is trained and scored); `group_ids` [B] int64 is the sample's prompt
index (the GRPO/RLOO group); `rollout_log_probs` keeps vLLM's log-probs of the sampled tokens, token-aligned, for
monitoring the train/inference mismatch.
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
    return Batch({
        "input_ids": input_ids, "attention_mask": attention_mask, "response_mask": response_mask,
        "rollout_log_probs": rollout_log_probs, "group_ids": group_ids,
    })
