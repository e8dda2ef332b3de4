"""Which slices of the HF-layout weights each rank holds (Megatron training side) or needs (vLLM inference side).

Both sides are described in one coordinate system: HF tensor names (`model.layers.3.self_attn.q_proj.weight`, ...)
and contiguous runs along the tensor's split dim. A `Piece` is such a run; a rank's local tensor for one parameter is
the concatenation, along that dim, of its pieces (the other dims are whole). Intersecting pieces is all the planner
needs, and the same HF names are what vLLM's weight loaders consume.

Megatron side (from `megarl.checkpoint.name_map.shard_segments`, the single source of layout rules):
  `linear_qkv` = [q_g; k_g; v_g] per query group, groups split over TP; `linear_fc1` = [gate_shard; up_shard];
  `linear_proj` / `linear_fc2` split along HF columns; embedding / output layer split along rows with Megatron's
  vocab padding (multiple of 128*tp; padding rows are not pieces); norms replicated. A rank holds only the layers
  of its pipeline stage; the embedding on the first stage, the output layer (or, when tied, a copy of the embedding)
  on the last.
vLLM side (vLLM's own TP layout, independent of the training TP):
  `qkv_proj` = [q_shard; k_shard; v_shard] (kv heads replicated when tp > kv heads); `gate_up_proj` =
  [gate_shard; up_shard]; `o_proj` / `down_proj` split along HF columns; `embed_tokens` / `lm_head` split along rows
  after padding the vocabulary to a multiple of 64; norms replicated.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megarl.checkpoint.name_map import cached_hf_shapes, param_layouts, shard_segments
from megarl.models.spec import ModelSpec
from megarl.parallel.topology import RoleTopology, layer_split

VLLM_VOCAB_PADDING = 64  # vllm/model_executor/layers/vocab_parallel_embedding.py DEFAULT_VOCAB_PADDING_SIZE


@dataclasses.dataclass(frozen=True, order=True)
class Piece:
    """Run [start, stop) of HF tensor `hf_name` along `dim` (0 for rows, 1 for columns; whole-tensor pieces of
    replicated 1-D weights use dim 0)."""

    hf_name: str
    dim: int
    start: int
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start

    def intersect(self, other: "Piece") -> Optional["Piece"]:
        if other.hf_name != self.hf_name or other.dim != self.dim:
            return None
        lo, hi = max(self.start, other.start), min(self.stop, other.stop)
        return Piece(self.hf_name, self.dim, lo, hi) if hi > lo else None


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a piece lives inside a rank's local parameter tensor.

    Attributes:
        param: the local parameter's name (Megatron canonical name, or vLLM parameter name).
        offset: index along `piece.dim` inside the local tensor where the piece starts.
        piece: the HF-layout run.
    """

    param: str
    offset: int
    piece: Piece


def _element_bytes_per_index(shapes: dict[str, tuple[int, ...]], piece: Piece, dtype_bytes: int) -> int:
    shape = shapes[piece.hf_name]
    other = 1
    for d, n in enumerate(shape):
        if d != piece.dim:
            other *= n
    return other * dtype_bytes


def piece_bytes(spec: ModelSpec, piece: Piece, dtype_bytes: int) -> int:
    """Bytes of `piece` at `dtype_bytes` per element."""
    return piece.length * _element_bytes_per_index(cached_hf_shapes(spec), piece, dtype_bytes)


# ------------------------------------------------------------------------------------------------- Megatron side
def stage_layers(spec: ModelSpec, topo: RoleTopology, pp_rank: int) -> range:
    """Global layer numbers on pipeline stage `pp_rank` (even split; uneven splits pass through `layer_split`)."""
    split = layer_split(spec.num_layers, topo.pp)
    start = sum(split[:pp_rank])
    return range(start, start + split[pp_rank])


def megatron_holdings(spec: ModelSpec, topo: RoleTopology, rank: int) -> list[Placement]:
    """Every HF piece training rank `rank` holds, with its place in the rank's Megatron parameter."""
    coord = topo.coord(rank)
    layers = stage_layers(spec, topo, coord.pp)
    first, last = coord.pp == 0, coord.pp == topo.pp - 1
    out: list[Placement] = []
    for layout in param_layouts(spec):
        name = layout.megatron_name
        if layout.layer is not None:
            held = layout.layer in layers
        elif name.startswith("embedding."):
            held = first
        else:  # final norm, output layer
            held = last
        if held:
            out.extend(_placements(spec, layout, coord.tp, topo.tp, name))
    if spec.tie_word_embeddings and last and not first:
        # megatron keeps a copy of the tied embedding as `output_layer.weight` on the last stage
        emb = next(lay for lay in param_layouts(spec) if lay.megatron_name == "embedding.word_embeddings.weight")
        out.extend(_placements(spec, emb, coord.tp, topo.tp, "output_layer.weight"))
    return out


def _placements(spec: ModelSpec, layout, tp_rank: int, tp: int, param: str) -> list[Placement]:
    dim = layout.partition_dim if layout.partition_dim is not None else 0
    out, offset = [], 0
    for seg in shard_segments(spec, layout, tp_rank, tp):
        if seg.hf_name is not None:
            out.append(Placement(param, offset, Piece(seg.hf_name, dim, seg.start, seg.stop)))
        offset += seg.size
    return out


# ------------------------------------------------------------------------------------------------- vLLM side
def vllm_padded_vocab(vocab_size: int) -> int:
    return -(-vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING


def vllm_needs(spec: ModelSpec, infer_tp: int, tp_rank: int) -> list[Placement]:
    """Every HF piece vLLM inference TP rank `tp_rank` needs, with its place in the vLLM parameter."""
    if spec.architecture == "Qwen2ForCausalLM" and spec.head_dim * spec.num_attention_heads != spec.hidden_size:
        # vllm 0.32.0 model_executor/models/qwen2.py: head_dim = hidden_size // num_heads (config.head_dim ignored),
        # while transformers honours config.json's head_dim: the engine would build other shapes.
        raise ValueError(
            f"Qwen2ForCausalLM with head_dim={spec.head_dim} != hidden_size/num_attention_heads="
            f"{spec.hidden_size}/{spec.num_attention_heads}: vLLM's Qwen2 derives head_dim from hidden_size and "
            "would not match the checkpoint; use Qwen3ForCausalLM (explicit head_dim) or a consistent config"
        )
    if spec.num_attention_heads % infer_tp:
        raise ValueError(
            f"rollout tp={infer_tp} does not divide num_attention_heads={spec.num_attention_heads}"
        )
    G = spec.num_query_groups
    if infer_tp >= G:
        if infer_tp % G:
            raise ValueError(f"rollout tp={infer_tp} is not a multiple of num_key_value_heads={G}")
        kv_heads, kv_shard = 1, tp_rank // (infer_tp // G)
    else:
        if G % infer_tp:
            raise ValueError(f"rollout tp={infer_tp} does not divide num_key_value_heads={G}")
        kv_heads, kv_shard = G // infer_tp, tp_rank
    d = spec.head_dim
    q_rows = spec.num_attention_heads // infer_tp * d
    kv_rows = kv_heads * d
    f_rows = spec.ffn_hidden_size // infer_tp
    h_cols = spec.num_attention_heads * d // infer_tp
    out: list[Placement] = []

    def vocab(hf_name: str, param: str) -> None:
        per_rank = vllm_padded_vocab(spec.vocab_size) // infer_tp
        start = tp_rank * per_rank
        stop = min(start + per_rank, spec.vocab_size)
        if stop > start:
            out.append(Placement(param, 0, Piece(hf_name, 0, start, stop)))

    def whole(hf_name: str, param: str) -> None:
        out.append(Placement(param, 0, Piece(hf_name, 0, 0, cached_hf_shapes(spec)[hf_name][0])))

    vocab("model.embed_tokens.weight", "model.embed_tokens.weight")
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        whole(p + "input_layernorm.weight", p + "input_layernorm.weight")
        whole(p + "post_attention_layernorm.weight", p + "post_attention_layernorm.weight")
        for part in ("weight", "bias") if spec.qkv_bias else ("weight",):
            qkv = p + f"self_attn.qkv_proj.{part}"
            q_piece = Piece(p + f"self_attn.q_proj.{part}", 0, tp_rank * q_rows, (tp_rank + 1) * q_rows)
            k_piece = Piece(p + f"self_attn.k_proj.{part}", 0, kv_shard * kv_rows, (kv_shard + 1) * kv_rows)
            v_piece = Piece(p + f"self_attn.v_proj.{part}", 0, kv_shard * kv_rows, (kv_shard + 1) * kv_rows)
            out.append(Placement(qkv, 0, q_piece))
            out.append(Placement(qkv, q_rows, k_piece))
            out.append(Placement(qkv, q_rows + kv_rows, v_piece))
        if spec.qk_layernorm:
            whole(p + "self_attn.q_norm.weight", p + "self_attn.q_norm.weight")
            whole(p + "self_attn.k_norm.weight", p + "self_attn.k_norm.weight")
        o_proj = p + "self_attn.o_proj.weight"
        out.append(Placement(o_proj, 0, Piece(o_proj, 1, tp_rank * h_cols, (tp_rank + 1) * h_cols)))
        gate_up = p + "mlp.gate_up_proj.weight"
        f_lo, f_hi = tp_rank * f_rows, (tp_rank + 1) * f_rows
        out.append(Placement(gate_up, 0, Piece(p + "mlp.gate_proj.weight", 0, f_lo, f_hi)))
        out.append(Placement(gate_up, f_rows, Piece(p + "mlp.up_proj.weight", 0, f_lo, f_hi)))
        down = p + "mlp.down_proj.weight"
        out.append(Placement(down, 0, Piece(down, 1, f_lo, f_hi)))
    whole("model.norm.weight", "model.norm.weight")
    if not spec.tie_word_embeddings:
        vocab("lm_head.weight", "lm_head.weight")
    return out


def vllm_param_shapes(spec: ModelSpec, infer_tp: int, tp_rank: int) -> dict[str, tuple[int, ...]]:
    """Shape of every vLLM parameter shard on inference TP rank `tp_rank` (before any CPU repacking).

    Vocab-parallel parameters include vLLM's padding rows (left zero by the reshard); everything else is exactly
    covered by the rank's pieces.
    """
    shapes = cached_hf_shapes(spec)
    per_rank_vocab = vllm_padded_vocab(spec.vocab_size) // infer_tp
    extent: dict[str, int] = {}
    dims: dict[str, tuple[int, str]] = {}
    for p in vllm_needs(spec, infer_tp, tp_rank):
        extent[p.param] = max(extent.get(p.param, 0), p.offset + p.piece.length)
        dims[p.param] = (p.piece.dim, p.piece.hf_name)
    out = {}
    for param, size in extent.items():
        dim, hf_name = dims[param]
        shape = list(shapes[hf_name])
        if param in ("model.embed_tokens.weight", "lm_head.weight"):
            size = per_rank_vocab
        shape[dim] = size
        out[param] = tuple(shape)
    if "model.embed_tokens.weight" not in out:  # the last rank's shard may hold no real rows at all
        out["model.embed_tokens.weight"] = (per_rank_vocab, spec.hidden_size)
    if not spec.tie_word_embeddings and "lm_head.weight" not in out:
        out["lm_head.weight"] = (per_rank_vocab, spec.hidden_size)
    return out
