"""What every Megatron role shares: the engine, the DP split of a batch, micro-batching, result collection.

Data path of a role call (the same on every rank of the role, called collectively):
  the controller's DP_SPLIT gives each DP rank its contiguous share (`share=True`; or a caller hands every rank
  the full batch and the role cuts `Batch.chunk_by_dp`) ->
  micro-batches (`micro_batch_samples` or a `micro_batch_tokens` budget, per DP rank, each trimmed to its longest
  sequence) -> megatron's pipeline schedule -> per-micro-batch results on the last pipeline stage -> original
  sample order -> (full-batch calls only) all-gathered over the DP group. Forward-only results are returned on every
  rank of the last pipeline stage (identical on its TP ranks) and None on the other stages; training metrics on
  every rank.
An update (`_train`) goes mini-batch by mini-batch, one optimizer step each: the controller's DP_SPLIT_MINI_BATCHES
gives each DP rank its part of every mini-batch, concatenated, with the layout in `meta` (`share=True`; or every rank
gets the full batch and cuts the same parts itself), both by the rule of `megarl.data.mini_batches`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megarl.checkpoint.engine_io import load_hf_into_engine
from megarl.data.batch import Batch
from megarl.data.micro_batching import make_micro_batches, plan_micro_batches, restore_order
from megarl.data.mini_batches import SHARE_META, ShareLayout, share_layout
from megarl.engine import MegatronEngine, OptimizerSettings
from megarl.engine.moe import MoeSettings
from megarl.models.spec import ModelSpec
from megarl.parallel.groups import RoleGroups
from megarl.platform.device import compute_device


@dataclasses.dataclass(frozen=True)
class BatchingSettings:
    """How a role cuts a batch.

    Attributes:
        micro_batch_samples: samples per micro-batch, per DP rank (consecutive, original order).
        micro_batch_tokens: padded-token budget per micro-batch, per DP rank (first-fit-decreasing packing);
            exclusive with `micro_batch_samples`; neither = one sample per micro-batch.
        mini_batch_samples: samples per optimizer step, global (all DP ranks); None = one step per epoch.
        epochs: passes over the batch in `update` (PPO epochs).
    """

    micro_batch_samples: Optional[int] = None
    micro_batch_tokens: Optional[int] = None
    mini_batch_samples: Optional[int] = None
    epochs: int = 1

    @classmethod
    def from_config(cls, role_cfg, samples_per_prompt: int = 1, epochs: int = 1) -> "BatchingSettings":
        """From a `megarl.config.schema` role config (`mini_batch_prompts` is converted to samples)."""
        mini = getattr(role_cfg, "mini_batch_prompts", None)
        return cls(
            micro_batch_samples=role_cfg.micro_batch_samples,
            micro_batch_tokens=role_cfg.micro_batch_tokens,
            mini_batch_samples=None if mini is None else mini * samples_per_prompt,
            epochs=epochs,
        )


def optimizer_settings_from_config(opt_cfg, total_steps: int = 1000) -> OptimizerSettings:
    """`OptimizerSettings` from a `megarl.config.schema.OptimizerConfig`."""
    return OptimizerSettings(
        name=opt_cfg.name, lr=opt_cfg.lr, min_lr=opt_cfg.min_lr, weight_decay=opt_cfg.weight_decay,
        betas=tuple(opt_cfg.betas), eps=opt_cfg.eps, clip_grad=opt_cfg.clip_grad,
        warmup_steps=opt_cfg.warmup_steps, total_steps=total_steps, lr_schedule=opt_cfg.lr_schedule,
    )


def count_units(mask: torch.Tensor, agg: str) -> torch.Tensor:
    """Normalisation units of a micro-batch for `agg`: valid tokens (token-mean) or sequences with any."""
    if agg == "token-mean":
        return mask.sum().to(torch.int)
    return (mask.sum(-1) > 0).sum().to(torch.int)


class Role:
    """A Megatron role on this rank: an engine plus batching. Subclasses add the role's methods."""

    head = "lm"

    def __init__(
        self,
        spec: ModelSpec,
        groups: RoleGroups,
        *,
        optimizer: Optional[OptimizerSettings] = None,
        batching: BatchingSettings = BatchingSettings(),
        dtype: str = "fp32",
        seed: int = 1234,
        hf_dir: Optional[str] = None,
        first_stage_layers: Optional[int] = None,
        last_stage_layers: Optional[int] = None,
        recompute: bool = False,
        moe: Optional[MoeSettings] = None,
        vpp: int = 1,
        transforms: Sequence = (),
    ) -> None:
        self.engine = MegatronEngine(
            spec, groups, dtype=dtype, optimizer=optimizer, seed=seed, first_stage_layers=first_stage_layers,
            last_stage_layers=last_stage_layers, recompute=recompute, head=self.head, moe=moe,
            vpp=vpp, transforms=transforms,
        )
        self.batching = batching
        if hf_dir is not None:
            self.load_hf(hf_dir)

    # ------------------------------------------------------------------------------------------- plumbing
    @property
    def groups(self) -> RoleGroups:
        return self.engine.groups

    @property
    def dp(self) -> int:
        """Data-parallel size: the number of different shares of a batch (CP ranks of one replica share one)."""
        return self.groups.topology.dp

    @property
    def dp_rank(self) -> int:
        return self.groups.coord.dp

    def load_hf(self, hf_dir: str) -> int:
        """Load weights from a HuggingFace directory (each rank reads its own shards); returns bytes read."""
        return load_hf_into_engine(self.engine, hf_dir)

    def offload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> dict[str, int]:
        return self.engine.offload(params=params, grads=grads, optimizer=optimizer)

    def reload(self, kinds: Optional[tuple[str, ...]] = None) -> None:
        self.engine.reload(kinds)

    def _plan(self, share: Batch) -> list[list[int]]:
        return plan_micro_batches(
            share.lengths().tolist(), self.batching.micro_batch_samples, self.batching.micro_batch_tokens
        )

    def _forward(self, batch: Batch, keys: list[str], fn: Callable, share: bool = False,
                 routing=None) -> Optional[Batch]:
        """Forward-only over this DP rank's share; `fn(output, mb) -> dict of [b, s] (or [b]) tensors`.

        share=False: `batch` is the whole batch (every rank gets it); returns the whole batch's results (original
        order, [B, S] padded to `batch.seq_len`, all-gathered over DP) on last-stage ranks. share=True: `batch` is
        already this DP rank's share (the controller cut it, `Dispatch.DP_SPLIT`; sizes may differ by one between
        DP ranks); returns the share's results only, no DP collective -- the controller concatenates the shares.
        None on the other pipeline stages in both cases. `routing` (a `megarl.engine.moe.RoutingRecorder`): the
        result also holds `routed_experts` [B, S, L, k] int64, every pipeline stage's MoE layers (summed over the
        pipeline group: each stage fills its own layers).
        """
        if share and len(batch) == 0:
            raise ValueError(f"DP rank {self.dp_rank} received an empty share: send at least dp={self.dp} samples")
        part = batch if share else batch.chunk_by_dp(self.dp_rank, self.dp)
        share_batch = part.select(keys)
        plan = self._plan(share_batch)
        mbs = [mb.to(compute_device()) for mb in make_micro_batches(share_batch, plan)]

        def loss_fn(output, mb):
            results = fn(output, mb)
            zero = output.sum() * 0.0
            # float results in float32; integer ones (a teacher's top-k token ids) keep their dtype
            return zero, torch.tensor(1, dtype=torch.int), {
                k: (v.detach().float() if v.is_floating_point() else v.detach()).cpu() for k, v in results.items()}

        out = self.engine.run([mb.tensors for mb in mbs], loss_fn, forward_only=True, routing=routing)
        routed = None
        if routing is not None:
            parts = [Batch({"routed_experts": routing.routed_experts(i)}) for i in range(len(mbs))]
            routed = restore_order(parts, plan, seq_len=batch.seq_len)["routed_experts"]
            if self.groups.topology.pp > 1:
                routed = routed.to(compute_device())
                dist.all_reduce(routed, group=self.groups.pgs.pp)
                routed = routed.cpu()
        if not self.groups.is_last_stage:
            return None
        local = restore_order([Batch(o) for o in out], plan, seq_len=batch.seq_len)
        if routed is not None:
            local = local.update({"routed_experts": routed})
        return local if share else self._gather_dp(local)

    def _gather_dp(self, local: Batch) -> Batch:
        if self.dp == 1:
            return local
        group = self.groups.pgs.dp  # CP ranks of a replica hold the same (whole-sequence) results
        gathered = {}
        for k, v in local.tensors.items():
            v = v.to(compute_device()).contiguous()  # NCCL needs device tensors
            parts = [torch.empty_like(v) for _ in range(self.dp)]
            dist.all_gather(parts, v, group=group)
            gathered[k] = torch.cat(parts, dim=0).cpu()
        return Batch(gathered, dict(local.meta))

    def _reduce_metrics(self, sums: dict[str, float], keys: list[str]) -> dict[str, float]:
        """Combine per-rank metrics over DP (last stage) and hand them to every pipeline stage: sums, except keys
        ending in `_max` (a maximum)."""
        maxed = [k for k in keys if k.endswith("_max")]
        summed = [k for k in keys if k not in maxed]
        out = {}
        for names, op in ((summed, dist.ReduceOp.SUM), (maxed, dist.ReduceOp.MAX)):
            if not names:
                continue
            t = torch.tensor([sums.get(k, 0.0) for k in names], dtype=torch.float64, device=compute_device())
            if self.groups.is_last_stage and self.dp > 1:
                dist.all_reduce(t, op=op, group=self.groups.pgs.dp)  # CP ranks computed the same metrics
            if self.groups.topology.pp > 1:
                dist.broadcast(t, src=self.groups.pp_ranks[-1], group=self.groups.pgs.pp)
            out.update(zip(names, t.cpu().tolist()))
        return out

    def _share_layout(self, batch: Batch, share: bool) -> ShareLayout:
        """This DP rank's mini-batch layout of an update (`megarl.data.mini_batches`). share=False: `batch` is the
        whole batch, its layout is computed here; share=True: `batch` is this rank's share, cut by the controller
        (`Dispatch.DP_SPLIT_MINI_BATCHES`), whose layout it carries in `meta[SHARE_META]` and which must be the one
        this role would cut (its DP rank, DP size and mini-batch size, and the share's length)."""
        if not share:
            return share_layout(len(batch), self.batching.mini_batch_samples, self.dp, self.dp_rank)
        if SHARE_META not in batch.meta:
            raise ValueError(f"share=True needs the batch's DP share layout in meta[{SHARE_META!r}] (the controller's "
                             "DP_SPLIT_MINI_BATCHES cut, megarl.controller.dispatch.split_mini_batches)")
        got = ShareLayout.from_meta(batch.meta[SHARE_META])
        want = share_layout(got.samples, self.batching.mini_batch_samples, self.dp, self.dp_rank)
        if got != want or len(batch) != len(want):
            raise ValueError(f"DP rank {self.dp_rank} received a share of {len(batch)} rows cut as {got}; this role "
                             f"trains on {len(want)} rows cut as {want}")
        return want

    def _mini_batch_shares(self, batch: Batch, share: bool) -> list[Batch]:
        """This DP rank's part of each mini-batch, in training order (`_share_layout`)."""
        layout = self._share_layout(batch, share)
        return [batch.slice(lo, hi) for lo, hi in (layout.local_bounds if share else layout.rows)]

    def _train(self, batch: Batch, keys: list[str], loss_fn: Callable, metric_keys: list[str],
               routing_factory: Optional[Callable] = None, share: bool = False) -> dict[str, float]:
        """Mini-batch / micro-batch loop with one optimizer step per mini-batch; returns summed metrics.

        share=False: `batch` is the whole batch (every rank gets it) and each rank cuts its part of every mini-batch;
        share=True: `batch` is already this DP rank's part of every mini-batch, concatenated (the controller's
        `Dispatch.DP_SPLIT_MINI_BATCHES`). Either way the rank trains on the same rows in the same order
        (`megarl.data.mini_batches`, the one rule both follow), so the two give the same update.

        `loss_fn(output, mb) -> (loss_sum, units, metric sums)` as `MegatronEngine.run` expects. Metrics named
        `*_max` are combined by maximum (over micro-batches and ranks), the others summed. A mini-batch whose loss
        (the `loss_sum` metric, when the loss reports it) or gradient norm is not finite is not applied
        (`MegatronEngine.step`): `skipped_steps` counts such optimizer steps, `skipped_trailing` those in a row at
        the end of this update (the trainer's `trainer.max_skipped_steps` streak continues across updates).
        `routing_factory()` (MoE): a fresh `megarl.engine.moe` recorder/replayer per engine run; the list of them
        is kept in `self.last_routing` for the caller's metrics.
        """
        batch = batch.select(keys)
        loss_keys = list(metric_keys)
        # real tokens trained on, and micro-batch positions computed (padding included), over all DP ranks
        metric_keys = [*loss_keys, "tokens", "padded_tokens"]
        totals = {k: 0.0 for k in metric_keys}
        steps = []
        self.last_routing: list = []
        start = time.perf_counter()
        parts = self._mini_batch_shares(batch, share)
        for _ in range(self.batching.epochs):
            for part in parts:
                mbs = [mb.to(compute_device()) for mb in make_micro_batches(part, self._plan(part))]
                routing = routing_factory() if routing_factory is not None else None
                if routing is not None:
                    self.last_routing.append(routing)
                out = self.engine.run([mb.tensors for mb in mbs], loss_fn, forward_only=False, routing=routing)
                loss_finite = all(math.isfinite(float(m["loss_sum"])) for m in out if "loss_sum" in m)
                steps.append(self.engine.step(loss_finite=loss_finite))
                if self.groups.is_last_stage:  # counted once per DP rank (the reduction sums the last stage's)
                    totals["tokens"] += float(part.lengths().sum())
                    totals["padded_tokens"] += float(sum(mb.tensors["input_ids"].numel() for mb in mbs))
                for m in out:
                    for k in loss_keys:
                        v = float(m[k])
                        totals[k] = max(totals[k], v) if k.endswith("_max") else totals[k] + v
        elapsed = time.perf_counter() - start
        reduced = self._reduce_metrics(totals, metric_keys)
        reduced["grad_norm"] = sum(s["grad_norm"] for s in steps) / len(steps)
        reduced["lr"] = steps[-1]["lr"]
        reduced["optimizer_steps"] = float(len(steps))
        applied = [bool(s["update_applied"]) for s in steps]
        reduced["skipped_steps"] = float(applied.count(False))
        reduced["skipped_trailing"] = float(len(applied) - (max(i for i, a in enumerate(applied) if a) + 1)
                                            if any(applied) else len(applied))
        tokens = reduced["tokens"]
        # padding share of what the micro-batches computed (padded, not packed: megarl.data.micro_batching)
        reduced["padding_frac"] = 1.0 - tokens / reduced["padded_tokens"] if reduced["padded_tokens"] else 0.0
        reduced["tokens_per_s"] = tokens / elapsed
        reduced["time_s"] = elapsed
        return reduced


def shift_to_tokens(per_position: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[b, s-1] values computed at positions 0..s-2 for the *next* token -> token-aligned [b, s] (0 at t=0),
    zeroed where `mask` is 0."""
    out = torch.nn.functional.pad(per_position, (1, 0))
    return out * mask.to(out.dtype)
