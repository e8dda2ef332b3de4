"""`MegatronEngine`: one role's megatron-core model on this rank, with its optimizer and pipeline schedule.

Every role (actor, critic, reference, reward model) is a thin layer over this engine. It owns:
  - the `GPTModel` chunk(s) for this rank's pipeline stage, built from a `ModelSpec` at the role's layout: one, or
    `vpp` virtual pipeline chunks (megatron-core's interleaved 1F1B schedule; see `vpp` below);
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

Virtual pipeline parallelism (`vpp > 1`, megatron-core `virtual_pipeline_model_parallel_size`): the layers are cut
into pp*vpp equal chunks; pipeline rank r builds chunks r, r+pp, ..., r+(vpp-1)*pp as `vp_stage` 0..vpp-1 (megatron
numbers each chunk's layers globally), the embedding lives in chunk 0 of the first stage, the final norm and
output layer in the last chunk of the last stage. Each chunk has its own DDP wrapper, one distributed optimizer
covers them all, and `run` drives megatron's interleaved schedule. That schedule needs a micro-batch count that
is a multiple of pp: `run` pads the list with one-token micro-batches that contribute nothing (zero loss, zero
units; their routers run with the aux / z-loss off and are neither recorded nor counted) and drops their results.
Mixture-of-experts models: routing records and replays are kept per (chunk, micro-batch) forward (`run` tells the
recorder which micro-batch each chunk's forward belongs to); what MoE cannot combine with vpp > 1: `check_moe_vpp`.
`chunks` lists the bare chunks; `module` is the only chunk at vpp=1, a
`torch.nn.ModuleList` of the chunks otherwise (for `parameters()` / `modules()`; its parameter names carry the
chunk index: use `megarl.checkpoint.engine_io.named_layouts` / `engine_named_parameters` for canonical names).

Build, in four steps (`_build`), so that a change of the model is a transform, not an edit of the engine:
  1. build: megatron-core's `GPTModel` chunk(s) of this rank (`_build_chunks`);
  2. transform: each `ModelTransform` in order, `transform(chunks, BuildContext)`, in place on the bare chunks: the
     engine's own (`attach_scalar_head_transform` for head="scalar", `freeze_all` for a role without an optimizer),
     then the caller's `transforms` (e.g. `freeze_parameters(predicate)`; LoRA adapters or a value head swap are
     written the same way);
  3. wrap: megatron-core's `DistributedDataParallel` per chunk, over the parameters that still require grad
     (`_wrap`, trainable roles only);
  4. optimizer: megatron-core's distributed optimizer and LR scheduler over those parameters (`_build_optimizer`).

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
from megarl.engine.moe import MoeSettings, enable_routing_hooks, moe_routers
from megarl.models.context_parallel import gather_cp_sequence, split_for_cp_rank
from megarl.models.gpt import build_gpt_model, build_transformer_config, padded_vocab_size
from megarl.models.spec import ModelSpec
from megarl.parallel.groups import RoleGroups
from megarl.platform.megatron_cpu_compat import megatron_on_cpu
from megarl.platform.megatron_patches import default_group_collectives, unbatched_p2p_for_two_stage_gloo_ring

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


_FILLER: Any = object()  # a micro-batch that pads the interleaved schedule's count (MegatronEngine._run)


def _filler_loss(output: torch.Tensor):
    """Loss of a filler micro-batch: zero, counting zero units; its graph still reaches every parameter it used."""
    return output.sum() * 0.0, torch.tensor(0, dtype=torch.int, device=output.device), {}


def _multi_tensor_adam_on_cpu(optimizer) -> None:
    """Give torch's Adam/AdamW inside megatron's optimizer its multi-tensor (`foreach`) step where none was chosen.

    Without TE or apex megatron-core 0.16.1 builds `torch.optim.Adam(W)` with `foreach` unset, and torch resolves an
    unset `foreach` to the per-tensor loop for CPU tensors (its multi-tensor default is for CUDA ones): ~10 Python
    ops per parameter a step, each through the CPU layer's function mode. The multi-tensor step gives the same
    values bit for bit (torch's two implementations of one update); 27 parameters of the 0.6M-parameter
    `benchmarks/vs_trl.py` model: ~7 -> ~2 ms a step on a 2-core AMD EPYC (AVX2). On CUDA torch already picks it,
    and TE's / apex's fused Adam are left alone."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = getattr(inner, "optimizer", None)
        if type(torch_optimizer) in (torch.optim.Adam, torch.optim.AdamW):
            for group in torch_optimizer.param_groups:
                if group.get("foreach") is None:
                    group["foreach"] = True


def check_vpp(num_layers: int, pp: int, vpp: int, first_stage_layers=None, last_stage_layers=None) -> int:
    """`vpp` when megarl can build that many virtual pipeline chunks per stage, else ValueError saying why.
    (Mixture-of-experts models work at vpp > 1; what they cannot combine with it: `check_moe_vpp`.)"""
    if vpp < 1:
        raise ValueError(f"vpp must be >= 1, got {vpp}")
    if vpp == 1:
        return vpp
    if pp < 2:
        raise ValueError(f"vpp={vpp} needs pp > 1 (virtual pipeline chunks interleave pipeline stages), got pp={pp}")
    if first_stage_layers is not None or last_stage_layers is not None:
        raise ValueError("vpp > 1 with first_stage_layers / last_stage_layers is not supported: use an even split")
    if num_layers % (pp * vpp):
        raise ValueError(f"num_layers={num_layers} must be divisible by pp*vpp={pp}*{vpp} (equal virtual chunks)")
    return vpp


def check_moe_vpp(vpp: int, tp: int, router_losses: bool, recompute: bool = False) -> None:
    """ValueError for what a mixture-of-experts model cannot combine with vpp > 1 (megatron-core 0.16.1):

    - router aux/z losses at tp > 1: MoE at tp > 1 runs sequence-parallel, where megatron-core's GPTModel cannot take
      a padding mask (it scatters it with the global TP group), so the router losses count every position fed; the
      interleaved schedule needs one micro-batch shape, so `_run` pads every micro-batch to the largest one, and that
      padding would enter the aux/z losses (the objective would depend on vpp and on the batching);
    - activation recomputation: a filler micro-batch's router losses are switched off during its forward only
      (`_run`), a recomputed forward in backward would attach them again.
    """
    if vpp == 1:
        return
    if router_losses and tp > 1:
        raise ValueError(f"vpp={vpp} with MoE router losses (aux_loss_coeff / z_loss_coeff > 0) at tp={tp} is not "
                         "supported: under sequence parallelism megatron-core 0.16.1 takes no padding mask, so the "
                         "interleaved schedule's padding to one micro-batch shape would enter the router losses; use "
                         "tp=1, vpp=1, or router-loss coefficients 0")
    if recompute:
        raise ValueError(f"vpp={vpp} with activation recomputation on a MoE model is not supported (a filler "
                         "micro-batch's recomputed forward would add router losses); use vpp=1 or no recompute")


@dataclasses.dataclass(frozen=True)
class BuildContext:
    """What a `ModelTransform` may read: the model's spec, the role's groups and megatron `TransformerConfig`, the
    build seed, whether the role trains (has an optimizer) and its head ("lm" | "scalar")."""

    spec: ModelSpec
    groups: RoleGroups
    config: Any
    seed: int
    trainable: bool
    head: str


# A model transform: changes this rank's bare GPTModel chunks in place before DDP and the optimizer see them
# (attach or swap modules, set requires_grad). Chunks are listed in virtual-pipeline order.
ModelTransform = Callable[[list, BuildContext], None]


def attach_scalar_head_transform(chunks: list, ctx: BuildContext) -> None:
    """head="scalar": the last stage's output layer replaced by a `ScalarHead` (hidden -> 1)."""
    if ctx.groups.is_last_stage:
        attach_scalar_head(chunks[-1], ctx.spec.hidden_size, ctx.config.params_dtype, ctx.seed,
                           sp_group=ctx.groups.pgs.tp if ctx.config.sequence_parallel else None)
        if torch.cuda.is_available():
            chunks[-1].cuda(torch.cuda.current_device())


def freeze_all(chunks: list, ctx: BuildContext) -> None:
    """Every parameter frozen (a role without an optimizer: reference, reward model at inference)."""
    for chunk in chunks:
        for p in chunk.parameters():
            p.requires_grad_(False)


def freeze_parameters(predicate: Callable[[str], bool]) -> ModelTransform:
    """A transform freezing the parameters whose name within their chunk (e.g. "embedding.word_embeddings.weight",
    "decoder.layers.0.self_attention.linear_qkv.weight") satisfies `predicate`; raises when it matches none (a
    misspelt pattern would otherwise train everything)."""

    def transform(chunks: list, ctx: BuildContext) -> None:
        frozen = 0
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                if predicate(name):
                    p.requires_grad_(False)
                    frozen += 1
        if not frozen:
            names = [n for chunk in chunks for n, _ in chunk.named_parameters()]
            raise ValueError(f"freeze_parameters: the predicate matches none of this rank's {len(names)} "
                             f"parameters (e.g. {names[:3]})")

    return transform


class MegatronEngine:
    """This rank's share of one role's model. Construct on every rank of the role, collectively.

    transforms: `ModelTransform`s applied after the engine's own, before DDP and the optimizer (module docstring)."""

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
        vpp: int = 1,
        transforms: Sequence[ModelTransform] = (),
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
        self.transforms = tuple(transforms)
        self.vpp = check_vpp(spec.num_layers, groups.topology.pp, vpp, first_stage_layers, last_stage_layers)
        if spec.is_moe:
            check_moe_vpp(self.vpp, groups.topology.tp, recompute=recompute, router_losses=self.trainable and (
                self.moe_settings.aux_loss_coeff > 0 or self.moe_settings.z_loss_coeff > 0))
        with megatron_on_cpu():
            self._build(seed, first_stage_layers, last_stage_layers, recompute)

    # ------------------------------------------------------------------------------------------------ build
    def _build(self, seed: int, first_stage_layers, last_stage_layers, recompute: bool) -> None:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        if parallel_state._GLOBAL_MEMORY_BUFFER is None:  # layout-independent scratch buffer
            parallel_state._set_global_memory_buffer()
        coord = self.groups.coord
        expert = self.groups.topology.expert_coord(coord.rank)
        # Model-parallel RNG streams: the same `seed` everywhere, offset by pp rank (as megatron does) so that
        # stages differ; tensor-parallel regions get their own stream, expert layers one per (ep, etp) rank.
        torch.manual_seed(seed + 100 * coord.pp)
        model_parallel_cuda_manual_seed(
            seed + 100 * coord.pp, force_reset_rng=True, tp_rank=coord.tp, ep_rank=expert.ep, etp_rank=expert.etp
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
        # micro-batches may differ in length (token-budget batching); under VPP `_run` pads them to one shape instead
        self.config.variable_seq_lengths = self.vpp == 1
        self.config.calculate_per_token_loss = True  # exact global normalisation, see module docstring
        if self.vpp > 1:  # megatron-core's layer offsets (get_transformer_layer_offset) read it from the config
            self.config.virtual_pipeline_model_parallel_size = self.vpp
            unbatched_p2p_for_two_stage_gloo_ring(self.config, self.groups.pgs.pp)
        enable_routing_hooks(self.config)
        chunks = self._build_chunks()
        ctx = BuildContext(self.spec, self.groups, self.config, seed, self.trainable, self.head)
        for transform in self._engine_transforms() + self.transforms:
            transform(chunks, ctx)
        self.chunks = chunks
        self._chunk_routers = [moe_routers(chunk) for chunk in chunks]  # [] per chunk for dense models
        if self.trainable:
            self.models = self._wrap(chunks)
            self._build_optimizer(self.models)
        else:
            self.models = list(chunks)
            self.optimizer = None
            self.scheduler = None
        self.steps = 0

    def _build_chunks(self) -> list:
        """Build: this rank's GPTModel chunk(s) (one per virtual pipeline stage), on the device."""
        chunks = []
        for c in range(self.vpp):
            chunk = build_gpt_model(
                self.spec, self.groups, self.config, vp_stage=c if self.vpp > 1 else None,
                pre_process=self.groups.is_first_stage and c == 0,
                post_process=self.groups.is_last_stage and c == self.vpp - 1,
            )
            if torch.cuda.is_available():
                chunk.cuda(torch.cuda.current_device())
            chunks.append(chunk)
        return chunks

    def _engine_transforms(self) -> tuple:
        """The engine's own transforms: the scalar head (head="scalar"), freezing (no optimizer)."""
        return ((attach_scalar_head_transform,) if self.head == "scalar" else ()) + \
            (() if self.trainable else (freeze_all,))

    def _wrap(self, chunks: list) -> list:
        """Wrap: megatron-core DDP per chunk (over the parameters that require grad)."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        if not any(p.requires_grad for chunk in chunks for p in chunk.parameters()):
            raise ValueError("every parameter of this rank is frozen (by a transform) but the role has an "
                             "optimizer: unfreeze some, or build the role without one")
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=True,
            # off: megatron's check raises (fatally) on the rank whose local bucket holds a NaN, before the
            # reduce-scatter its peers are waiting in; `step` instead skips on the global grad norm, on every rank
            check_for_nan_in_grad=False,
            bucket_size=40_000_000,
        )
        # one DDP per chunk; buckets for the first only (megatron's get_model: later chunks' grads are reduced as
        # their own whole buffers)
        models = [DistributedDataParallel(self.config, ddp_config, chunk, pg_collection=self.groups.pgs,
                                          disable_bucketing=c > 0)
                  for c, chunk in enumerate(chunks)]
        self.config.finalize_model_grads_func = finalize_model_grads
        return models

    def _build_optimizer(self, models: list) -> None:
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
                opt_config, models, pg_collection=self.groups.pgs, use_gloo_process_groups=False
            )
        _multi_tensor_adam_on_cpu(self.optimizer)
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
    def model(self):
        """The model as megatron's schedule sees it (DDP-wrapped when trainable); vpp=1 only (else `models`)."""
        if self.vpp > 1:
            raise AttributeError("engine.model is the single chunk of vpp=1: with vpp > 1 use engine.models")
        return self.models[0]

    @property
    def module(self):
        """The bare GPTModel (unwrapped from DDP) at vpp=1; with vpp > 1 a `torch.nn.ModuleList` of the chunks (its
        parameter names are prefixed by the chunk index)."""
        return self.chunks[0] if self.vpp == 1 else torch.nn.ModuleList(self.chunks)

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
            # (chunk, micro-batch index): under the interleaved schedule the forwards of one micro-batch's chunks run
            # at different times, interleaved with other micro-batches'
            chunk, index = next(data_iterator)
            batch = micro_batches[index]
            filler = batch is _FILLER  # see _filled_to_pipeline_multiple: one token, nothing to the loss
            if filler:
                batch = {"input_ids": torch.zeros(1, 1, dtype=torch.long)}
            tokens = batch["input_ids"].to(device)
            rows, length = tokens.shape
            # causal: the padded tail is invisible to real tokens; padded rows are cut off before the loss
            extra_len, extra_rows = (seq_length - length, micro_batch_size - rows) if uniform else \
                (padded(length) - length, 0)
            if routing is not None and filler:
                routing.begin_filler()
            elif routing is not None:  # fed grid: the micro-batch's own (padded to the tp / cp multiple) is True
                own = torch.ones(rows, padded(length), dtype=torch.bool)
                routing.begin_micro_batch(batch, index, torch.nn.functional.pad(
                    own, (0, length + extra_len - padded(length), 0, extra_rows), value=False))
            tokens = torch.nn.functional.pad(tokens, (0, extra_len, 0, extra_rows))
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
                padding = torch.nn.functional.pad(padding, (0, extra_len, 0, extra_rows), value=True)
                kwargs["padding_mask"] = split_for_cp_rank(padding, cp, self.groups.coord.cp) if cp > 1 else padding
            if filler:  # no router aux / z-loss from a filler: megatron-core attaches them only in training mode
                routers = self._chunk_routers[chunk]
                was_training = [router.training for router in routers]
                for router in routers:
                    router.training = False
                try:
                    output = model(tokens, positions, None, **kwargs)
                finally:
                    for router, mode in zip(routers, was_training):
                        router.training = mode
                return output, _filler_loss
            output = model(tokens, positions, None, **kwargs)

            def loss_func(logits):
                if cp > 1:  # the whole sequence on every CP rank; each rank's backward keeps its own positions
                    logits = gather_cp_sequence(logits, self.groups.pgs.cp)
                logits = logits[:rows, :length]
                loss, units, metrics = loss_fn(logits if scalar_head else logits[..., :local_end], batch)
                # Every CP rank computed the same loss and contributes its positions' share of the gradient; the
                # DP reduction sums over dp*cp and divides by the units of all cp copies: scale back by cp.
                return (loss * cp if cp > 1 else loss), units, metrics

            return output, loss_func

        if self.trainable:
            for m in self.models:
                m.zero_grad_buffer()
            self.optimizer.zero_grad()
        seq_length = padded(max(b["input_ids"].shape[1] for b in micro_batches))
        micro_batch_size = max(b["input_ids"].shape[0] for b in micro_batches)
        real = len(micro_batches)
        micro_batches = self._filled_to_pipeline_multiple(micro_batches)
        # megatron-core 0.16.1's interleaved schedule with variable_seq_lengths failed here in backward with
        # micro-batches of different shapes ("Mismatch in shape: grad_output[0] [14, 1, 64] vs output[0] [12, 1, 64]"
        # at pp2 x vpp2) and deadlocked in its shape exchange with 2 micro-batches at pp2: under VPP every micro-batch
        # is padded to the largest one's [rows, length] and the shapes are fixed (variable_seq_lengths off)
        uniform = self.vpp > 1
        kwargs = {}
        if self.groups.topology.pp > 1:
            kwargs["p2p_communicator"] = P2PCommunicator(self.groups.pgs.pp, self.config)
        forward_backward = get_forward_backward_func(pp_size=self.groups.topology.pp,
                                                     vp_size=self.vpp if self.vpp > 1 else None)
        # the interleaved schedule takes one data iterator per chunk; each chunk reads every micro-batch once
        data = [iter([(c, i) for i in range(len(micro_batches))]) for c in range(self.vpp)]
        data = data if self.vpp > 1 else data[0]
        if forward_only:
            ctx = torch.no_grad()
        else:
            ctx = contextlib.nullcontext()
        with ctx:
            results = forward_backward(
                forward_step_func=forward_step,
                data_iterator=data,
                model=list(self.models),
                num_microbatches=len(micro_batches),
                seq_length=seq_length,
                micro_batch_size=micro_batch_size,
                forward_only=forward_only,
                pg_collection=self.groups.pgs,
                **kwargs,
            )
        return list(results)[:real] if self.groups.is_last_stage else []

    def _filled_to_pipeline_multiple(self, micro_batches: list[MicroBatch]) -> list:
        """megatron-core 0.16.1's interleaved schedule (`forward_backward_pipelining_with_interleaving`) groups
        micro-batches by `microbatch_group_size_per_vp_stage` (= pp) and raises unless their number is a multiple of
        pp: append fillers (one-token forwards with zero loss and zero units, so gradients and the per-token
        normalisation are unchanged) up to the next multiple; their results come last and are dropped."""
        pp = self.groups.topology.pp
        if self.vpp == 1 or len(micro_batches) % pp == 0:
            return micro_batches
        return micro_batches + [_FILLER] * (pp - len(micro_batches) % pp)

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
