"""The training side of a reshard: this rank's Megatron parameter tensors by canonical (global-layer) name."""

from __future__ import annotations

import re

import torch

from megarl.checkpoint.engine_io import stage_layer_offset
from megarl.checkpoint.name_map import canonical_name

_LOCAL_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def global_expert_name(canonical: str, expert_offset: int) -> str:
    """`...mlp.experts.local_experts.{k}.…` (megatron-core SequentialMLP numbers a rank's experts from 0) -> the
    global expert index k + expert_offset used by `name_map` and the reshard holdings; other names unchanged.

    expert_offset: first global expert of this rank = ep_rank * num_experts / ep (megatron-core moe_layer.py
    `local_expert_indices_offset`)."""
    m = _LOCAL_EXPERT.match(canonical)
    return f"{m.group(1)}{int(m.group(2)) + expert_offset}{m.group(3)}" if m else canonical


def megatron_sources(engine, expert_offset: int = 0) -> dict[str, torch.Tensor]:
    """{canonical Megatron name: parameter data} for this rank's model chunk (no copies).

    Canonical names use global layer numbers, global expert numbers (`expert_offset`: see `global_expert_name`)
    and local-spec suffixes (Transformer Engine's fused norm names are folded), matching
    `megarl.reshard.layouts.megatron_holdings`.
    """
    offset = stage_layer_offset(engine.module)
    return {global_expert_name(canonical_name(name, offset), expert_offset): p.data
            for name, p in engine.module.named_parameters()}
