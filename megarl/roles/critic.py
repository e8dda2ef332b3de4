"""The critic (value model) and the reward model: a GPTModel body with a `ScalarHead` (see `megarl.engine.heads`).

Critic.compute_values(batch) -> Batch (last pipeline stage; None elsewhere)
    in:  input_ids [B, S] int64, attention_mask [B, S], loss_mask [B, S] (or its legacy alias response_mask)
    out: values [B, S] float32, token-aligned: values[:, t] = V(state before token t) = head(hidden at t-1),
         0 where loss_mask is 0 (a multi-turn row's tool tokens carry no value: they are not actions).
Critic.update(batch) -> dict of floats (every rank)
    in:  input_ids, attention_mask, loss_mask (or response_mask), old_values [B, S] (the values the advantages were
         computed with), returns [B, S]. Clipped value loss (`megarl.algorithms.value_loss`, clip = `value_clip`,
         0 = unclipped), aggregated with `agg` over the loss-mask tokens, normalised exactly over each mini-batch.
    metrics: value_loss, value_clip_frac, value_mean (token means), grad_norm, lr, tokens, tokens_per_s, ...

RewardModel.score(batch) -> Batch (last pipeline stage; None elsewhere)
    in:  input_ids [B, S] int64, attention_mask [B, S]
    out: scores [B] float32, the head's output at each sample's last real token (attention_mask).

Checkpoints: the body loads from a HF CausalLM-layout directory (`load_hf`, which is
`megarl.checkpoint.engine_io.load_hf_into_engine`; the language-model head is ignored); the head loads from that
directory's `score.weight` [1, hidden] when present (the name of transformers' `*ForTokenClassification` /
`*ForSequenceClassification` with num_labels=1) and keeps its seeded initialisation otherwise (a critic initialised
from the actor). `head_state_dict()` / `load_head_state_dict()` give the head under its HF name; megatron-core
distributed checkpoints (`megarl.checkpoint.dist_ckpt`) carry it as `output_layer.score.weight`.
"""

from __future__ import annotations

from typing import Optional

import torch

from megarl.algorithms import value_loss
from megarl.checkpoint.engine_io import refresh_optimizer_copies
from megarl.data.batch import Batch
from megarl.engine.heads import HF_HEAD_NAME, MEGATRON_HEAD_NAME
from megarl.roles.base import Role, count_units, shift_to_tokens


class ScalarHeadRole(Role):
    head = "scalar"

    def _head_param(self) -> Optional[torch.nn.Parameter]:
        return dict(self.engine.chunks[-1].named_parameters()).get(MEGATRON_HEAD_NAME)

    def head_state_dict(self) -> dict[str, torch.Tensor]:
        """{'score.weight': [1, hidden]} on last-stage ranks, {} elsewhere (a CPU copy)."""
        p = self._head_param()
        return {} if p is None else {HF_HEAD_NAME: p.detach().cpu().clone()}

    @torch.no_grad()
    def load_head_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        p = self._head_param()
        if p is not None:
            p.data.copy_(state[HF_HEAD_NAME])
            refresh_optimizer_copies(self.engine)

    def _head_out(self, output: torch.Tensor) -> torch.Tensor:
        return output[..., 0].float()  # [b, s, 1] -> [b, s]


class Critic(ScalarHeadRole):
    """The value model. `value_clip` in reward units (0 = unclipped); `agg` as the actor's loss aggregation."""

    def __init__(self, *args, value_clip: float = 0.2, agg: str = "token-mean",
                 norm_horizon: Optional[int] = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.value_clip = value_clip
        self.agg = agg
        self.norm_horizon = norm_horizon

    def _values(self, output, mb) -> torch.Tensor:
        return shift_to_tokens(self._head_out(output)[:, :-1], mb["loss_mask"])

    @torch.no_grad()
    def compute_values(self, batch: Batch, share: bool = False) -> Optional[Batch]:
        """Values [B, S] float32, token-aligned; `share` as in `Role._forward`."""
        batch = batch.with_loss_mask()
        batch.require("input_ids", "attention_mask", "loss_mask")
        return self._forward(batch, ["input_ids", "attention_mask", "loss_mask"],
                             lambda out, mb: {"values": self._values(out, mb)}, share=share)

    def update(self, batch: Batch, share: bool = False) -> dict[str, float]:
        """Value-loss update over `batch` (the whole batch, or with share=True this DP rank's part of every
        mini-batch: `Role._train`); returns metrics (same on every rank)."""
        batch = batch.with_loss_mask()
        keys = ["input_ids", "attention_mask", "loss_mask", "old_values", "returns"]
        batch.require(*keys)
        clip = self.value_clip if self.value_clip > 0 else float("inf")

        def loss_fn(output, mb):
            mask = mb["loss_mask"]
            values = self._values(output, mb)
            loss_sum, m = value_loss(values, mb["old_values"], mb["returns"], mask, clip=clip, agg=self.agg,
                                     norm_horizon=self.norm_horizon, global_normalizer=1.0)
            n_tok = mask.float().sum()
            units = count_units(mask, self.agg)
            return loss_sum, units, {
                "loss_sum": loss_sum.detach(), "units": units.float(), "tokens_in_loss": n_tok,
                "clip_sum": m["value_clip_frac"] * n_tok, "value_sum": m["value_mean"] * n_tok,
            }

        totals = self._train(batch, keys, loss_fn, ["loss_sum", "units", "tokens_in_loss", "clip_sum", "value_sum"],
                             share=share)
        n_tok = max(totals.pop("tokens_in_loss"), 1.0)
        out = {
            "value_loss": totals.pop("loss_sum") / max(totals.pop("units"), 1.0),
            "value_clip_frac": totals.pop("clip_sum") / n_tok,
            "value_mean": totals.pop("value_sum") / n_tok,
        }
        out.update(totals)
        return out


class RewardModel(ScalarHeadRole):
    """A learned reward model: frozen, scores each sequence at its last real token."""

    def __init__(self, *args, **kwargs) -> None:
        if kwargs.get("optimizer") is not None:
            raise ValueError("the reward model role is inference-only: do not pass optimizer settings")
        super().__init__(*args, **kwargs)

    @torch.no_grad()
    def score(self, batch: Batch, share: bool = False) -> Optional[Batch]:
        """Scores [B] float32 at each sequence's last real token; `share` as in `Role._forward`."""
        batch.require("input_ids", "attention_mask")

        def fn(output, mb):
            last = mb["attention_mask"].long().sum(-1).clamp(min=1) - 1
            return {"scores": self._head_out(output).gather(1, last.unsqueeze(1)).squeeze(1)}

        return self._forward(batch, ["input_ids", "attention_mask"], fn, share=share)
