"""LoRA adapters on megatron-core's tensor-parallel linears, as a `ModelTransform` (`lora_transform`).

megatron-core 0.16.1 has no LoRA layer of its own: `q_lora_rank` / `kv_lora_rank` in `MLATransformerConfig` are
multi-latent attention's low-rank projections (part of the model, not adapters), and its PEFT lives in
Megatron-Bridge, which does not install beside the CPU stack. So megarl attaches its own, to the local spec's
`ColumnParallelLinear` / `RowParallelLinear`.

Each targeted linear of every transformer layer gets two submodules holding one parameter each, registered on the
linear itself, so its parameters are named e.g. `decoder.layers.0.self_attention.linear_qkv.lora_A.weight`:

    target  module                          kind     lora_A.weight              lora_B.weight
    qkv     self_attention.linear_qkv       column   [rank, hidden] (full)      [qkv_rows / tp, rank] (split)
    proj    self_attention.linear_proj      row      [rank, q_rows / tp] (split) [hidden, rank] (full)
    fc1     mlp.linear_fc1                  column   [rank, hidden] (full)      [2 * ffn / tp, rank] (split)
    fc2     mlp.linear_fc2                  row      [rank, ffn / tp] (split)   [hidden, rank] (full)

Output: `base(x) + (alpha / rank) * B(A(dropout(x)))`, tensor-parallel-correct:
  - column-parallel (input replicated over TP, output split): h = A x is the same on every TP rank; it passes
    megatron's `copy_to_tensor_model_parallel_region` (identity forward, all-reduce backward), so A's gradient and
    x's gradient through the adapter are summed over the TP ranks' output slices (the full gradient, equal on all);
  - row-parallel (input split over TP, output all-reduced): h = sum over TP of A_local x_local through
    `reduce_from_tensor_model_parallel_region` (all-reduce forward, identity backward), then B h, replicated.
The delta is in Megatron's local layout (`lora_delta`): qkv's rows per query group [q_g; k_g; v_g] and fc1's
[gate; up] halves of this TP rank, exactly as the base weight's; the PEFT export converts it like the base weight
(`megarl.checkpoint.lora_export`).

Initialisation (PEFT's default): B = 0, A kaiming-uniform (a = sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in))), drawn on
the full [rank, in_features] tensor from a generator seeded by (seed, global layer number, target) and then sliced
to this rank: identical on every TP rank where replicated, and independent of the TP/PP/VPP layout.

The base is frozen: every parameter that is not an adapter gets requires_grad=False, so megatron-core's DDP and
distributed optimizer see only the adapters. `adapters_disabled(model)` switches every adapter off (the base
model's forward: the reference policy for free).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from typing import Iterable, Iterator, Union

import torch

TARGETS = {  # target key -> (attribute path inside a transformer layer, kind)
    "qkv": (("self_attention", "linear_qkv"), "column"),
    "proj": (("self_attention", "linear_proj"), "row"),
    "fc1": (("mlp", "linear_fc1"), "column"),
    "fc2": (("mlp", "linear_fc2"), "row"),
}
EXPERT_TARGET = "experts"
LORA_PARAM_RE = re.compile(r"(^|\.)lora_[AB]\.weight$")


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """LoRA of the actor (`actor.lora`).

    Attributes:
        rank: r, the inner dimension of B @ A.
        alpha: scaling numerator: the delta is (alpha / rank) * B @ A (PEFT's `lora_alpha`).
        dropout: dropout probability on the adapter's input (training mode only).
        targets: which linears of each layer get adapters: "qkv", "proj", "fc1", "fc2".
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("qkv", "proj", "fc1", "fc2")

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"lora.rank must be >= 1, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        if not self.targets:
            raise ValueError("lora.targets is empty: name at least one of qkv, proj, fc1, fc2")
        for t in self.targets:
            if t == EXPERT_TARGET:
                raise ValueError("lora.targets: 'experts' (adapters on routed experts) is not built yet; use "
                                 "qkv, proj, fc1, fc2 (on a mixture-of-experts model: qkv, proj)")
            if t not in TARGETS:
                raise ValueError(f"lora.targets: unknown target {t!r}; valid: {', '.join(TARGETS)}")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class LoraWeight(torch.nn.Module):
    """One adapter matrix (`weight`), a submodule of the linear it adapts (`lora_A` / `lora_B`)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight)


@dataclasses.dataclass
class _LoraState:
    kind: str  # "column" | "row"
    target: str  # a TARGETS key
    scaling: float
    dropout: float
    tp_group: object
    enabled: bool = True


def is_lora_param(name: str) -> bool:
    """Whether a parameter name (module- or checkpoint-style) is an adapter matrix."""
    return LORA_PARAM_RE.search(name) is not None


def lora_modules(model: Union[torch.nn.Module, Iterable[torch.nn.Module]]) -> Iterator[tuple[str, torch.nn.Module]]:
    """(name, linear) of every adapted linear in `model` (a module, or a list of chunks)."""
    models = [model] if isinstance(model, torch.nn.Module) else list(model)
    for m in models:
        for name, module in m.named_modules():
            if isinstance(getattr(module, "_megarl_lora", None), _LoraState):
                yield name, module


@contextlib.contextmanager
def adapters_disabled(model: Union[torch.nn.Module, Iterable[torch.nn.Module]]):
    """Within the block every adapter of `model` (module or list of chunks) is off: the base model's forward."""
    states = [module._megarl_lora for _, module in lora_modules(model)]
    before = [s.enabled for s in states]
    for s in states:
        s.enabled = False
    try:
        yield
    finally:
        for s, was in zip(states, before):
            s.enabled = was


@torch.no_grad()
def lora_delta(module: torch.nn.Module) -> torch.Tensor:
    """(alpha / rank) * B @ A of an adapted linear, in its base weight's local layout and dtype:
    column-parallel [out / tp, in], row-parallel [out, in / tp]."""
    state = module._megarl_lora
    a, b = module.lora_A.weight, module.lora_B.weight
    return (state.scaling * (b.float() @ a.float())).to(module.weight.dtype)


def _lora_forward_hook(module, args, output):
    state: _LoraState = module._megarl_lora
    if not state.enabled:
        return output
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
    )

    x = args[0]
    if state.dropout > 0:
        x = torch.nn.functional.dropout(x, state.dropout, training=module.training)
    h = torch.nn.functional.linear(x, module.lora_A.weight)
    if state.kind == "column":
        h = copy_to_tensor_model_parallel_region(h, group=state.tp_group)
    else:
        h = reduce_from_tensor_model_parallel_region(h, group=state.tp_group)
    delta = torch.nn.functional.linear(h, module.lora_B.weight) * state.scaling
    out, bias = output
    return out + delta.to(out.dtype), bias


def _seeded_a(seed: int, layer: int, target: str, rank: int, in_features: int) -> torch.Tensor:
    """The full [rank, in_features] A of one adapter, kaiming-uniform (a=sqrt(5)) as PEFT, layout-independent."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + layer * 101 + list(TARGETS).index(target))
    a = torch.empty(rank, in_features, dtype=torch.float32)
    torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=g)
    return a


def _lora_sharded_state_dict(module, original):
    """The linear's megatron-core sharded state dict with the adapters keyed by their own TP split (megatron's
    linears shard only `weight` / `bias` by TP and would save a split B (or A) as if replicated)."""

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        sd = {k: v for k, v in original(prefix, sharded_offsets, metadata).items() if not is_lora_param(k)}
        axis = {"lora_B.weight": 0} if module._megarl_lora.kind == "column" else {"lora_A.weight": 1}
        lora = make_sharded_tensors_for_checkpoint(
            {"lora_A.weight": module.lora_A.weight, "lora_B.weight": module.lora_B.weight}, prefix, axis,
            sharded_offsets, tp_group=module.tp_group, dp_cp_group=metadata["dp_cp_group"])
        if module._megarl_lora.target == "fc1" and module.config.gated_linear_unit:
            # B's rows are [gate_shard; up_shard] per TP rank, as the base weight's: saved as [gate; up] like it
            # (megatron-core's MLP.sharded_state_dict), so that a checkpoint reads back at any TP
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            key = f"{prefix}lora_B.weight"
            lora[key] = apply_swiglu_sharded_factory(lora[key], sharded_offsets,
                                                     (metadata or {}).get("singleton_local_shards", False))
        sd.update(lora)
        return sd

    return sharded_state_dict


def apply_lora(chunks: list, settings: LoraSettings, seed: int, tp_group, tp_rank: int, tp: int,
               is_moe: bool = False, sequence_parallel: bool = False) -> int:
    """Attach adapters to `settings.targets` of every transformer layer in `chunks` and freeze everything else.
    Returns the number of adapted linears on this rank."""
    if sequence_parallel:
        raise ValueError("actor.lora with sequence parallelism (MoE at tp > 1) is not supported: the adapters "
                         "assume a replicated column-parallel input; use tp=1 or a dense model")
    if is_moe and any(t in ("fc1", "fc2") for t in settings.targets):
        raise ValueError(f"actor.lora.targets {list(settings.targets)}: this is a mixture-of-experts model, whose "
                         "MLPs are experts; adapters on experts are not built yet: use targets [qkv, proj]")
    adapted = 0
    for chunk in chunks:
        for p in chunk.parameters():
            p.requires_grad_(False)
        layers = getattr(getattr(chunk, "decoder", None), "layers", None) or []
        for layer in layers:
            for target in settings.targets:
                (parent, attr), kind = TARGETS[target]
                linear = getattr(getattr(layer, parent, None), attr, None)
                if linear is None or not hasattr(linear, "weight"):
                    raise ValueError(f"actor.lora: layer {layer.layer_number} has no {parent}.{attr} to adapt")
                _attach(linear, target, kind, settings, seed, int(layer.layer_number) - 1, tp_group, tp_rank, tp)
                adapted += 1
    return adapted


def _attach(linear, target, kind, settings, seed, layer, tp_group, tp_rank, tp) -> None:
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    weight = linear.weight
    out_local, in_local = weight.shape
    r = settings.rank
    if kind == "column":
        a = _seeded_a(seed, layer, target, r, in_local)
        b = torch.zeros(out_local, r)
    else:
        a = _seeded_a(seed, layer, target, r, in_local * tp)[:, tp_rank * in_local:(tp_rank + 1) * in_local]
        b = torch.zeros(out_local, r)
    linear.lora_A = LoraWeight(a.to(device=weight.device, dtype=weight.dtype).contiguous())
    linear.lora_B = LoraWeight(b.to(device=weight.device, dtype=weight.dtype))
    # megatron's grad-norm and checkpoint code count a TP-split parameter once per rank, a replicated one once
    if kind == "column":
        set_tensor_model_parallel_attributes(linear.lora_B.weight, True, 0, 1)
    else:
        set_tensor_model_parallel_attributes(linear.lora_A.weight, True, 1, 1)
    linear._megarl_lora = _LoraState(kind, target, settings.scaling, settings.dropout, tp_group)
    linear.register_forward_hook(_lora_forward_hook)
    linear.sharded_state_dict = _lora_sharded_state_dict(linear, linear.sharded_state_dict)


def lora_transform(settings: LoraSettings):
    """A `ModelTransform` (megarl.engine.megatron_engine) attaching `settings`' adapters and freezing the base."""

    def transform(chunks: list, ctx) -> None:
        apply_lora(chunks, settings, ctx.seed, ctx.groups.pgs.tp, ctx.groups.coord.tp, ctx.groups.topology.tp,
                   is_moe=ctx.spec.is_moe, sequence_parallel=bool(ctx.config.sequence_parallel))

    transform.lora = settings  # the engine and roles find the settings through the transform
    return transform


def engine_lora_settings(engine):
    """The `LoraSettings` of an engine built with `lora_transform`, else None."""
    for t in getattr(engine, "transforms", ()):
        if getattr(t, "lora", None) is not None:
            return t.lora
    return None
