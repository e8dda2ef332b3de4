"""The training side of a reshard: this rank's Megatron parameter tensors by canonical (global-layer) name."""

from __future__ import annotations

import torch

from megarl.checkpoint.engine_io import stage_layer_offset
from megarl.checkpoint.name_map import canonical_name


def megatron_sources(engine) -> dict[str, torch.Tensor]:
    """{canonical Megatron name: parameter data} for this rank's model chunk (no copies).

    Canonical names use global layer numbers and local-spec suffixes (Transformer Engine's fused norm names are
    folded), matching `megarl.reshard.layouts.megatron_holdings`.
    """
    offset = stage_layer_offset(engine.module)
    return {canonical_name(name, offset): p.data for name, p in engine.module.named_parameters()}
