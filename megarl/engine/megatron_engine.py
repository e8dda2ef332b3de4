"""`MegatronEngine`: one role's megatron-core model on this rank, with its optimizer and pipeline schedule.

Every role (actor, critic, reference, reward model) is a thin layer over this engine. It owns:
  - the `GPTModel` chunk for this rank's pipeline stage, built from a `ModelSpec` at the role's layout;
  - megatron-core's `DistributedDataParallel` (gradient buckets, reduce-scatter over dp*cp) and
    `DistributedOptimizer` (Adam/AdamW, fp32 master weights, grad clipping) with `OptimizerParamScheduler`
    (linear warm-up, then constant or cosine) — absent for frozen roles (reference, reward model at inference);
  - `run(micro_batches, loss_fn, forward_only)`: megatron's pipeline schedule over a list of micro-batches.

Loss normalisation is exact across micro-batches and DP ranks: the engine runs megatron with
`calculate_per_token_loss=True`, so each micro-batch's `loss_fn` returns `(sum of per-unit losses, number of
units, metrics)`; megatron sums gradients over micro-batches and DP ranks and divides once by the global
number of units (tokens for token-mean, sequences for sequence-mean losses).

All process groups come from the role's `RoleGroups`; nothing is read from megatron's global parallel state
(apart from its global memory buffer, which is layout-independent).

Heads: `head="lm"` (default) keeps GPTModel's vocab-parallel output layer; `head="scalar"` replaces it on the last
stage with a `ScalarHead` (hidden -> 1, replicated across TP; see `megarl.engine.heads`) for the critic and the
reward model, whose models are always built untied (the head does not share the embedding).

Offload: `offload(params=, grads=, optimizer=)` moves the chosen state to host memory and frees the device copy
(storage resized to 0, so views such as DDP's parameter and gradient buffers stay valid); `reload()` brings it
back. On CPU the "device" is host memory too: the same bookkeeping runs (and is tested), nothing is saved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable, Optional, Sequence

import torch

from megarl.engine import offload as off
from megarl.engine.heads import attach_scalar_head
from megarl.engine.moe import MoeSettings, enable_routing_hooks
from megarl.models.context_parallel import gather_cp_sequence, split_for_cp_rank
from megarl.models.gpt import build_gpt_model, build_transformer_config, padded_vocab_size
from megarl.models.spec import ModelSpec
from megarl.parallel.groups import RoleGroups
from megarl.platform.megatron_cpu_compat import megatron_on_cpu
from megarl.platform.megatron_patches import default_group_collectives

# A micro-batch: tensors keyed by name. `input_ids` [batch, seq] int64 is required; everything else is passed
# through to the loss function. Sequences are right-padded: causal attention makes padding invisible to
# earlier tokens, so no attention mask is needed.
MicroBatch = dict[str, torch.Tensor]
# loss_fn(logits_shard [batch, seq, vocab_shard] float, micro_batch) -> (loss_sum, num_units, metrics)
LossFn = Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
    """Optimizer and LR schedule of a trainable role.

    Attributes:
        name: 'adamw' (decoupled weight decay) or 'adam' (weight decay as an L2 term in the gradient);
            megatron-core's `decoupled_weight_decay`.
        lr: peak learning rate.
        min_lr: floor of the cosine schedule.
        weight_decay: decoupled weight decay.
        betas: Adam (beta1, beta2).
        eps: Adam epsilon.
        clip_grad: global gradient-norm clip (0 disables).
        warmup_steps: optimizer steps of linear warm-up from 0 to `lr`.
        total_steps: optimizer steps over which the cosine schedule decays to `min_lr`.
        lr_schedule: 'constant' or 'cosine'.
    """

    name: str = "adamw"
    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip_grad: float = 1.0
    warmup_steps: int = 0
    total_steps: int = 1000
    lr_schedule: str = "constant"


class MegatronEngine:
    """This rank's share of one role's model. Construct on every rank of the role, collectively."""

    def __init__(
        self,
        spec: ModelSpec,
        groups: RoleGroups,
        dtype: str = "fp32",
        optimizer: Optional[OptimizerSettings] = None,
        seed: int = 1234,
        first_stage_layers: Optional[int] = None,
        last_stage_layers: Optional[int] = None,
        recompute: bool = False,
        head: str = "lm",
        init_weights: bool = True,
        moe: Optional[MoeSettings] = None,
    ) -> None:
        if not groups.is_member:
            raise ValueError("MegatronEngine built on a rank outside the role's layout")
        if head not in ("lm", "scalar"):
            raise ValueError(f"head must be 'lm' or 'scalar', got {head!r}")
        self.head = head
        if head == "scalar" and spec.tie_word_embeddings:
            spec = dataclasses.replace(spec, tie_word_embeddings=False)
        self.spec = spec
        self.groups = groups
        self._offloaded = None
        self.dtype = dtype
        self.trainable = optimizer is not None
        self.optimizer_settings = optimizer
        self.moe_settings = moe or MoeSettings()
        self._init_weights = init_weights  # False: leave parameters uninitialised (weights are loaded right after)
        with megatron_on_cpu():
            self._build(seed, first_stage_layers, last_stage_layers, recompute)

    # ------------------------------------------------------------------------------------------------ build
    def _build(self, seed: int, first_stage_layers, last_stage_layers, recompute: bool) -> None:
        from megatron.core import parallel_state
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        if parallel_state._GLOBAL_MEMORY_BUFFER is None:  # layout-independent scratch buffer
            parallel_state._set_global_memory_buffer()
        coord = self.groups.coord
        # Model-parallel RNG streams: the same `seed` everywhere, offset by pp rank (as megatron does) so that
        # stages differ; tensor-parallel regions get their own stream.
        torch.manual_seed(seed + 100 * coord.pp)
        model_parallel_cuda_manual_seed(
            seed + 100 * coord.pp, force_reset_rng=True, tp_rank=coord.tp, ep_rank=0, etp_rank=coord.tp
        )
        moe = self.moe_settings
        # Router losses next to a main loss computed on the whole sequence (megatron-core 0.16.1 router.py): each
        # TP (sequence-parallel) or CP rank scales its aux/z-loss by its own token count, megatron divides the
        # z-loss coefficient by tp*cp, and under CP the engine's normaliser counts every unit cp times (the main
        # loss is scaled by cp for it in `_run`, the router losses are not): the z-loss gradient is 1/(tp*cp^2)
        # of the unsplit one. The aux loss too under sequence parallelism (no padding mask); without it (tp 1)
        # megatron's token count is the whole CP group's, because `reduce_from_tensor_model_parallel_region`
        # all-reduces the local expert counts in place (moe_utils.get_tokens_per_expert_and_token_count), so
        # there it is 1/cp. The coefficients are multiplied back to keep the objective layout-independent (exact
        # when the TP/CP slices hold equally many real tokens; at tp 1 the aux loss is exact regardless).
        topo = self.groups.topology
        z_scale = topo.tp * topo.cp ** 2 if self.spec.is_moe else 1
        aux_scale = (topo.tp * topo.cp ** 2 if topo.tp > 1 else topo.cp) if self.spec.is_moe else 1
        self.config = build_transformer_config(
            self.spec, self.groups, self.dtype, first_stage_layers, last_stage_layers, recompute,
            moe_token_dispatcher=moe.token_dispatcher, moe_aux_loss_coeff=moe.aux_loss_coeff * aux_scale,
            moe_z_loss_coeff=moe.z_loss_coeff * z_scale or None,
        )
        self.config.perform_initialization = self._init_weights
        self.config.variable_seq_lengths = True  # micro-batches may differ in length (token-budget batching)
        self.config.calculate_per_token_loss = True  # exact global normalisation, see module docstring
        enable_routing_hooks(self.config)
        model = build_gpt_model(self.spec, self.groups, self.config)
        if self.head == "scalar" and self.groups.is_last_stage:
            attach_scalar_head(model, self.spec.hidden_size, self.config.params_dtype, seed,
                               sp_group=self.groups.pgs.tp if self.config.sequence_parallel else None)
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        if self.trainable:
            ddp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=False,
                use_distributed_optimizer=True,
                # off: megatron's check raises (fatally) on the rank whose local bucket holds a NaN, before the
                # reduce-scatter its peers are waiting in; `step` instead skips on the global grad norm, on every rank
                check_for_nan_in_grad=False,
                bucket_size=40_000_000,
            )
            model = DistributedDataParallel(self.config, ddp_config, model, pg_collection=self.groups.pgs)
            self.config.finalize_model_grads_func = finalize_model_grads
            self._build_optimizer(model)
        else:
            for p in model.parameters():
                p.requires_grad_(False)
            self.optimizer = None
            self.scheduler = None
        self.model = model
        self.steps = 0

    def _build_optimizer(self, model) -> None:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        s = self.optimizer_settings
        if s.name not in ("adam", "adamw"):
            raise ValueError(f"optimizer.name must be adam or adamw, got {s.name!r}")
        if s.lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"optimizer.lr_schedule must be constant or cosine, got {s.lr_schedule!r}")
        torch_dtype = self.config.params_dtype
        opt_config = OptimizerConfig(
            optimizer="adam",
            lr=s.lr,
            min_lr=s.min_lr,
            weight_decay=s.weight_decay,
            adam_beta1=s.betas[0],
            adam_beta2=s.betas[1],
            adam_eps=s.eps,
            clip_grad=s.clip_grad,
            decoupled_weight_decay=s.name == "adamw",
            bf16=torch_dtype is torch.bfloat16,
            fp16=torch_dtype is torch.float16,
            params_dtype=torch_dtype,
            use_distributed_optimizer=True,
        )
        with default_group_collectives(self.groups.pgs.intra_dist_opt):
            self.optimizer = get_megatron_optimizer(
                opt_config, [model], pg_collection=self.groups.pgs, use_gloo_process_groups=False
            )
        if opt_config.bf16 or opt_config.fp16:
            self.config.grad_scale_func = self.optimizer.scale_loss
        total = max(s.total_steps, s.warmup_steps + 1)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if s.warmup_steps > 0 else s.lr,
            max_lr=s.lr,
            min_lr=s.min_lr if s.lr_schedule == "cosine" else s.lr,
            lr_warmup_steps=s.warmup_steps,
            lr_decay_steps=total,
            lr_decay_style="cosine" if s.lr_schedule == "cosine" else "constant",
            start_wd=s.weight_decay,
            end_wd=s.weight_decay,
            wd_incr_steps=total,
            wd_incr_style="constant",
        )

    # ------------------------------------------------------------------------------------------------ info
    @property
    def padded_vocab_size(self) -> int:
        return padded_vocab_size(self.spec.vocab_size, self.groups.topology.tp)

    def vocab_shard(self) -> tuple[int, int]:
        """[start, end) of the *real* (unpadded) vocabulary columns in this TP rank's logits shard."""
        per_rank = self.padded_vocab_size // self.groups.topology.tp
        start = self.groups.coord.tp * per_rank
        end = min(start + per_rank, self.spec.vocab_size)
        return start, max(start, end)

    @property
    def module(self):
        """The bare GPTModel chunk (unwrapped from DDP)."""
        return self.model.module if self.trainable else self.model

    # ------------------------------------------------------------------------------------------------ run
    def run(self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn, forward_only: bool,
            routing=None) -> list[dict[str, Any]]:
        """Run megatron's pipeline schedule over `micro_batches` (same list on every rank of a pipeline).

        `loss_fn` sees this TP rank's logits shard restricted to real vocabulary columns
        ([batch, seq, end-start], see `vocab_shard`), or with `head="scalar"` the head's output [batch, seq, 1].
        The metrics dict may carry tensors of any shape (e.g. per-token log-probs of a forward-only run); they are
        returned as they are. Returns the per-micro-batch metric dicts on the last
        pipeline stage, [] elsewhere. With `forward_only=False` gradients accumulate in the DDP buffers; call
        `step()` afterwards. `routing`: a `megarl.engine.moe.RoutingRecorder` / `RoutingReplayer` of this engine
        (MoE models): entered around the schedule, told each micro-batch before its forward.
        """
        if not micro_batches:
            raise ValueError("run() needs at least one micro-batch")
        self._check_loaded()
        if not forward_only and not self.trainable:
            raise RuntimeError("this role is frozen (no optimizer): run it with forward_only=True")
        with megatron_on_cpu():
            with routing if routing is not None else contextlib.nullcontext():
                return self._run(list(micro_batches), loss_fn, forward_only, routing)

    def _run(self, micro_batches: list[MicroBatch], loss_fn: LossFn, forward_only: bool,
             routing=None) -> list[dict[str, Any]]:
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        start, end = self.vocab_shard()
        local_end = end - start
        scalar_head = self.head == "scalar"
        # sequence parallelism (MoE at tp > 1) splits each CP rank's share of the sequence over TP ranks, context
        # parallelism cuts it into 2*cp chunks: pad it to a multiple of both
        cp = self.groups.topology.cp
        multiple = (self.groups.topology.tp if self.config.sequence_parallel else 1) * (2 * cp if cp > 1 else 1)
        moe_model = self.spec.is_moe

        def padded(length: int) -> int:
            return -(-length // multiple) * multiple

        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            if routing is not None:
                routing.begin_micro_batch(batch)
            tokens = batch["input_ids"].to(device)
            length = tokens.shape[1]
            tokens = torch.nn.functional.pad(tokens, (0, padded(length) - length))  # causal: the tail is invisible
            positions = torch.arange(tokens.shape[1], device=device).unsqueeze(0).expand_as(tokens)
            if cp > 1:  # this CP rank's two chunks of the sequence; see megarl.models.context_parallel
                tokens = split_for_cp_rank(tokens, cp, self.groups.coord.cp)
                positions = split_for_cp_rank(positions, cp, self.groups.coord.cp)
            kwargs = {}
            # router losses and expert load over real tokens only. Not under sequence parallelism: megatron-core
            # 0.16.1 GPTModel._preprocess scatters the mask with the global TP group ("group should not be None"
            # with megarl's per-role groups), so there padding positions count (none in micro-batches of one
            # sample, or of equal lengths that are multiples of tp)
            if moe_model and not self.config.sequence_parallel and "attention_mask" in batch:
                padding = batch["attention_mask"].to(device) == 0  # True = padding (megatron's way)
                padding = torch.nn.functional.pad(padding, (0, padded(length) - length), value=True)
                kwargs["padding_mask"] = split_for_cp_rank(padding, cp, self.groups.coord.cp) if cp > 1 else padding
            output = model(tokens, positions, None, **kwargs)

            def loss_func(logits):
                if cp > 1:  # the whole sequence on every CP rank; each rank's backward keeps its own positions
                    logits = gather_cp_sequence(logits, self.groups.pgs.cp)
                logits = logits[:, :length]
                loss, units, metrics = loss_fn(logits if scalar_head else logits[..., :local_end], batch)
                # Every CP rank computed the same loss and contributes its positions' share of the gradient; the
                # DP reduction sums over dp*cp and divides by the units of all cp copies: scale back by cp.
                return (loss * cp if cp > 1 else loss), units, metrics

            return output, loss_func

        if self.trainable:
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
        seq_length = padded(max(b["input_ids"].shape[1] for b in micro_batches))
        micro_batch_size = max(b["input_ids"].shape[0] for b in micro_batches)
        kwargs = {}
        if self.groups.topology.pp > 1:
            kwargs["p2p_communicator"] = P2PCommunicator(self.groups.pgs.pp, self.config)
        forward_backward = get_forward_backward_func(pp_size=self.groups.topology.pp)
        if forward_only:
            ctx = torch.no_grad()
        else:
            ctx = contextlib.nullcontext()
        with ctx:
            results = forward_backward(
                forward_step_func=forward_step,
                data_iterator=iter(micro_batches),
                model=[self.model],
                num_microbatches=len(micro_batches),
                seq_length=seq_length,
                micro_batch_size=micro_batch_size,
                forward_only=forward_only,
                pg_collection=self.groups.pgs,
                **kwargs,
            )
        return list(results) if self.groups.is_last_stage else []

    def step(self, loss_finite: bool = True) -> dict[str, float]:
        """One optimizer step on the accumulated gradients, skipped when they are not finite.

        megatron-core 0.16.1 checks for inf/nan only through its grad scaler (fp16 loss scaling: `prepare_grads`
        returns found_inf); in fp32 and bf16 there is none, and `optimizer.step()` would clip with a NaN norm
        (`clip_coeff < 1` is False for NaN, so nothing is clipped) and write NaN into every weight. So the engine runs
        megatron's step in its parts: `prepare_grads` (its found-inf check where a scaler exists), the global grad
        norm (`get_grad_norm`, all-reduced over the optimizer's grad-stats group: every rank of the role gets the
        same value and takes the same decision), clipping by that norm, `step_with_ready_grads`. A non-finite norm,
        or `loss_finite=False` on any rank (the caller's loss; combined over the same group), skips the step: weights,
        Adam moments, the LR schedule and `steps` stay as they were; the gradients are discarded by the next `run`.

        Returns grad_norm (L2, before clipping; computed also when clipping is off), lr, update_applied (bool) and
        skip_reason ('' when applied, else 'found_inf', 'grad_norm' or 'loss').
        """
        if not self.trainable:
            raise RuntimeError("this role is frozen (no optimizer)")
        self._check_loaded()
        with megatron_on_cpu():
            ok, grad_norm, reason = self._guarded_step(loss_finite)
            lr = self.optimizer.param_groups[0]["lr"]
            if ok:
                self.scheduler.step(increment=1)
                self.steps += 1
        return {
            "grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
            "lr": float(lr),
            "update_applied": bool(ok),
            "skip_reason": reason,
        }

    def _guarded_step(self, loss_finite: bool) -> tuple[bool, Optional[float], str]:
        """megatron-core 0.16.1 `MixedPrecisionOptimizer.step` / `ChainedOptimizer.step`, with the finite checks."""
        import torch.distributed as dist
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        opt = self.optimizer
        if opt.prepare_grads():  # grads copied to the main (fp32) params; True = the fp16 scaler found inf/nan
            return False, None, "found_inf"
        grad_norm = float(opt.get_grad_norm())
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        bad_loss = torch.tensor([0.0 if loss_finite else 1.0], device=device)
        dist.all_reduce(bad_loss, op=dist.ReduceOp.MAX, group=opt.get_grad_stats_parallel_group())
        if bad_loss.item() > 0:
            return False, grad_norm, "loss"
        if not math.isfinite(grad_norm):
            return False, grad_norm, "grad_norm"
        for sub in getattr(opt, "chained_optimizers", [opt]):
            if sub.config.clip_grad > 0 and not getattr(sub, "is_stub_optimizer", False) and sub.get_parameters():
                clip_grad_by_total_norm_fp32(sub.get_parameters(), sub.config.clip_grad, grad_norm,
                                             sub.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
        return bool(opt.step_with_ready_grads()), grad_norm, ""

    # ------------------------------------------------------------------------------------------------ offload
    def offload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> dict[str, int]:
        """Move the chosen state to host memory and free it on the device; returns bytes moved per kind.

        Kinds already in host memory are left as they are, so the state can go in stages (the trainer offloads
        gradients and optimizer state right after the update, the parameters after the reshard has read them).
        Call `reload()` (brings back every kind) before the next `run`/`step`.
        """
        pools = self.__dict__.setdefault("_host_pools", {"params": [], "grads": [], "optimizer": []})
        state = self._offloaded or off.OffloadedState({"params": [], "grads": [], "optimizer": []})
        wanted = {"params": (params, off.param_tensors), "grads": (grads, off.grad_tensors),
                  "optimizer": (optimizer, off.optimizer_tensors)}
        moved = {}
        for kind, (want, tensors) in wanted.items():
            if want and not state.stashed[kind]:
                state.stashed[kind] = off.stash(tensors(self), pools[kind])
                moved[kind] = state.bytes(kind)
            else:
                moved[kind] = 0
        self._offloaded = state if state.kinds else None
        return moved

    def reload(self, kinds: Optional[tuple[str, ...]] = None) -> None:
        """Bring back what `offload` moved: every kind (None), or only `kinds` (e.g. ("params",) for a reader of
        the weights such as the reshard; `run`/`step` still refuse while any kind is in host memory)."""
        if self._offloaded is None:
            return
        for kind, pairs in self._offloaded.stashed.items():
            if pairs and (kinds is None or kind in kinds):
                off.restore(pairs)
                self._offloaded.stashed[kind] = []
        if not self._offloaded.kinds:
            self._offloaded = None

    def _check_loaded(self) -> None:
        if self._offloaded is not None:
            raise RuntimeError(f"state is offloaded ({', '.join(self._offloaded.kinds)}): call reload() first")

    @property
    def offloaded(self) -> list[str]:
        """Kinds of state currently in host memory ('params', 'grads', 'optimizer')."""
        return [] if self._offloaded is None else self._offloaded.kinds
