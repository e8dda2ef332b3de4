"""Supervised warm-up (SFT) on the Megatron actor, before RL, with the same workers and engine.

`SFTWorker` is the `HybridWorker` (actor + vLLM engine + reshard on every device slot of the actor's pool) with one
more controller-callable method, `update_actor_sft`: one optimizer step of the actor's cross-entropy on the
response tokens (`Actor.update` with `loss.name == "sft"`, `megarl.roles.actor`), over the whole batch, at its own
learning rate. The actor's RL loss, batching and learning rate are restored afterwards, so the same workers then
run RL (`RLLoop`) from the warmed-up weights, optimizer moments included.

Data path: records {"prompt", "answer"} -> `sft_batch` (controller: prompt ids from the `PromptEncoder`, answer ids
+ EOS as the response) -> Batch input_ids / attention_mask / response_mask [B, S] int64 -> `update_actor_sft`
(every rank; each takes its DP share) -> metrics (loss = mean token NLL, grad_norm, lr, ...).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

from megarl.controller.dispatch import Dispatch, dispatch
from megarl.data.batch import Batch
from megarl.workers.hybrid import HybridWorker
from megarl.workers.role_host import MASKS, TOKENS


def sft_batch(encoder, records: Sequence, pad_id: Optional[int] = None) -> Batch:
    """Right-padded [B, S] rows of prompt ids + answer ids + EOS; `response_mask` (the legacy name of the loss mask,
    `megarl.data.batch`) marks the answer and EOS.

    `encoder`: a `megarl.data.tokenization.PromptEncoder`; `records`: objects with `.prompt` and `.answer`
    (`PromptRecord`) or dicts with those keys. The answer is tokenised without special tokens."""
    tok = encoder.tokenizer
    pad = tok.pad_token_id if pad_id is None else pad_id
    rows, starts = [], []
    for r in records:
        prompt, answer = (r["prompt"], r["answer"]) if isinstance(r, dict) else (r.prompt, r.answer)
        ids = encoder.encode(prompt)
        starts.append(len(ids))
        rows.append(ids + list(tok.encode(str(answer), add_special_tokens=False)) + [tok.eos_token_id])
    S = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), S), pad or 0, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), S), dtype=torch.long)
    response_mask = torch.zeros((len(rows), S), dtype=torch.long)
    for i, (row, p) in enumerate(zip(rows, starts)):
        input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        attention_mask[i, : len(row)] = 1
        response_mask[i, p: len(row)] = 1
    return Batch({"input_ids": input_ids, "attention_mask": attention_mask, "response_mask": response_mask})


class SFTWorker(HybridWorker):
    """`HybridWorker` plus `update_actor_sft` (see the module docstring)."""

    @dispatch(Dispatch.RANK_ZERO, reads=TOKENS, optional_reads=MASKS)
    def update_actor_sft(self, batch: Batch, lr: float) -> dict[str, float]:
        """One optimizer step of SFT over `batch` (the whole batch on every rank; input_ids, attention_mask,
        response_mask [B, S]) at learning rate `lr`; returns the actor's update metrics (same on every rank).
        The batch size must split over the actor's DP ranks."""
        actor = self.actor
        rl_loss, rl_batching = actor.loss, actor.batching
        param_groups = actor.engine.optimizer.param_groups
        rl_lrs = [g["lr"] for g in param_groups]
        actor.loss = dataclasses.replace(rl_loss, name="sft", kl_coef=0.0, entropy_coef=0.0, rollout_tis="off",
                                         rollout_mask="off")
        actor.batching = dataclasses.replace(rl_batching, mini_batch_samples=None, epochs=1)
        for g in param_groups:
            g["lr"] = lr
        try:
            self.offload["actor"].before_use()
            metrics = actor.update(batch)
            self._offload("actor", self.offload["actor"].after_update)
        finally:
            actor.loss, actor.batching = rl_loss, rl_batching
            for g, old in zip(param_groups, rl_lrs):
                g["lr"] = old
        return metrics
