"""HF <-> Megatron parameter names and layouts: the one place that knows how each tensor maps. Pure.

Every Megatron parameter of a supported model is described by a `ParamLayout`: which HF tensor(s) it comes
from, its tensor-parallel partition dim, and, for any TP rank, the ordered list of `Segment`s (contiguous runs
of one HF tensor along that dim) whose concatenation is the rank's shard. Loading, export, offline conversion
and the reshard engine all build shards from these segments, so the layout rules live only here:

  - `linear_qkv` [q_g; k_g; v_g] per query group g (q_g = heads_per_group * head_dim rows), groups split over TP;
    the same for its bias.
  - `linear_fc1` = [gate_shard; up_shard] on every TP rank (at TP=1: [gate; up]).
  - `linear_proj`, `linear_fc2` row-parallel: split along dim 1 (HF columns).
  - word embedding / output layer split along rows, padded with zero rows to `padded_vocab_size(vocab, tp)`.
  - RMSNorm weights (input, pre-MLP, final, q/k layernorm) replicated.
  - tied embeddings: no `output_layer.weight` in the layout list; a last pipeline stage that holds one reads
    the word embedding's segments (`module_param_layout` resolves it).
  - mixture-of-experts layers (`ModelSpec.is_moe_layer`): the router `mlp.router.weight` [experts, hidden] is
    replicated; routed expert e has its own `linear_fc1` ([gate; up] per TP shard) and row-parallel `linear_fc2`,
    named with the *global* expert index (`mlp.experts.local_experts.{e}.…`, `ParamLayout.expert = e`; an
    expert-parallel rank holds a contiguous range of experts and numbers them locally from 0); a shared expert
    (Qwen2-MoE) is `mlp.shared_experts.linear_fc1/linear_fc2` with its sigmoid gate `mlp.shared_experts.gate_weight`
    [1, hidden] replicated.

Megatron names are the local-spec names with *global* layer numbers (`decoder.layers.{i}.…`). Transformer
Engine fuses the norms into the next linear (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`);
`canonical_name` folds those aliases and a pipeline stage's local layer numbers into this one naming.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Mapping, Optional

import torch

from megarl.models.gpt import padded_vocab_size
from megarl.models.spec import SUPPORTED_ARCHITECTURES, ModelSpec

# One family today: Llama, Qwen2, Qwen3 and Mistral share HF names; their quirks (qkv bias, q/k norm, tied
# embeddings, explicit head_dim) are flags on `ModelSpec`. A new family adds its own table here.
LLAMA_FAMILY = {
    "embedding": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "input_norm": "model.layers.{i}.input_layernorm.weight",
    "q": "model.layers.{i}.self_attn.q_proj.{p}",
    "k": "model.layers.{i}.self_attn.k_proj.{p}",
    "v": "model.layers.{i}.self_attn.v_proj.{p}",
    "o": "model.layers.{i}.self_attn.o_proj.weight",
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight",
    "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
    "post_attn_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "gate": "model.layers.{i}.mlp.gate_proj.weight",
    "up": "model.layers.{i}.mlp.up_proj.weight",
    "down": "model.layers.{i}.mlp.down_proj.weight",
}
# Mixture-of-experts names ({e}: global expert index), per family; attention and norms as in LLAMA_FAMILY.
QWEN_MOE_FAMILY = {
    **LLAMA_FAMILY,
    "router": "model.layers.{i}.mlp.gate.weight",
    "expert_gate": "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
    "expert_up": "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
    "expert_down": "model.layers.{i}.mlp.experts.{e}.down_proj.weight",
    "shared_gate": "model.layers.{i}.mlp.shared_expert.gate_proj.weight",
    "shared_up": "model.layers.{i}.mlp.shared_expert.up_proj.weight",
    "shared_down": "model.layers.{i}.mlp.shared_expert.down_proj.weight",
    "shared_expert_gate": "model.layers.{i}.mlp.shared_expert_gate.weight",
}
MIXTRAL_FAMILY = {
    **LLAMA_FAMILY,
    "router": "model.layers.{i}.block_sparse_moe.gate.weight",
    "expert_gate": "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
    "expert_up": "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight",
    "expert_down": "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight",
}
FAMILIES = {arch: LLAMA_FAMILY for arch in SUPPORTED_ARCHITECTURES}
FAMILIES.update({
    "MixtralForCausalLM": MIXTRAL_FAMILY,
    "Qwen2MoeForCausalLM": QWEN_MOE_FAMILY,
    "Qwen3MoeForCausalLM": QWEN_MOE_FAMILY,
})

# Transformer Engine spec name -> local spec name (suffix within a layer).
TE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
# Local spec name -> the name megatron-core uses inside distributed checkpoints (the TE name, spec-independent).
DIST_CKPT_NAMES = {v: k for k, v in TE_ALIASES.items()}

KINDS = ("vocab", "qkv", "fc1", "column", "row", "replicated")
# a layer parameter's local-spec name: group 1 the layer number, group 2 the name inside the layer
LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


class LayoutError(ValueError):
    """A layout the model cannot be split into (the message names the numbers)."""


@dataclasses.dataclass(frozen=True)
class Segment:
    """A contiguous run [start, stop) of HF tensor `hf_name` along the layout's partition dim.

    `hf_name=None` is zero padding of `stop - start` rows (vocab padding).
    """

    hf_name: Optional[str]
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    """How one Megatron parameter relates to HF tensors.

    Attributes:
        megatron_name: local-spec name with the global layer number.
        hf_names: the HF tensors it is built from, in concatenation order (q, k, v / gate, up / one name).
        kind: one of KINDS; decides how TP shards are cut (see module docstring).
        partition_dim: TP split dim of the Megatron tensor (and of each HF tensor), None when replicated.
        layer: global layer number, None for embedding / final norm / output layer.
        expert: global index of the routed expert this parameter belongs to (held by one expert-parallel rank),
            None for every other parameter (router and shared expert included).
    """

    megatron_name: str
    hf_names: tuple[str, ...]
    kind: str
    partition_dim: Optional[int]
    layer: Optional[int] = None
    expert: Optional[int] = None

    @property
    def dist_ckpt_key(self) -> str:
        """Key of this tensor in a megatron-core distributed checkpoint (layers stacked along a leading axis)."""
        m = LAYER_RE.match(self.megatron_name)
        if not m:
            return self.megatron_name
        suffix = m.group(2)
        return "decoder.layers." + DIST_CKPT_NAMES.get(suffix, suffix)


def family(spec: ModelSpec) -> dict[str, str]:
    return FAMILIES[spec.architecture]


def validate_tp(spec: ModelSpec, tp: int, etp: Optional[int] = None) -> None:
    """Raise `LayoutError` naming the numbers when `tp` (attention, dense MLP, shared expert) or `etp` (routed
    experts' expert tensor parallelism; None = tp) cannot split the model."""
    etp = tp if etp is None else etp
    for what, n, size, name in (
        ("num_attention_heads", spec.num_attention_heads, tp, "tp"),
        ("num_query_groups (num_key_value_heads)", spec.num_query_groups, tp, "tp"),
        ("ffn_hidden_size (intermediate_size)", spec.ffn_hidden_size, tp, "tp"),
        ("moe_ffn_hidden_size (moe_intermediate_size)", spec.moe_ffn_hidden_size if spec.is_moe else 0, etp,
         "tp" if etp == tp else "etp"),
        ("shared_expert_ffn_hidden_size", spec.shared_expert_ffn_hidden_size, tp, "tp"),
    ):
        if n % size != 0:
            raise LayoutError(f"{name}={size} does not divide {what}={n}")


def param_layouts(spec: ModelSpec) -> list[ParamLayout]:
    """Every Megatron parameter of the full model (all stages), in HF file order."""
    f = family(spec)
    out = [ParamLayout("embedding.word_embeddings.weight", (f["embedding"],), "vocab", 0)]
    for i in range(spec.num_layers):
        p = f"decoder.layers.{i}."

        def hf(key: str, part: str = "weight") -> str:
            return f[key].format(i=i, p=part)  # noqa: B023 (only called within this iteration)

        out.append(ParamLayout(p + "input_layernorm.weight", (hf("input_norm"),), "replicated", None, i))
        out.append(ParamLayout(p + "self_attention.linear_qkv.weight", (hf("q"), hf("k"), hf("v")), "qkv", 0, i))
        if spec.qkv_bias:
            out.append(ParamLayout(
                p + "self_attention.linear_qkv.bias", (hf("q", "bias"), hf("k", "bias"), hf("v", "bias")), "qkv", 0, i
            ))
        if spec.qk_layernorm:
            out.append(ParamLayout(p + "self_attention.q_layernorm.weight", (hf("q_norm"),), "replicated", None, i))
            out.append(ParamLayout(p + "self_attention.k_layernorm.weight", (hf("k_norm"),), "replicated", None, i))
        out.append(ParamLayout(p + "self_attention.linear_proj.weight", (hf("o"),), "row", 1, i))
        out.append(ParamLayout(p + "pre_mlp_layernorm.weight", (hf("post_attn_norm"),), "replicated", None, i))
        if spec.is_moe_layer(i):
            out.extend(_moe_layouts(spec, f, i))
        else:
            out.append(ParamLayout(p + "mlp.linear_fc1.weight", (hf("gate"), hf("up")), "fc1", 0, i))
            out.append(ParamLayout(p + "mlp.linear_fc2.weight", (hf("down"),), "row", 1, i))
    out.append(ParamLayout("decoder.final_layernorm.weight", (f["final_norm"],), "replicated", None))
    if not spec.tie_word_embeddings:
        out.append(ParamLayout("output_layer.weight", (f["lm_head"],), "vocab", 0))
    return out


def _moe_layouts(spec: ModelSpec, f: Mapping[str, str], i: int) -> list[ParamLayout]:
    """Router, routed experts (global index order) and shared expert of MoE layer `i`."""
    p = f"decoder.layers.{i}.mlp."
    out = [ParamLayout(p + "router.weight", (f["router"].format(i=i),), "replicated", None, i)]
    for e in range(spec.num_experts):
        names = {k: f[k].format(i=i, e=e) for k in ("expert_gate", "expert_up", "expert_down")}
        q = f"{p}experts.local_experts.{e}."
        out.append(ParamLayout(q + "linear_fc1.weight", (names["expert_gate"], names["expert_up"]), "fc1", 0, i, e))
        out.append(ParamLayout(q + "linear_fc2.weight", (names["expert_down"],), "row", 1, i, e))
    if spec.shared_expert_ffn_hidden_size:
        g = {k: f[k].format(i=i) for k in ("shared_gate", "shared_up", "shared_down", "shared_expert_gate")}
        out.append(ParamLayout(p + "shared_experts.linear_fc1.weight", (g["shared_gate"], g["shared_up"]), "fc1", 0, i))
        out.append(ParamLayout(p + "shared_experts.linear_fc2.weight", (g["shared_down"],), "row", 1, i))
        out.append(ParamLayout(p + "shared_experts.gate_weight", (g["shared_expert_gate"],), "replicated", None, i))
    return out


def hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Shape of every HF tensor the model needs (what `config.json` implies)."""
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_attention_heads * d, spec.num_query_groups * d
    f = family(spec)
    shapes: dict[str, tuple[int, ...]] = {f["embedding"]: (spec.vocab_size, h), f["final_norm"]: (h,)}
    if not spec.tie_word_embeddings:
        shapes[f["lm_head"]] = (spec.vocab_size, h)
    for i in range(spec.num_layers):
        g = {k: v.format(i=i, p="weight") for k, v in f.items() if "{e}" not in v}
        shapes.update({
            g["input_norm"]: (h,), g["post_attn_norm"]: (h,),
            g["q"]: (q, h), g["k"]: (kv, h), g["v"]: (kv, h), g["o"]: (h, q),
        })
        if spec.is_moe_layer(i):
            shapes[f["router"].format(i=i)] = (spec.num_experts, h)
            m = spec.moe_ffn_hidden_size
            for e in range(spec.num_experts):
                shapes[f["expert_gate"].format(i=i, e=e)] = (m, h)
                shapes[f["expert_up"].format(i=i, e=e)] = (m, h)
                shapes[f["expert_down"].format(i=i, e=e)] = (h, m)
            s = spec.shared_expert_ffn_hidden_size
            if s:
                shapes.update({
                    f["shared_gate"].format(i=i): (s, h), f["shared_up"].format(i=i): (s, h),
                    f["shared_down"].format(i=i): (h, s), f["shared_expert_gate"].format(i=i): (1, h),
                })
        else:
            shapes.update({
                g["gate"]: (spec.ffn_hidden_size, h), g["up"]: (spec.ffn_hidden_size, h),
                g["down"]: (h, spec.ffn_hidden_size),
            })
        if spec.qkv_bias:
            for k in ("q", "k", "v"):
                shapes[f[k].format(i=i, p="bias")] = (q if k == "q" else kv,)
        if spec.qk_layernorm:
            shapes[g["q_norm"]] = (d,)
            shapes[g["k_norm"]] = (d,)
    return shapes


_TE_EXPERT_RE = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")  # TE grouped GEMM: weight{j}
_LOCAL_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")


def canonical_name(module_name: str, layer_offset: int = 0, expert_offset: int = 0) -> str:
    """A stage module's parameter name -> the global local-spec name.

    `layer_offset`: global number of the stage's first layer. `expert_offset`: global index of this
    expert-parallel rank's first expert (ep_rank * num_experts / ep); local expert j becomes expert_offset + j.
    Transformer Engine's grouped-GEMM experts (`mlp.experts.linear_fc1.weight{j}`) fold into the same
    `mlp.experts.local_experts.{e}.linear_fc1.weight` names.
    """
    m = LAYER_RE.match(module_name)
    if not m:
        return module_name
    suffix = TE_ALIASES.get(m.group(2), m.group(2))
    te = _TE_EXPERT_RE.match(suffix)
    if te:
        suffix = f"mlp.experts.local_experts.{int(te.group(2))}.{te.group(1)}.weight"
    local = _LOCAL_EXPERT_RE.match(suffix)
    if local:
        suffix = f"mlp.experts.local_experts.{int(local.group(1)) + expert_offset}.{local.group(2)}"
    return f"decoder.layers.{int(m.group(1)) + layer_offset}.{suffix}"


def module_param_layout(spec: ModelSpec, megatron_name: str) -> ParamLayout:
    """Layout of a (canonical) Megatron parameter name; a tied `output_layer.weight` maps to the embedding."""
    if megatron_name == "output_layer.weight" and spec.tie_word_embeddings:
        emb = _layout_index(spec)["embedding.word_embeddings.weight"]
        return dataclasses.replace(emb, megatron_name="output_layer.weight")
    try:
        return _layout_index(spec)[megatron_name]
    except KeyError:
        raise LayoutError(f"no HF mapping for Megatron parameter {megatron_name!r} of {spec.architecture}") from None


# Keyed by repr(spec) (specs are hashable too: `RopeScaling`; repr is what the planner cache keys on as well).
_INDEX_CACHE: dict[str, dict[str, ParamLayout]] = {}
_SHAPES_CACHE: dict[str, dict[str, tuple[int, ...]]] = {}


def cached_hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """`hf_shapes(spec)`, computed once per spec (do not mutate the result)."""
    key = repr(spec)
    if key not in _SHAPES_CACHE:
        _SHAPES_CACHE[key] = hf_shapes(spec)
    return _SHAPES_CACHE[key]


def _layout_index(spec: ModelSpec) -> dict[str, ParamLayout]:
    key = repr(spec)
    if key not in _INDEX_CACHE:
        _INDEX_CACHE[key] = {lay.megatron_name: lay for lay in param_layouts(spec)}
    return _INDEX_CACHE[key]


def shard_segments(
    spec: ModelSpec, layout: ParamLayout, tp_rank: int, tp: int, pad_vocab: bool = True
) -> list[Segment]:
    """The HF runs, in order along `layout.partition_dim`, whose concatenation is TP rank `tp_rank`'s shard.

    Routed experts (`layout.expert` set) are split by expert tensor parallelism: pass the expert-TP rank and size
    (`RoleTopology.expert_coord(rank).etp`, `RoleTopology.expert_tp`) for them, the dense TP rank for the rest.
    Replicated parameters give one segment covering the whole HF tensor (dim 0). With `pad_vocab=False` vocab
    shards hold only real rows (the distributed-checkpoint form; at tp=1 that is the HF tensor itself).
    """
    if layout.expert is None:
        validate_tp(spec, tp, etp=1)  # only the split this layout uses
    else:
        validate_tp(spec, 1, etp=tp)
    if not 0 <= tp_rank < tp:
        raise LayoutError(f"tp_rank={tp_rank} is outside 0..{tp - 1}")
    names = layout.hf_names
    if layout.kind == "replicated":
        return [Segment(names[0], 0, cached_hf_shapes(spec)[names[0]][0])]
    if layout.kind == "vocab":
        rows = padded_vocab_size(spec.vocab_size, tp) // tp
        start = tp_rank * rows
        stop = min(start + rows, spec.vocab_size)
        segs = [Segment(names[0], start, stop)] if stop > start else []
        real = max(0, stop - start)
        if pad_vocab and real < rows:
            segs.append(Segment(None, 0, rows - real))
        return segs
    if layout.kind == "qkv":
        d = spec.head_dim
        per_group = spec.num_attention_heads // spec.num_query_groups
        groups = spec.num_query_groups // tp
        segs = []
        for g in range(tp_rank * groups, (tp_rank + 1) * groups):
            segs.append(Segment(names[0], g * per_group * d, (g + 1) * per_group * d))
            segs.append(Segment(names[1], g * d, (g + 1) * d))
            segs.append(Segment(names[2], g * d, (g + 1) * d))
        return segs
    if layout.kind == "fc1":
        rows = cached_hf_shapes(spec)[names[0]][0] // tp
        return [Segment(n, tp_rank * rows, (tp_rank + 1) * rows) for n in names]
    if layout.kind == "row":
        cols = cached_hf_shapes(spec)[names[0]][1] // tp
        return [Segment(names[0], tp_rank * cols, (tp_rank + 1) * cols)]
    raise LayoutError(f"unknown layout kind {layout.kind!r}")  # pragma: no cover - KINDS is closed


def hf_indices(spec: ModelSpec, layout: ParamLayout, tp_rank: int, tp: int) -> list[tuple[Optional[str], torch.Tensor]]:
    """For the reshard engine: per segment, (HF name or None for padding, int64 indices along the partition dim)."""
    return [(s.hf_name, torch.arange(s.start, s.stop)) for s in shard_segments(spec, layout, tp_rank, tp)]


# Reads HF tensor `name`, rows/columns [start, stop) along `dim` (dim None: the whole tensor).
SliceReader = Callable[[str, Optional[int], int, int], torch.Tensor]


def build_shard(spec: ModelSpec, layout: ParamLayout, tp_rank: int, tp: int, read: SliceReader,
                pad_vocab: bool = True) -> torch.Tensor:
    """This TP rank's Megatron shard of `layout`, reading only the HF slices it needs through `read`."""
    dim = layout.partition_dim
    parts = []
    dtype = None
    for seg in shard_segments(spec, layout, tp_rank, tp, pad_vocab):
        if seg.hf_name is None:
            parts.append(None)
            continue
        t = read(seg.hf_name, dim, seg.start, seg.stop)
        dtype = t.dtype
        parts.append(t)
    if any(p is None for p in parts):  # vocab padding: zero rows of the same width
        segs = shard_segments(spec, layout, tp_rank, tp, pad_vocab)
        dtype = dtype or torch.float32
        parts = [
            p if p is not None else torch.zeros((s.size, spec.hidden_size), dtype=dtype)
            for p, s in zip(parts, segs)
        ]
    return torch.cat(parts, dim=dim or 0) if len(parts) > 1 else parts[0]


def scatter_shard(spec: ModelSpec, layout: ParamLayout, tp_rank: int, tp: int, shard: torch.Tensor,
                  out: Mapping[str, torch.Tensor], pad_vocab: bool = True) -> None:
    """Inverse of `build_shard`: copy `shard`'s pieces into the full HF tensors in `out` (padding dropped)."""
    dim = layout.partition_dim or 0
    offset = 0
    for seg in shard_segments(spec, layout, tp_rank, tp, pad_vocab):
        piece = shard.narrow(dim, offset, seg.size)
        offset += seg.size
        if seg.hf_name is None:
            continue
        dst = out[seg.hf_name]
        if layout.partition_dim is None:
            dst.copy_(piece)
        else:
            dst.narrow(dim, seg.start, seg.size).copy_(piece)


def hf_to_megatron_full(spec: ModelSpec, layout: ParamLayout, hf: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The unsharded Megatron tensor (TP=1 layout, real vocab rows: the distributed-checkpoint global tensor)."""

    def read(name, dim, start, stop):
        t = hf[name]
        return t if dim is None else t.narrow(dim, start, stop - start)

    return build_shard(spec, layout, 0, 1, read, pad_vocab=False)


def megatron_full_to_hf(spec: ModelSpec, layout: ParamLayout, full: torch.Tensor) -> dict[str, torch.Tensor]:
    """Inverse of `hf_to_megatron_full`: the HF tensors (new memory) that `full` is made of."""
    shapes = cached_hf_shapes(spec)
    out = {n: torch.empty(shapes[n], dtype=full.dtype) for n in layout.hf_names}
    scatter_shard(spec, layout, 0, 1, full, out, pad_vocab=False)
    return out
