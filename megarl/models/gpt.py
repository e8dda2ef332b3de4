"""Megatron provider: a megatron-core `GPTModel` for a `ModelSpec` at one role's TP/PP/CP layout.

Data path: token ids [batch, seq] int64 and position ids [batch, seq] -> (first stage) embedding ->
this stage's transformer layers -> (last stage) final norm + output layer -> logits [batch, seq, vocab/tp]
(vocab-parallel: each TP rank holds a contiguous slice of the padded vocabulary). Middle stages exchange hidden
states [seq, batch, hidden] through megatron's pipeline schedule.

Layer spec: Transformer Engine's when it is importable and CUDA is present (fused kernels, flash attention),
otherwise megatron-core's local spec; both give the same parameter names in checkpoints.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Optional

import torch
import torch.nn.functional as F

from megarl.models.spec import ModelSpec
from megarl.parallel.groups import RoleGroups
from megarl.parallel.topology import layer_split

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """Megatron pads the vocabulary so that every TP rank holds the same number of rows, a multiple of `multiple`."""
    step = multiple * tp
    return int(math.ceil(vocab_size / step) * step)


_FUSED_SOFTMAX_MODULES = (
    "scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda", "scaled_softmax_cuda",
)


def fused_softmax_kernels_available(cuda: Optional[bool] = None) -> bool:
    """Whether megatron-core's fused softmax (`masked_softmax_fusion`) can run: CUDA plus its compiled kernels.

    megatron-core 0.16.1 `fusions/fused_softmax.py` imports `scaled_masked_softmax_cuda` (and the upper-triangular
    and unmasked variants) inside `get_batch_per_block` / forward as soon as the fusion flag is on and the shapes
    fit; megatron-core does not ship these modules (they come from apex's or Megatron-LM's fused-kernel builds, not
    from Transformer Engine), so without them a local-spec model on CUDA fails at its first fp16/bf16 forward.
    cuda: whether CUDA is usable (default: `torch.cuda.is_available()`).
    """
    if not (torch.cuda.is_available() if cuda is None else cuda):
        return False
    return all(importlib.util.find_spec(m) is not None for m in _FUSED_SOFTMAX_MODULES)


def transformer_engine_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # TE import failures come in many types (ImportError, OSError on missing CUDA libs)
        return False
    return True


def build_transformer_config(
    spec: ModelSpec,
    groups: RoleGroups,
    dtype: str = "fp32",
    first_stage_layers: Optional[int] = None,
    last_stage_layers: Optional[int] = None,
    recompute: bool = False,
    moe_token_dispatcher: str = "alltoall",
    moe_aux_loss_coeff: float = 0.0,
    moe_z_loss_coeff: Optional[float] = None,
):
    """megatron-core `TransformerConfig` for `spec` at this role's layout (dropout off: RL fine-tuning).

    Mixture-of-experts models (`spec.is_moe`) also get megatron-core's MoE settings (`moe_transformer_settings`):
    `moe_token_dispatcher` ("alltoall" or "allgather") over the role's expert-parallel group, the load-balancing
    aux-loss and z-loss coefficients (0 / None: off).
    """
    from megatron.core.transformer import TransformerConfig

    topo = groups.topology
    layer_split(spec.num_layers, topo.pp, first_stage_layers, last_stage_layers)  # validates, names the numbers
    torch_dtype = DTYPES[dtype]
    on_cpu = not torch.cuda.is_available()
    moe = moe_transformer_settings(spec, groups, moe_token_dispatcher, moe_aux_loss_coeff, moe_z_loss_coeff)
    # megatron-core's MoE layer expects tokens split over the TP ranks (sequence parallelism) before it dispatches
    # them: without it each TP rank's identical copy of the tokens reaches every expert shard, which gives correct
    # outputs but tp times the expert-weight gradient, and a training-mode forward raises (moe_layer.py "...tensor
    # parallelism are enabled without also enabling sequence parallelism"). So MoE at tp > 1 always runs sequence
    # parallel: with Transformer Engine's norms, or on the local spec with the torch norms that
    # `megatron_patches.allow_sequence_parallel_torch_norms` admits (build_gpt_model). The engine pads sequences to
    # multiples of tp.
    sequence_parallel = bool(moe) and topo.tp > 1
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.ffn_hidden_size,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_eps,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=topo.tp,
        pipeline_model_parallel_size=topo.pp,
        context_parallel_size=topo.cp,
        num_layers_in_first_pipeline_stage=first_stage_layers,
        num_layers_in_last_pipeline_stage=last_stage_layers,
        sequence_parallel=sequence_parallel,
        params_dtype=torch_dtype,
        pipeline_dtype=torch_dtype,
        bf16=torch_dtype is torch.bfloat16,
        fp16=torch_dtype is torch.float16,
        # On CPU the full weight is initialised once and sliced per TP rank: initial weights do not depend on TP.
        use_cpu_initialization=on_cpu,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=fused_softmax_kernels_available(),
        persist_layer_norm=False,
        recompute_granularity="full" if recompute else None,
        recompute_method="uniform" if recompute else None,
        recompute_num_layers=1 if recompute else None,
        **moe,
    )


MOE_DISPATCHERS = ("alltoall", "allgather")


def moe_transformer_settings(spec: ModelSpec, groups: RoleGroups, dispatcher: str = "alltoall",
                             aux_loss_coeff: float = 0.0, z_loss_coeff: Optional[float] = None) -> dict:
    """megatron-core `TransformerConfig` MoE fields for `spec` ({} for a dense model).

    Router semantics (megatron-core 0.16.1 `moe_utils.topk_routing_with_score_function`, score function softmax):
    the default computes top-k of the router logits, then a softmax over those k, which equals HF's "softmax over
    all experts, top-k, renormalise" (Mixtral; Qwen-MoE `norm_topk_prob=True`); `moe_router_pre_softmax=True` is a
    softmax over all experts then top-k without renormalisation (Qwen-MoE `norm_topk_prob=False`). The router runs
    in fp32 (`moe_router_dtype`), as HF's routers compute their softmax in fp32. Dense and MoE layers follow
    `spec.moe_layers` (`moe_layer_freq` as a per-layer list). Qwen2-MoE's shared expert is
    `moe_shared_expert_intermediate_size` with `moe_shared_expert_gate` (output * sigmoid(x . gate_weight)).
    Experts are split over the role's expert-parallel group (`topology.ep`) and each expert's FFN width over its
    expert tensor-parallel group (`topology.expert_tp`: `etp`, default the dense tp); the groups in
    `megarl.parallel.groups` follow megatron-core's expert grid for both.
    """
    if not spec.is_moe:
        return {}
    if dispatcher not in MOE_DISPATCHERS:
        raise ValueError(f"moe token dispatcher must be one of {MOE_DISPATCHERS}, got {dispatcher!r}")
    topo = groups.topology
    if spec.num_experts % topo.ep != 0:
        raise ValueError(f"ep={topo.ep} does not divide num_experts={spec.num_experts}")
    if spec.moe_ffn_hidden_size % topo.expert_tp != 0:
        raise ValueError(f"expert tensor-parallel size {topo.expert_tp} does not divide "
                         f"moe_ffn_hidden_size={spec.moe_ffn_hidden_size}")
    shared = spec.shared_expert_ffn_hidden_size
    te = transformer_engine_available()
    return dict(
        num_moe_experts=spec.num_experts,
        moe_router_topk=spec.moe_topk,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
        moe_router_pre_softmax=not spec.moe_norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_dtype="fp32",
        moe_layer_freq=[int(x) for x in spec.moe_layers],
        moe_shared_expert_intermediate_size=shared or None,
        moe_shared_expert_gate=bool(shared),
        expert_model_parallel_size=topo.ep,
        expert_tensor_parallel_size=topo.expert_tp,
        moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=te,
        moe_router_load_balancing_type="aux_loss" if aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=aux_loss_coeff,
        moe_z_loss_coeff=z_loss_coeff or None,
        moe_permute_fusion=False,
        moe_router_fusion=False,
    )


def build_gpt_model(spec: ModelSpec, groups: RoleGroups, config, vp_stage: Optional[int] = None,
                    pre_process: Optional[bool] = None, post_process: Optional[bool] = None):
    """This rank's `GPTModel` chunk for `spec` (call inside `megatron_on_cpu()` on CPU machines).

    vp_stage: the virtual pipeline chunk (None without VPP); pre_process / post_process: whether the chunk holds
    the embedding / the final norm and output layer (None: this rank is the first / last pipeline stage)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if spec.is_moe:
        from megarl.platform.megatron_patches import allow_uneven_allgather_dispatch, define_moe_router_gemm_without_te

        define_moe_router_gemm_without_te()
        allow_uneven_allgather_dispatch()
        # per-layer dense/MoE specs (`config.moe_layer_freq`), sliced to this stage's layers; on CPU the local spec
        # with SequentialMLP experts, with TE the grouped-GEMM experts (`config.moe_grouped_gemm`)
        layer_spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=transformer_engine_available(), normalization="RMSNorm",
            vp_stage=vp_stage, pp_rank=groups.coord.pp,
        )
        if config.sequence_parallel and not transformer_engine_available():  # MoE at tp > 1 on the local spec
            from megarl.platform.megatron_patches import allow_sequence_parallel_torch_norms

            allow_sequence_parallel_torch_norms(layer_spec)
    elif transformer_engine_available():
        layer_spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=spec.qk_layernorm)
    else:
        layer_spec = get_gpt_layer_local_spec(qk_layernorm=spec.qk_layernorm, normalization="RMSNorm")
    if groups.topology.cp > 1 and not transformer_engine_available():
        # megatron's local attention has no CP: the all-gather-KV one (megarl/models/context_parallel.py)
        from megarl.models.context_parallel import use_all_gather_cp_attention

        use_all_gather_cp_attention(layer_spec)
    rope_type = spec.rope_scaling.rope_type if spec.rope_scaling else None
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=padded_vocab_size(spec.vocab_size, groups.topology.tp),
        max_sequence_length=spec.max_position_embeddings,
        pre_process=groups.is_first_stage if pre_process is None else pre_process,
        post_process=groups.is_last_stage if post_process is None else post_process,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(spec.rope_theta),
        rope_scaling=rope_type == "llama3",
        rope_scaling_factor=float(spec.rope_scaling["factor"]) if rope_type == "llama3" else 8.0,
        pg_collection=groups.pgs,
        vp_stage=vp_stage,
    )
    topo = groups.topology
    if spec.is_moe and topo.ep == 1 and topo.expert_tp != topo.tp:  # megatron-core would treat experts as dense
        from megarl.platform.megatron_patches import mark_experts_for_expert_data_parallel

        mark_experts_for_expert_data_parallel(model)
    if rope_type is not None:
        # megatron-core 0.16.1 hard-codes low/high_freq_factor=1/4 and original_max_position_embeddings=8192 in
        # RotaryEmbedding._apply_scaling and has no "linear" type (only seq_len_interpolation_factor): set inv_freq
        # to the checkpoint's own frequencies, as transformers computes them (every stage has its own copy).
        model.rotary_pos_emb.inv_freq = rope_inv_freq(spec).to(model.rotary_pos_emb.inv_freq.device)
    return model


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim/2] float32 for `spec.rope_scaling`, as transformers computes them.

    None: theta^(-2i/d). "linear": divided by `factor` (position interpolation). "llama3": Llama-3's smooth
    per-band scaling. Other types are refused by `ModelSpec`.
    """
    rope = spec.rope_scaling
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if not rope:
        return inv_freq
    factor = float(rope["factor"])
    if rope.rope_type == "linear":
        return inv_freq / factor
    low = float(rope.get("low_freq_factor", 1.0))
    high = float(rope.get("high_freq_factor", 4.0))
    old_ctx = float(rope.get("original_max_position_embeddings", 8192))
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)
