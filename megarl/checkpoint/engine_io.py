"""HF weights straight into a live `MegatronEngine` (no offline step), and full-vocab logits out of one.

`load_hf_into_engine` runs on every rank of a role independently (no collectives): each rank reads only the
slices of the HF tensors its own shards need (`name_map.build_shard`) and copies them into its parameters in
place, then refreshes the optimizer's fp32 master copies when there are any.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megarl.checkpoint.errors import CheckpointError
from megarl.checkpoint.hf_io import HFReader
from megarl.checkpoint.name_map import ParamLayout, build_shard, canonical_name, module_param_layout, validate_tp
from megarl.engine import MegatronEngine
from megarl.engine.heads import HF_HEAD_NAME, MEGATRON_HEAD_NAME
from megarl.engine.lora import is_lora_param


def stage_layer_offset(module) -> int:
    """Global number of this pipeline stage's first transformer layer (0 on the first stage)."""
    layers = getattr(getattr(module, "decoder", None), "layers", None)
    if layers is None or len(layers) == 0:
        return 0
    return int(layers[0].layer_number) - 1


def expert_offset(engine) -> int:
    """Global index of this rank's first routed expert: ep_rank * num_experts / ep (0 for dense models).

    The expert-parallel rank is this rank's position in the role's expert-parallel group, as megatron-core's
    MoE layer numbers its local experts (`MoELayer.local_expert_indices`)."""
    spec, topo = engine.spec, engine.groups.topology
    if not spec.is_moe or topo.ep == 1:
        return 0
    return dist.get_rank(engine.groups.pgs.ep) * (spec.num_experts // topo.ep)


def shard_rank(engine, layout: ParamLayout) -> tuple[int, int]:
    """(rank, size) of the tensor-parallel split of `layout` on this rank: routed experts are split over the expert
    tensor-parallel group (megatron-core's `expt_tp`: `RoleTopology.expert_coord`), everything else (router and
    shared expert included) over the dense TP group."""
    topo, coord = engine.groups.topology, engine.groups.coord
    if layout.expert is not None:
        return topo.expert_coord(coord.rank).etp, topo.expert_tp
    return coord.tp, topo.tp


def engine_canonical_name(engine, name: str) -> str:
    """`canonical_name` of this rank's module parameter `name` (global layer and expert numbers); vpp=1 only (a
    chunk-local name is ambiguous across virtual pipeline chunks: use `engine_named_parameters`)."""
    if engine.vpp > 1:
        raise ValueError("engine_canonical_name needs vpp=1: use engine_named_parameters for virtual pipeline chunks")
    return canonical_name(name, stage_layer_offset(engine.module), expert_offset(engine))


def engine_named_parameters(engine) -> Iterator[tuple[str, str, torch.nn.Parameter]]:
    """(canonical name, chunk-local module name, parameter) for every parameter of every model chunk of this rank
    (one chunk, or `engine.vpp` virtual pipeline chunks; megatron numbers each chunk's layers globally, so a chunk's
    local layer i is global layer `stage_layer_offset(chunk) + i`)."""
    experts = expert_offset(engine)
    for chunk in engine.chunks:
        offset = stage_layer_offset(chunk)
        for name, param in chunk.named_parameters():
            yield canonical_name(name, offset, experts), name, param


def named_layouts(engine) -> Iterator[tuple[str, torch.nn.Parameter, ParamLayout]]:
    """(chunk-local module name, parameter, layout) for every parameter of this rank's model chunks."""
    for canonical, name, param in engine_named_parameters(engine):
        yield name, param, module_param_layout(engine.spec, canonical)


def check_same_model(engine_spec, hf_spec, ignore: tuple[str, ...] = ()) -> None:
    """Raise `CheckpointError` naming every model field (except `ignore`) where engine and checkpoint differ."""
    fields = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "head_dim",
              "ffn_hidden_size", "vocab_size", "qkv_bias", "qk_layernorm", "tie_word_embeddings",
              "num_experts", "moe_topk", "moe_ffn_hidden_size", "moe_norm_topk_prob", "moe_layers",
              "shared_expert_ffn_hidden_size")
    diff = [f"{f}: engine {getattr(engine_spec, f)} vs checkpoint {getattr(hf_spec, f)}"
            for f in fields if f not in ignore and getattr(engine_spec, f) != getattr(hf_spec, f)]
    if diff:
        raise CheckpointError("checkpoint does not match the model: " + "; ".join(diff))


@torch.no_grad()
def load_hf_into_engine(engine, hf_dir: str, reader: Optional[HFReader] = None) -> int:
    """Copy the HF checkpoint at `hf_dir` into `engine`'s parameters in place. Returns bytes read by this rank.

    A scalar-head engine (critic, reward model: `engine.head == "scalar"`, always built untied) reads its body
    from the directory's decoder tensors whether that model is tied or not (its language-model head is ignored),
    and its head from `score.weight` [1, hidden] when the directory has one (the name transformers'
    `*ForTokenClassification` / `*ForSequenceClassification` with num_labels=1 use); otherwise the head keeps its
    seeded initialisation (a critic initialised from the actor).
    """
    reader = reader or HFReader(hf_dir)
    scalar = engine.head == "scalar"
    check_same_model(engine.spec, reader.spec, ignore=("tie_word_embeddings",) if scalar else ())
    # the body's layouts are the HF model's (tied or not, the embedding is read the same way)
    spec = reader.spec if scalar else engine.spec
    topo = engine.groups.topology
    validate_tp(spec, topo.tp, topo.expert_tp)
    nbytes = 0
    for canonical, name, param in engine_named_parameters(engine):
        if is_lora_param(name):  # LoRA adapters (megarl.engine.lora) are not in the base; they keep their init
            continue
        if scalar and name == MEGATRON_HEAD_NAME:
            if HF_HEAD_NAME in reader.files:
                t = reader.read(HF_HEAD_NAME)
                if tuple(t.shape) != tuple(param.shape):
                    raise CheckpointError(f"{hf_dir}: {HF_HEAD_NAME} is {list(t.shape)}, expected {list(param.shape)}")
                param.data.copy_(t)
                nbytes += t.numel() * t.element_size()
            continue
        # routed experts: only this expert-parallel rank's experts are read, one at a time, sliced by expert TP
        layout = module_param_layout(spec, canonical)
        shard = build_shard(spec, layout, *shard_rank(engine, layout), reader.read)
        if tuple(shard.shape) != tuple(param.shape):
            raise CheckpointError(
                f"{name}: built shard {list(shard.shape)} from {layout.hf_names} "
                f"but the parameter is {list(param.shape)}"
            )
        param.data.copy_(shard)
        nbytes += shard.numel() * shard.element_size()
    refresh_optimizer_copies(engine)
    return nbytes


def refresh_optimizer_copies(engine) -> None:
    """After writing model parameters in place, copy them into the optimizer's fp32 master weights (bf16/fp16)."""
    opt = getattr(engine, "optimizer", None)
    if opt is not None and hasattr(opt, "reload_model_params"):
        opt.reload_model_params()


@torch.no_grad()
def engine_logits(engine, input_ids: torch.Tensor) -> Optional[torch.Tensor]:
    """Full-vocabulary logits [batch, seq, vocab] float32 for `input_ids` [batch, seq] (same on every rank).

    Returned on every rank of the last pipeline stage (gathered over the TP group); None on other stages.
    """

    def stash(logits, batch):
        zero = logits.sum() * 0
        return zero, torch.tensor(1, dtype=torch.int), {"logits": logits.detach().float().clone()}

    # eval mode: megatron-core's MoE layer refuses a training-mode forward at tp > 1 without sequence parallelism
    # (`megarl.models.gpt.build_transformer_config`); dropout is off either way, so the logits are the same
    modules = [m for m in engine.module.modules() if m.training]
    for m in modules:
        m.training = False
    try:
        out = engine.run([{"input_ids": input_ids}], stash, forward_only=True)
    finally:
        for m in modules:
            m.training = True
    if not engine.groups.is_last_stage:
        return None
    shard = out[0]["logits"]
    tp = engine.groups.topology.tp
    if tp == 1:
        return shard
    width = engine.padded_vocab_size // tp
    padded = torch.zeros(*shard.shape[:-1], width, dtype=shard.dtype, device=shard.device)  # NCCL: no CPU tensors
    padded[..., : shard.shape[-1]] = shard
    parts = [torch.empty_like(padded) for _ in range(tp)]
    dist.all_gather(parts, padded, group=engine.groups.pgs.tp)
    return torch.cat(parts, dim=-1)[..., : engine.spec.vocab_size]


def build_engine_from_hf(hf_dir: str, groups, dtype: str = "fp32", optimizer=None, seed: int = 1234, **engine_kwargs):
    """Startup path for a config whose model points at an HF directory: build the `MegatronEngine` at `groups`'
    TP/PP layout and load the HF weights into it directly (no offline conversion). Call on every rank of the role."""
    reader = HFReader(hf_dir)
    validate_tp(reader.spec, groups.topology.tp, groups.topology.expert_tp)
    engine = MegatronEngine(reader.spec, groups, dtype=dtype, optimizer=optimizer, seed=seed, **engine_kwargs)
    load_hf_into_engine(engine, hf_dir, reader=reader)
    return engine
