"""The actor (policy) and the reference policy.

Actor.compute_log_probs(batch) -> Batch (last pipeline stage; None elsewhere)
    in:  input_ids [B, S] int64, attention_mask [B, S], loss_mask [B, S] (or its legacy alias response_mask)
    out: log_probs [B, S] float32, entropy [B, S] float32 — token-aligned (see `megarl.data.batch`), 0 where
         loss_mask is 0 (context tokens are fed through the model but not scored). Computed vocab-parallel from
         each TP rank's logits shard (`vocab_parallel_log_probs`, `entropy_from_vocab_parallel`): full-vocabulary
         logits are never gathered.

Actor.update(batch) -> dict of floats (every rank)
    PPO-style ('ppo' / 'gspo' / 'cispo' policy loss, with optional entropy bonus and KL-to-reference loss):
      in: input_ids, attention_mask, loss_mask (or response_mask), old_log_probs [B, S], advantages [B, S]
          (+ ref_log_probs [B, S] when kl_coef > 0; + rollout_log_probs [B, S] when a rollout correction is on)
      Rollout correction (`megarl.algorithms.rollout_correction`, off by default): per micro-batch, from the
      rollout engine's log-probs and `old_log_probs` (the old policy recomputed by Megatron before this update),
      truncated importance weights multiply each token's policy-gradient loss and masked tokens/sequences leave
      the loss (policy gradient, entropy bonus, KL term and the normaliser alike).
    SFT warm-up (`loss.name == "sft"`): cross-entropy on the loss-mask tokens; in: input_ids, attention_mask,
      loss_mask (or response_mask).
    Every per-token term (policy loss, entropy, KL, the metrics and their normalisers) is taken over the tokens
    where loss_mask is 1, wherever they sit in the row: a multi-turn row's tool tokens (0) never count.
    Mini-batches of `batching.mini_batch_samples` (one optimizer step each) x `batching.epochs`; micro-batches
    per DP rank. The loss is normalised exactly over the whole mini-batch (all micro-batches and DP ranks):
    loss_fn returns the *sum* of per-unit losses (`aggregate(..., global_normalizer=1)`) and the unit count,
    and megatron divides the summed gradients by the global unit count (`calculate_per_token_loss`).
    Returned metrics: loss, pg_loss, clip_frac, approx_kl, entropy, kl (when used) — token means over the
    update; grad_norm (mean over steps), lr (last), tokens, tokens_per_s, time_s, optimizer_steps; with a rollout
    correction also rollout_tis_weight_mean, rollout_tis_clip_frac (over the tokens in the loss) and
    rollout_masked_token_frac (loss-mask tokens excluded by the correction / loss-mask tokens); with the top-k
    forward KL to a teacher (`PolicyLossSettings.top_k_kl_coef`) distill_top_k_kl, its token mean (nats), the term
    top_k_kl_coef x that mean (aggregated as the policy loss) being added to the loss.

Reference: a frozen Actor (no optimizer, no gradients), same or different layout; compute_log_probs only.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megarl.algorithms import (
    aggregate,
    entropy_from_vocab_parallel,
    get_policy_loss,
    rollout_correction,
    vocab_parallel_log_probs,
    vocab_parallel_log_probs_and_entropy,
)
from megarl.algorithms import kl as kl_per_token
from megarl.algorithms.distillation import (
    top_k_forward_kl,
    vocab_parallel_log_probs_of_ids,
    vocab_parallel_top_k,
)
from megarl.algorithms.rollout_correction import (
    MISMATCH_MAX_KEYS,
    MISMATCH_SUM_KEYS,
    mismatch_from_sums,
    mismatch_sums,
)
from megarl.data.batch import Batch
from megarl.engine.lora import LoraSettings, adapters_disabled, lora_transform
from megarl.engine.moe import (
    RoutingRecorder,
    RoutingReplayer,
    aux_loss_tracker_clear,
    moe_update_metrics,
    routing_diff_frac,
)
from megarl.roles.base import Role, count_units, shift_to_tokens


@dataclasses.dataclass(frozen=True)
class PolicyLossSettings:
    """The actor's objective.

    Attributes:
        name: 'ppo', 'gspo', 'cispo' (a registered policy loss) or 'sft' (cross-entropy on response tokens).
        clip_low, clip_high, clip_c: ratio clipping (see `megarl.algorithms.policy_loss`).
        agg: loss aggregation mode; norm_horizon: its divisor for 'seq-mean-token-sum-norm'.
        entropy_coef: weight of the entropy bonus (subtracted from the loss).
        kl_coef, kl_kind: KL-to-reference loss term (needs `ref_log_probs` in the batch when kl_coef > 0).
        rollout_tis, rollout_c, rollout_mask, rollout_mask_c: the rollout correction
            (`megarl.algorithms.rollout_correction`: tis / c / mask / mask_c); needs `rollout_log_probs` when on.
        top_k_kl_coef: weight of the top-k forward KL to a teacher (distillation.top_k_coef with
            distillation.top_k > 0; `megarl.algorithms.distillation.top_k_forward_kl`); needs `teacher_top_k_ids`
            and `teacher_top_k_log_probs` [B, S, k] when > 0.
    """

    name: str = "ppo"
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_c: Optional[float] = None
    agg: str = "token-mean"
    norm_horizon: Optional[int] = None
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_kind: str = "low_var_kl"
    rollout_tis: str = "off"
    rollout_c: float = 2.0
    rollout_mask: str = "off"
    rollout_mask_c: Optional[float] = None
    top_k_kl_coef: float = 0.0

    @property
    def corrects_rollout(self) -> bool:
        return self.name != "sft" and (self.rollout_tis != "off" or self.rollout_mask != "off")

    @classmethod
    def from_config(cls, algo_cfg, max_new_tokens: Optional[int] = None) -> "PolicyLossSettings":
        """From `megarl.config.schema.AlgorithmConfig` (the KL term only when it is placed in the loss)."""
        in_loss = algo_cfg.kl.placement == "loss"
        rc = algo_cfg.rollout_correction
        return cls(
            rollout_tis=rc.tis, rollout_c=rc.c, rollout_mask=rc.mask, rollout_mask_c=rc.mask_c,
            name=algo_cfg.setting("policy_loss"), clip_low=algo_cfg.setting("clip_low"),
            clip_high=algo_cfg.setting("clip_high"), clip_c=algo_cfg.clip_c, agg=algo_cfg.setting("loss_agg"),
            norm_horizon=algo_cfg.loss_norm_horizon or max_new_tokens,
            entropy_coef=algo_cfg.entropy_coef, kl_coef=algo_cfg.kl.coef if in_loss else 0.0, kl_kind=algo_cfg.kl.kind,
        )


_METRICS = ["loss_sum", "units", "tokens_in_loss", "pg_loss_sum", "clip_sum", "approx_kl_sum", "entropy_sum", "kl_sum",
            "mask_tokens", "tis_weight_sum", "tis_clip_sum", "top_k_kl_sum"]


class Actor(Role):
    """The policy. Construct collectively on every rank of its layout (`Role.__init__` arguments)."""

    head = "lm"

    def __init__(self, *args, loss: PolicyLossSettings = PolicyLossSettings(), router_replay: str = "none",
                 lora: Optional[LoraSettings] = None, **kwargs) -> None:
        """`lora`: LoRA adapters on the actor's linears (megarl.engine.lora), the base frozen."""
        if lora is not None:
            kwargs["transforms"] = (*kwargs.get("transforms", ()), lora_transform(lora))
        self.lora = lora
        super().__init__(*args, **kwargs)
        self.loss = loss
        if router_replay not in ("none", "old", "rollout"):
            raise ValueError(f"router_replay must be 'none', 'old' or 'rollout', got {router_replay!r}")
        if router_replay != "none" and not self.engine.spec.is_moe:
            raise ValueError(f"router_replay={router_replay!r} needs a mixture-of-experts model; "
                             f"{self.engine.spec.architecture} is dense")
        self.router_replay = router_replay

    # ------------------------------------------------------------------------------------------- helpers
    def _token_log_probs(self, logits: torch.Tensor, mb: dict, with_entropy: bool, entropy_grad: bool = False):
        """Token-aligned log-probs (and entropies) [b, s] from this TP rank's logits shard [b, s, V/tp]. The entropy
        comes from the log-probs' own pass as a constant (`vocab_parallel_log_probs_and_entropy`) unless
        `entropy_grad` (a loss with an entropy term differentiates it: `entropy_from_vocab_parallel`)."""
        ids, mask = mb["input_ids"], mb["loss_mask"]
        vocab_start, _ = self.engine.vocab_shard()
        tp_group = self.groups.pgs.tp
        shard = logits[:, :-1]
        if with_entropy and not entropy_grad:
            logp, ent = vocab_parallel_log_probs_and_entropy(shard, ids[:, 1:], tp_group, vocab_start)
            return shift_to_tokens(logp, mask), shift_to_tokens(ent, mask)
        logp = shift_to_tokens(vocab_parallel_log_probs(shard, ids[:, 1:], tp_group, vocab_start), mask)
        ent = shift_to_tokens(entropy_from_vocab_parallel(shard, tp_group), mask) if with_entropy else None
        return logp, ent

    def _token_top_k(self, logits: torch.Tensor, mb: dict, k: int):
        """Token-aligned top-k of the next-token distribution, (ids [b, s, k] int64, log_probs [b, s, k] float32):
        row t is the distribution of token t given the tokens before it (from the logits at t - 1), 0 at t = 0 and
        where loss_mask is 0; from this TP rank's logits shard [b, s, V/tp] (`vocab_parallel_top_k`)."""
        vocab_start, _ = self.engine.vocab_shard()
        ids, logp = vocab_parallel_top_k(logits[:, :-1], k, self.groups.pgs.tp, vocab_start)
        keep = mb["loss_mask"].unsqueeze(-1)
        pad = (0, 0, 1, 0)
        return (torch.nn.functional.pad(ids, pad) * keep.to(ids.dtype),
                torch.nn.functional.pad(logp, pad) * keep.to(logp.dtype))

    def _top_k_forward_kl(self, logits: torch.Tensor, mb: dict, mask: torch.Tensor) -> torch.Tensor:
        """Token-aligned [b, s] top-k forward KL to the teacher (`top_k_forward_kl`) from this TP rank's logits shard
        and the micro-batch's teacher_top_k_ids / teacher_top_k_log_probs [b, s, k]; 0 where `mask` is 0."""
        vocab_start, _ = self.engine.vocab_shard()
        ids, teacher = mb["teacher_top_k_ids"][:, 1:], mb["teacher_top_k_log_probs"][:, 1:]
        student = vocab_parallel_log_probs_of_ids(logits[:, :-1], ids, self.groups.pgs.tp, vocab_start)
        return shift_to_tokens(top_k_forward_kl(teacher, student), mask)

    # ------------------------------------------------------------------------------------------- API
    @torch.no_grad()
    def compute_log_probs(self, batch: Batch, with_entropy: bool = True, share: bool = False,
                          record_routing: Optional[bool] = None, replay_routing: bool = False,
                          replay_rollout: Optional[bool] = None, top_k: int = 0) -> Optional[Batch]:
        """Per-token log-probs (and entropy) of the response tokens; see the module docstring. `share=True`: `batch`
        is already this DP rank's share (the controller's DP_SPLIT) and the result covers it only (`Role._forward`).

        record_routing (MoE; default: on when `router_replay == "old"`): the result also holds `routed_experts`
        [B, S, L, k] int64, the experts every MoE layer chose for every token (`megarl.engine.moe`), which an
        update with `router_replay="old"` replays. replay_routing: route every token to `batch["routed_experts"]`
        instead (as a replayed update does; the result's `routed_experts` are those used) and set
        `self.last_routing_diff_frac` (the `moe_routing_diff_frac` of this forward, every rank).
        replay_rollout (default: on when `router_replay == "rollout"`): route the tokens vLLM routed to vLLM's
        experts (`batch["rollout_routed_experts"]` [B, S, L, k] where `batch["rollout_routing_mask"]` [B, S] is 1;
        the others by the router itself); the result holds the experts used for every token (`routed_experts`, for
        the update to replay) and its `meta["moe_rollout_routing_diff_frac"]` is the fraction of those replayed
        (token, layer) choices whose own top-k set differs from vLLM's (every rank; whole role).
        top_k > 0 (a teacher's top-k distribution): the result also holds `top_k_ids` [B, S, k] int64 and
        `top_k_log_probs` [B, S, k] float32 (`_token_top_k`; k = top_k), from the whole sequence's logits (under
        context parallelism the engine gathers them over the CP group first: every position is the sequence's own).
        """
        batch = batch.with_loss_mask()
        batch.require("input_ids", "attention_mask", "loss_mask")
        if replay_rollout is None:
            replay_rollout = self.router_replay == "rollout" and not replay_routing
        if record_routing is None:
            record_routing = self.router_replay == "old"
        keys = ["input_ids", "attention_mask", "loss_mask"]
        routing = None
        if replay_rollout:
            batch.require("rollout_routed_experts", "rollout_routing_mask")
            keys += ["rollout_routed_experts", "rollout_routing_mask"]
            routing = RoutingReplayer(self.engine, keep_indices=True, key="rollout_routed_experts",
                                      mask_key="rollout_routing_mask")
        elif replay_routing:
            batch.require("routed_experts")
            keys.append("routed_experts")
            routing = RoutingReplayer(self.engine, keep_indices=True)
        elif record_routing and self.engine.spec.is_moe:
            routing = RoutingRecorder(self.engine)

        def fn(logits, mb):
            logp, ent = self._token_log_probs(logits, mb, with_entropy)
            out = {"log_probs": logp, "entropy": ent} if with_entropy else {"log_probs": logp}
            if top_k:
                out["top_k_ids"], out["top_k_log_probs"] = self._token_top_k(logits, mb, top_k)
            return out

        out = self._forward(batch, keys, fn, share=share, routing=routing)
        if replay_routing or replay_rollout:
            frac = routing_diff_frac(self.engine, [routing])
            self.last_routing_diff_frac = frac
            if replay_rollout and out is not None:
                out.meta["moe_rollout_routing_diff_frac"] = frac
        return out

    def update(self, batch: Batch, share: bool = False) -> dict[str, float]:
        """One PPO (or SFT) update over `batch`; returns metrics (same on every rank).

        share=False: `batch` is the whole batch, on every rank; share=True: this DP rank's part of every
        mini-batch, as the controller cut it (`Dispatch.DP_SPLIT_MINI_BATCHES`; `Role._train`).

        Old-policy log-probs: `batch["old_log_probs"]` [B, S] when given (a separate forward before the update).
        Without them the update takes them from its own forward, detached (`old = logp.detach()`: the ratio is 1
        with the PPO gradient), which is exact only while the update is one optimizer step over one mini-batch and
        one epoch (the weights have not moved yet); anything else is refused. That path also measures the
        rollout/train mismatch against `batch["rollout_log_probs"]` when present (`mismatch_*` metrics, as
        `megarl.algorithms.mismatch_metrics` on the whole batch) and reports `old_log_probs_fused` = 1.
        """
        if not self.engine.trainable:
            raise RuntimeError("this actor is frozen (built without optimizer settings)")
        s = self.loss
        batch = batch.with_loss_mask()
        keys = ["input_ids", "attention_mask", "loss_mask"]
        fused = s.name != "sft" and "old_log_probs" not in batch.tensors
        measure_mismatch = fused and "rollout_log_probs" in batch.tensors
        if s.name != "sft":
            keys += ["advantages"] if fused else ["old_log_probs", "advantages"]
            policy_loss = get_policy_loss(s.name)
        if fused:
            steps = len(self._share_layout(batch, share).rows) * self.batching.epochs
            if steps != 1 or s.corrects_rollout:
                raise ValueError(
                    f"batch has no old_log_probs: the update can take them from its own forward only for one "
                    f"optimizer step per batch with no rollout correction; here {steps} steps "
                    f"(mini-batches x epochs), rollout correction {'on' if s.corrects_rollout else 'off'}. Compute "
                    "them first (compute_log_probs) and put them in the batch"
                )
        if s.kl_coef > 0:
            keys.append("ref_log_probs")
        if s.corrects_rollout or measure_mismatch:
            keys.append("rollout_log_probs")
        if s.top_k_kl_coef > 0 and s.name != "sft":
            keys += ["teacher_top_k_ids", "teacher_top_k_log_probs"]
        # fused: the update's forward is the old one. rollout: the old-log-prob forward replayed vLLM's experts and
        # recorded the ones it used (`routed_experts`, every token), which the update replays as for `old`
        replay = self.router_replay in ("old", "rollout") and not fused
        if replay:
            keys.append("routed_experts")
        batch.require(*keys)
        routing_factory = None
        if self.engine.spec.is_moe:
            aux_loss_tracker_clear()
            routing_factory = (lambda: RoutingReplayer(self.engine)) if replay else (
                lambda: RoutingRecorder(self.engine, keep_indices=False))

        def loss_fn(logits, mb):
            loss_mask = mb["loss_mask"]
            weights = None
            mask = loss_mask
            if s.corrects_rollout:  # constants of the update: old (Megatron, pre-update) vs rollout (vLLM) log-probs
                weights, keep, rc = rollout_correction(
                    mb["old_log_probs"], mb["rollout_log_probs"], loss_mask, tis=s.rollout_tis, c=s.rollout_c,
                    mask=s.rollout_mask, mask_c=s.rollout_mask_c,
                )
                mask = keep.to(loss_mask.dtype)  # masked tokens leave the loss and its normaliser
                if s.rollout_tis == "off":
                    weights = None
            fmask = mask.float()
            need_entropy = s.entropy_coef > 0  # else the entropy is a metric, from the log-probs' pass
            logp, ent = self._token_log_probs(logits, mb, with_entropy=True, entropy_grad=need_entropy)
            n_tok = fmask.sum()
            agg = dict(mode=s.agg, norm_horizon=s.norm_horizon, global_normalizer=1.0)
            if s.name == "sft":
                pg_sum = aggregate(-logp, mask, **agg)
                clip = approx_kl = torch.zeros(())
            else:
                old = logp.detach() if fused else mb["old_log_probs"]
                pg_sum, m = policy_loss(
                    logp, old, mb["advantages"], mask, clip_low=s.clip_low, clip_high=s.clip_high,
                    clip_c=s.clip_c, agg=s.agg, norm_horizon=s.norm_horizon, global_normalizer=1.0, weights=weights,
                )
                clip, approx_kl = m["clip_frac"] * n_tok, m["approx_kl"] * n_tok
            loss_sum = pg_sum
            if need_entropy:
                loss_sum = loss_sum - s.entropy_coef * aggregate(ent, mask, **agg)
            kl_sum = torch.zeros(())
            if s.kl_coef > 0:
                kl_tok = kl_per_token(logp, mb["ref_log_probs"], s.kl_kind)
                loss_sum = loss_sum + s.kl_coef * aggregate(kl_tok, mask, **agg)
                kl_sum = (kl_tok.detach() * fmask).sum()
            top_k_kl_sum = torch.zeros(())
            if s.top_k_kl_coef > 0 and s.name != "sft":  # distillation: the top-k forward KL to the teacher
                fkl_tok = self._top_k_forward_kl(logits, mb, mask)
                loss_sum = loss_sum + s.top_k_kl_coef * aggregate(fkl_tok, mask, **agg)
                top_k_kl_sum = (fkl_tok.detach() * fmask).sum()
            units = count_units(mask, s.agg)
            metrics = {
                "loss_sum": loss_sum.detach(), "units": units.float(), "tokens_in_loss": n_tok,
                "pg_loss_sum": pg_sum.detach(), "clip_sum": clip, "approx_kl_sum": approx_kl,
                "entropy_sum": (ent.detach() * fmask).sum(), "kl_sum": kl_sum,
                "mask_tokens": loss_mask.float().sum(), "tis_weight_sum": torch.zeros(()),
                "tis_clip_sum": torch.zeros(()), "top_k_kl_sum": top_k_kl_sum,
            }
            if s.corrects_rollout:
                metrics["tis_weight_sum"] = rc["tis_weight_mean"] * n_tok
                metrics["tis_clip_sum"] = rc["tis_clip_frac"] * n_tok
            if measure_mismatch:  # this forward's (pre-step) log-probs are the old policy's
                sums = mismatch_sums(logp.detach(), mb["rollout_log_probs"], loss_mask, c=s.rollout_c)
                metrics.update({f"mismatch_{k}": v for k, v in sums.items()})
            return loss_sum, units, metrics

        metric_keys = _METRICS + ([f"mismatch_{k}" for k in (*MISMATCH_SUM_KEYS, *MISMATCH_MAX_KEYS)]
                                  if measure_mismatch else [])
        totals = self._train(batch, keys, loss_fn, metric_keys, routing_factory=routing_factory, share=share)
        tokens_in_loss = totals.pop("tokens_in_loss")
        n_tok = max(tokens_in_loss, 1.0)
        units = max(totals.pop("units"), 1.0)
        out = {
            "loss": totals.pop("loss_sum") / units,
            "pg_loss": totals.pop("pg_loss_sum") / units,
            "clip_frac": totals.pop("clip_sum") / n_tok,
            "approx_kl": totals.pop("approx_kl_sum") / n_tok,
            "entropy": totals.pop("entropy_sum") / n_tok,
        }
        kl_sum = totals.pop("kl_sum")
        if s.kl_coef > 0:
            out["kl"] = kl_sum / n_tok
        top_k_kl_sum = totals.pop("top_k_kl_sum")
        if s.top_k_kl_coef > 0 and s.name != "sft":
            out["distill_top_k_kl"] = top_k_kl_sum / n_tok
        mask_tokens = max(totals.pop("mask_tokens"), 1.0)
        tis_weight_sum, tis_clip_sum = totals.pop("tis_weight_sum"), totals.pop("tis_clip_sum")
        if s.corrects_rollout:
            out["rollout_tis_weight_mean"] = tis_weight_sum / n_tok
            out["rollout_tis_clip_frac"] = tis_clip_sum / n_tok
            out["rollout_masked_token_frac"] = 1.0 - tokens_in_loss / mask_tokens
        if measure_mismatch:
            sums = {k[len("mismatch_"):]: totals.pop(k) for k in list(totals) if k.startswith("mismatch_")}
            out.update({f"mismatch_{k}": v for k, v in mismatch_from_sums(sums).items()})
        out["old_log_probs_fused"] = 1.0 if fused else 0.0
        out.update(totals)
        if self.engine.spec.is_moe:
            out.update(moe_update_metrics(self.engine, self.last_routing))
        return out


class BaseOfActor:
    """The reference policy of a LoRA actor: the actor's own base weights with its adapters off (no second model).
    Answers `compute_log_probs` as a `Reference` would; it has no engine of its own (nothing to offload)."""

    def __init__(self, actor: Actor) -> None:
        if actor.lora is None:
            raise ValueError("BaseOfActor needs an actor built with LoRA adapters (actor.lora)")
        self.actor = actor

    @property
    def groups(self):
        return self.actor.groups

    @property
    def dp(self) -> int:
        return self.actor.dp

    @property
    def dp_rank(self) -> int:
        return self.actor.dp_rank

    def compute_log_probs(self, batch: Batch, with_entropy: bool = True, share: bool = False) -> Optional[Batch]:
        with adapters_disabled(self.actor.engine.chunks):
            return self.actor.compute_log_probs(batch, with_entropy=with_entropy, share=share, record_routing=False,
                                                replay_rollout=False)


class Reference(Actor):
    """The frozen reference policy: an Actor without optimizer. Same or different layout than the actor.

    To colocate it with the actor, build it on the actor's ranks and call `offload()` after each
    `compute_log_probs` (and `reload()` before the next); or build it on its own ranks (`rank_offset`).
    """

    def __init__(self, *args, **kwargs) -> None:
        if kwargs.get("optimizer") is not None:
            raise ValueError("the reference policy is frozen: do not pass optimizer settings")
        super().__init__(*args, **kwargs)

    def update(self, batch: Batch, share: bool = False) -> dict[str, float]:  # pragma: no cover - guard
        raise RuntimeError("the reference policy is frozen")
