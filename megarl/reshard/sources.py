"""The training side of a reshard: this rank's Megatron parameter tensors by canonical (global-layer) name."""

from __future__ import annotations

import torch


def megatron_sources(engine) -> dict[str, torch.Tensor]:
    """{canonical Megatron name: parameter data} for this rank's model chunk (no copies).

    Canonical names use global layer numbers, global expert numbers (a rank's local expert j is expert
    ep_rank * num_experts / ep + j: `engine_io.expert_offset`) and local-spec suffixes (Transformer Engine's fused
    norm and grouped-GEMM expert names are folded), matching `megarl.reshard.layouts.megatron_holdings`.
    """
    from megarl.checkpoint.engine_io import engine_named_parameters  # megatron-core: on the workers only

    return {canonical: p.data for canonical, _, p in engine_named_parameters(engine)}
