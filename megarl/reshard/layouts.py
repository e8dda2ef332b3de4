"""Which slices of the HF-layout weights each rank holds (Megatron training side) or needs (vLLM inference side).

Both sides are described in one coordinate system: HF tensor names (`model.layers.3.self_attn.q_proj.weight`, ...)
and contiguous runs along the tensor's split dim. A `Piece` is such a run; a rank's local tensor for one parameter is
the concatenation, along that dim, of its pieces (the other dims are whole). Intersecting pieces is all the planner
needs, and the same HF names are what vLLM's weight loaders consume.

Megatron side (from `megarl.checkpoint.name_map.shard_segments`, the single source of layout rules):
  `linear_qkv` = [q_g; k_g; v_g] per query group, groups split over TP; `linear_fc1` = [gate_shard; up_shard];
  `linear_proj` / `linear_fc2` split along HF columns; embedding / output layer split along rows with Megatron's
  vocab padding (multiple of 128*tp; padding rows are not pieces); norms replicated. A rank holds only the layers
  of its pipeline stage (uneven first/last stages and interleaved virtual-pipeline chunks: `TrainLayout`); the
  embedding on the first stage, the output layer (or, when tied, a copy of the embedding) on the last.
  MoE layers: the router and the shared expert follow the dense TP rank; a routed expert lives only on the ranks of
  its expert-parallel rank, sliced by expert TP (`expert_coords`, `TrainLayout.etp`).
vLLM side (vLLM's own TP layout, independent of the training TP):
  `qkv_proj` = [q_shard; k_shard; v_shard] (kv heads replicated when tp > kv heads); `gate_up_proj` =
  [gate_shard; up_shard]; `o_proj` / `down_proj` split along HF columns; `embed_tokens` / `lm_head` split along rows
  after padding the vocabulary to a multiple of 64; norms replicated. Fused MoE (vLLM 0.32 RoutedExperts): the
  router `gate` replicated; routed expert e in slot e_local of the stacked `w13_weight` ([gate; up] rows of the
  rank's 1/tp slice) and `w2_weight` (down's columns), one planner parameter per slot (`expert_slot_name`); under
  vLLM expert parallelism (`infer_ep`) whole experts, placed linearly (`vllm_local_experts`); Qwen2-MoE's shared
  expert like a dense MLP plus its replicated sigmoid gate.
"""

from __future__ import annotations

import dataclasses
import functools
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
@dataclasses.dataclass(frozen=True)
class TrainLayout:
    """Where a training rank's layers and experts are, beyond `RoleTopology`'s tp/cp/dp/pp/ep.

    first_stage_layers / last_stage_layers: megatron-core's uneven pipeline split (`actor.parallel.*`; None: even).
    vpp: virtual pipeline chunks per stage (megatron-core `virtual_pipeline_model_parallel_size`; megarl's config
        has no field for it yet, so callers pass it here). The layers are split evenly into pp*vpp chunks; chunk c
        holds layers [c*n, (c+1)*n) with n = num_layers / (pp*vpp), and pipeline rank r holds chunks r, r+pp, ...,
        r+(vpp-1)*pp (megatron-core's interleaved schedule). Not combined with an uneven split.
    etp: expert tensor-parallel size overriding the topology's (None: `RoleTopology.expert_tp`, which the config's
        `parallel.etp` sets). Megatron-core's expert grid per pipeline stage is etp-ep-edp (fastest first) over the
        stage's tp*cp*dp ranks, so etp*ep must divide tp*cp*dp.
    ep: expert-parallel size overriding the topology's (None: `RoleTopology.ep`). `RoleTopology` itself accepts
        EP spanning TP ranks when its etp < tp (e.g. tp4 x dp4 with etp1 x ep16); these two overrides let a planner
        caller describe a layout without building that topology.
    """

    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None
    vpp: int = 1
    etp: Optional[int] = None
    ep: Optional[int] = None

    def __post_init__(self) -> None:
        if self.vpp < 1:
            raise ValueError(f"vpp must be >= 1, got {self.vpp}")
        if self.vpp > 1 and (self.first_stage_layers is not None or self.last_stage_layers is not None):
            raise ValueError("vpp > 1 with first_stage_layers / last_stage_layers is not supported by the reshard "
                             "holdings: use an even split with virtual pipeline chunks, or vpp=1")
        for name in ("etp", "ep"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def from_parallel(cls, parallel) -> "TrainLayout":
        """From a role's `parallel` config section: first/last_stage_layers, and `vpp` / `etp` where the config
        has such fields (absent today: the defaults apply)."""
        return cls(first_stage_layers=getattr(parallel, "first_stage_layers", None),
                   last_stage_layers=getattr(parallel, "last_stage_layers", None),
                   vpp=getattr(parallel, "vpp", None) or getattr(parallel, "virtual_pipeline_size", None) or 1,
                   etp=getattr(parallel, "etp", None))


DEFAULT_TRAIN_LAYOUT = TrainLayout()


def stage_layers(spec: ModelSpec, topo: RoleTopology, pp_rank: int,
                 layout: TrainLayout = DEFAULT_TRAIN_LAYOUT) -> list[int]:
    """Global layer numbers held by pipeline rank `pp_rank`, ascending (all its virtual chunks)."""
    if layout.vpp > 1:
        chunks = topo.pp * layout.vpp
        if spec.num_layers % chunks:
            raise ValueError(f"num_layers={spec.num_layers} does not split into pp*vpp={topo.pp}*{layout.vpp} "
                             "equal virtual pipeline chunks")
        n = spec.num_layers // chunks
        return [c * n + j for c in range(pp_rank, chunks, topo.pp) for j in range(n)]
    split = layer_split(spec.num_layers, topo.pp, layout.first_stage_layers, layout.last_stage_layers)
    start = sum(split[:pp_rank])
    return list(range(start, start + split[pp_rank]))


def expert_coords(spec: ModelSpec, topo: RoleTopology, rank: int, layout: TrainLayout = DEFAULT_TRAIN_LAYOUT
                  ) -> tuple[range, int, int]:
    """(global experts held, expert-TP rank, expert-TP size) of training rank `rank`.

    megatron-core (`initialize_model_parallel`, expert grid order tp-ep-dp-pp with expert tp = etp): within a
    pipeline stage, the rank's position s in 0..tp*cp*dp-1 gives etp rank s % etp and ep rank (s // etp) % ep;
    ep rank r holds experts [r*E/ep, (r+1)*E/ep) (moe_layer.py: `local_expert_indices_offset = ep_rank *
    num_local_experts`).
    """
    etp, ep = layout.etp or topo.expert_tp, layout.ep or topo.ep
    per_stage = topo.tp * topo.cp * topo.dp
    if per_stage % (etp * ep):
        raise ValueError(f"etp*ep={etp}*{ep} must divide tp*cp*dp={per_stage} (megatron-core's expert grid)")
    if spec.is_moe and spec.num_experts % ep:
        raise ValueError(f"ep={ep} must divide num_experts={spec.num_experts}")
    if (ep > 1 or etp != topo.tp) and topo.rank_order is not None:
        raise ValueError("expert holdings need the natural rank order (rank_order with ep > 1 is not supported)")
    s = (rank - topo.rank_offset) % per_stage
    ep_rank = (s // etp) % ep
    per_ep = spec.num_experts // ep if spec.is_moe else 0
    return range(ep_rank * per_ep, (ep_rank + 1) * per_ep), s % etp, etp


def megatron_holdings(spec: ModelSpec, topo: RoleTopology, rank: int,
                      layout: TrainLayout = DEFAULT_TRAIN_LAYOUT) -> list[Placement]:
    """Every HF piece training rank `rank` holds, with its place in the rank's Megatron parameter.

    Dense parameters, routers and shared experts follow the dense TP rank; a routed expert is held only by the ranks
    of its expert-parallel rank, sliced by expert TP (`expert_coords`). Placement params are canonical Megatron
    names (global layer and expert numbers)."""
    coord = topo.coord(rank)
    experts, etp_rank, etp = expert_coords(spec, topo, rank, layout)
    first, last = coord.pp == 0, coord.pp == topo.pp - 1
    by_layer = _layouts_by_layer(repr(spec), spec)
    out: list[Placement] = []
    for lay in by_layer[None]:
        if first if lay.megatron_name.startswith("embedding.") else last:  # else: final norm, output layer
            out.extend(_placements(spec, lay, coord.tp, topo.tp, lay.megatron_name))
    for layer in stage_layers(spec, topo, coord.pp, layout):
        dense, routed = by_layer[layer]
        for lay in dense:
            out.extend(_placements(spec, lay, coord.tp, topo.tp, lay.megatron_name))
        for e in experts:
            for lay in routed.get(e, ()):
                out.extend(_placements(spec, lay, etp_rank, etp, lay.megatron_name))
    if spec.tie_word_embeddings and last and not first:
        # megatron keeps a copy of the tied embedding as `output_layer.weight` on the last stage
        emb = next(lay for lay in by_layer[None] if lay.megatron_name == "embedding.word_embeddings.weight")
        out.extend(_placements(spec, emb, coord.tp, topo.tp, "output_layer.weight"))
    return out


@functools.lru_cache(maxsize=8)
def _layouts_by_layer(_key: str, spec: ModelSpec) -> dict:
    """`param_layouts(spec)` grouped: None -> non-layer layouts; layer -> (its non-expert layouts, {expert: its
    layouts}). Cached (keyed by the spec's repr): a 256-rank plan asks for every rank's holdings."""
    out: dict = {None: []}
    for lay in param_layouts(spec):
        if lay.layer is None:
            out[None].append(lay)
            continue
        dense, routed = out.setdefault(lay.layer, ([], {}))
        if lay.expert is None:
            dense.append(lay)
        else:
            routed.setdefault(lay.expert, []).append(lay)
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
@dataclasses.dataclass(frozen=True)
class InferLayout:
    """Where the inference (vLLM) ranks are, in the reshard's "bridge" rank numbering.

    The bridge numbers the ranks of a reshard: the training ranks are `RoleTopology.ranks` (0..T-1 when the actor
    starts the bridge), the inference ranks are `ranks` below: `replicas` engines of `tp` consecutive ranks from
    `rank_offset` (engine r = ranks rank_offset + r*tp ..; TP rank = position in the engine, what vLLM's external
    launcher realises). Colocated (the hybrid engine): the same ranks as training, `colocated(train, tp)`.
    Disaggregated (a rollout pool): ranks after the training ranks, e.g. `InferLayout(tp=2, replicas=2,
    rank_offset=T)`; every inference rank then holds nothing and receives its whole shard.

    Attributes:
        tp: vLLM tensor-parallel size per engine (`rollout.tp`).
        replicas: number of engines.
        ep: vLLM expert parallelism inside each engine (`rollout.ep`; `vllm_needs`' `infer_ep`).
        rank_offset: bridge rank of engine 0's TP rank 0.
    """

    tp: int
    replicas: int = 1
    ep: bool = False
    rank_offset: int = 0

    def __post_init__(self) -> None:
        for name in ("tp", "replicas"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"InferLayout.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.rank_offset, int) or self.rank_offset < 0:
            raise ValueError(f"InferLayout.rank_offset must be >= 0, got {self.rank_offset!r}")

    @classmethod
    def colocated(cls, train: RoleTopology, tp: int, ep: bool = False) -> "InferLayout":
        """Engines on the training ranks themselves (the hybrid engine): rollout tp must divide the actor's ranks."""
        if not isinstance(tp, int) or tp < 1 or train.world_size % tp:
            raise ValueError(f"rollout tp={tp} must divide the actor's {train.world_size} ranks ({train.describe()})")
        return cls(tp=tp, replicas=train.world_size // tp, ep=ep, rank_offset=train.rank_offset)

    @classmethod
    def pool(cls, pool_ranks: int, tp: int, rank_offset: int, ep: bool = False) -> "InferLayout":
        """Engines of `tp` ranks filling a rollout pool of `pool_ranks` ranks at bridge ranks rank_offset.."""
        if not isinstance(tp, int) or tp < 1 or pool_ranks % tp:
            raise ValueError(f"rollout tp={tp} must divide the rollout pool's {pool_ranks} ranks")
        return cls(tp=tp, replicas=pool_ranks // tp, ep=ep, rank_offset=rank_offset)

    @property
    def world_size(self) -> int:
        """Inference ranks in all: tp * replicas."""
        return self.tp * self.replicas

    @property
    def ranks(self) -> range:
        """Bridge ranks of the inference ranks, engine by engine."""
        return range(self.rank_offset, self.rank_offset + self.world_size)

    def tp_rank(self, rank: int) -> int:
        """vLLM TP rank of bridge rank `rank` (its position in its engine)."""
        if rank not in self.ranks:
            raise ValueError(f"rank {rank} is not an inference rank ({self.ranks.start}..{self.ranks.stop - 1})")
        return (rank - self.rank_offset) % self.tp

    def replica(self, rank: int) -> int:
        """Engine index of bridge rank `rank`."""
        self.tp_rank(rank)
        return (rank - self.rank_offset) // self.tp

    def describe(self) -> str:
        return (f"{self.replicas} engine(s) of tp{self.tp}{' (ep)' if self.ep else ''} at ranks "
                f"{self.ranks.start}..{self.ranks.stop - 1}")


def vllm_padded_vocab(vocab_size: int) -> int:
    return -(-vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING


def vllm_needs(spec: ModelSpec, infer_tp: int, tp_rank: int, infer_ep: bool = False) -> list[Placement]:
    """Every HF piece vLLM inference TP rank `tp_rank` needs, with its place in the vLLM parameter.

    infer_ep: vLLM expert parallelism (`enable_expert_parallel`, `rollout.ep`): routed experts are placed whole on
        the engine's TP ranks (`vllm_local_experts`) instead of TP-sliced on every rank; attention stays TP-sharded.
    Routed experts land in per-expert slots of vLLM's stacked `w13_weight` / `w2_weight` (`expert_slot_name`)."""
    if (spec.architecture in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
            and spec.head_dim * spec.num_attention_heads != spec.hidden_size):
        # vllm 0.32.0 model_executor/models/qwen2.py and qwen2_moe.py: head_dim = hidden_size // num_heads
        # (config.head_dim ignored), while transformers honours config.json's head_dim: the engine would build
        # other shapes.
        raise ValueError(
            f"{spec.architecture} with head_dim={spec.head_dim} != hidden_size/num_attention_heads="
            f"{spec.hidden_size}/{spec.num_attention_heads}: vLLM's Qwen2 derives head_dim from hidden_size and "
            "would not match the checkpoint; use Qwen3ForCausalLM (explicit head_dim) or a consistent config"
        )
    if spec.num_attention_heads % infer_tp:
        raise ValueError(
            f"rollout tp={infer_tp} does not divide num_attention_heads={spec.num_attention_heads}"
        )
    if infer_ep and not spec.is_moe:
        raise ValueError(f"rollout.ep (vLLM expert parallelism) needs a mixture-of-experts model; "
                         f"{spec.architecture} here has no MoE layer")
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
        if spec.is_moe_layer(i):
            out.extend(_vllm_moe_needs(spec, i, infer_tp, tp_rank, infer_ep))
            continue
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


# vLLM 0.32 module prefix of a MoE block (model_executor/models/{mixtral,qwen3_moe,qwen2_moe}.py): the router is
# `<block>.gate` (GateLinear, replicated), the routed experts `<block>.experts.routed_experts.{w13,w2}_weight`
# (RoutedExperts under the MoERunner), Qwen2-MoE's shared expert `<block>.shared_expert.{gate_up_proj,down_proj}`
# with its sigmoid gate `<block>.shared_expert_gate`.
VLLM_MOE_BLOCK = {"MixtralForCausalLM": "block_sparse_moe"}  # others: "mlp"
VLLM_ROUTED_EXPERTS = "experts.routed_experts"


def vllm_moe_block(spec: ModelSpec, layer: int) -> str:
    return f"model.layers.{layer}.{VLLM_MOE_BLOCK.get(spec.architecture, 'mlp')}"


def expert_slot_name(param: str, local_expert: int) -> str:
    """Name of local expert `local_expert`'s slot in vLLM's stacked expert parameter `param` ([E_local, ...]): the
    planner treats each slot as a parameter of its own (`param[e]` is a contiguous [rows, cols] tensor), so a rank
    never materialises more than the experts it holds; sinks write the slot into the stacked tensor."""
    return f"{param}[{local_expert}]"


def split_expert_slot(name: str) -> Optional[tuple[str, int]]:
    """(stacked parameter, local expert) for a slot name from `expert_slot_name`, None for any other name."""
    if not name.endswith("]") or "[" not in name:
        return None
    base, _, idx = name[:-1].rpartition("[")
    return base, int(idx)


def vllm_local_experts(num_experts: int, ep_size: int, ep_rank: int) -> range:
    """Global experts on vLLM expert-parallel rank `ep_rank` (vllm 0.32 fused_moe/expert_map_manager.py
    `determine_expert_map`, "linear" placement: the first E % ep ranks get one expert more; "round_robin" needs
    grouped top-k routing, which Mixtral / Qwen-MoE do not use, and falls back to linear)."""
    base, rem = divmod(num_experts, ep_size)
    start = ep_rank * base + min(ep_rank, rem)
    return range(start, start + base + (1 if ep_rank < rem else 0))


def _vllm_moe_needs(spec: ModelSpec, layer: int, infer_tp: int, tp_rank: int, infer_ep: bool) -> list[Placement]:
    """Router, routed-expert slots and shared expert of MoE layer `layer` on vLLM TP rank `tp_rank`.

    Routed expert e: `w13_weight[e_local]` = [gate rows; up rows] of the rank's 1/moe_tp slice (moe_tp = infer_tp,
    or 1 under vLLM EP where the rank holds whole experts); `w2_weight[e_local]` = down's columns of that slice."""
    from megarl.checkpoint.name_map import FAMILIES

    f = FAMILIES[spec.architecture]
    block = vllm_moe_block(spec, layer)
    shapes = cached_hf_shapes(spec)
    out: list[Placement] = []
    router = f["router"].format(i=layer)
    out.append(Placement(block + ".gate.weight", 0, Piece(router, 0, 0, shapes[router][0])))
    if infer_ep:
        experts, moe_tp, moe_rank = vllm_local_experts(spec.num_experts, infer_tp, tp_rank), 1, 0
    else:
        experts, moe_tp, moe_rank = range(spec.num_experts), infer_tp, tp_rank
    if spec.moe_ffn_hidden_size % moe_tp:
        raise ValueError(f"rollout tp={infer_tp} does not divide moe_ffn_hidden_size={spec.moe_ffn_hidden_size}")
    rows = spec.moe_ffn_hidden_size // moe_tp
    lo, hi = moe_rank * rows, (moe_rank + 1) * rows
    w13, w2 = f"{block}.{VLLM_ROUTED_EXPERTS}.w13_weight", f"{block}.{VLLM_ROUTED_EXPERTS}.w2_weight"
    for local, e in enumerate(experts):
        slot13, slot2 = expert_slot_name(w13, local), expert_slot_name(w2, local)
        out.append(Placement(slot13, 0, Piece(f["expert_gate"].format(i=layer, e=e), 0, lo, hi)))
        out.append(Placement(slot13, rows, Piece(f["expert_up"].format(i=layer, e=e), 0, lo, hi)))
        out.append(Placement(slot2, 0, Piece(f["expert_down"].format(i=layer, e=e), 1, lo, hi)))
    s = spec.shared_expert_ffn_hidden_size
    if s:
        if s % infer_tp:
            raise ValueError(f"rollout tp={infer_tp} does not divide shared_expert_ffn_hidden_size={s}")
        srows = s // infer_tp
        slo, shi = tp_rank * srows, (tp_rank + 1) * srows
        gate_up, down = block + ".shared_expert.gate_up_proj.weight", block + ".shared_expert.down_proj.weight"
        out.append(Placement(gate_up, 0, Piece(f["shared_gate"].format(i=layer), 0, slo, shi)))
        out.append(Placement(gate_up, srows, Piece(f["shared_up"].format(i=layer), 0, slo, shi)))
        out.append(Placement(down, 0, Piece(f["shared_down"].format(i=layer), 1, slo, shi)))
        gate = f["shared_expert_gate"].format(i=layer)
        out.append(Placement(block + ".shared_expert_gate.weight", 0, Piece(gate, 0, 0, shapes[gate][0])))
    return out


def vllm_param_shapes(spec: ModelSpec, infer_tp: int, tp_rank: int, infer_ep: bool = False
                      ) -> dict[str, tuple[int, ...]]:
    """Shape of every vLLM parameter shard on inference TP rank `tp_rank` (before any CPU repacking).

    Vocab-parallel parameters include vLLM's padding rows (left zero by the reshard); everything else is exactly
    covered by the rank's pieces.
    """
    shapes = cached_hf_shapes(spec)
    per_rank_vocab = vllm_padded_vocab(spec.vocab_size) // infer_tp
    extent: dict[str, int] = {}
    dims: dict[str, tuple[int, str]] = {}
    for p in vllm_needs(spec, infer_tp, tp_rank, infer_ep):
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
