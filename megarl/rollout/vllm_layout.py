"""Where each slice of a HuggingFace tensor lives in a vLLM engine's parameters on one rank (pure; no vLLM import).

`megarl.rollout.vllm_adapter.VllmRolloutEngine.param_shards()` describes every vLLM parameter of its rank with a
`ParamShard`; the reshard engine plans transfers from these descriptors, and `build_shard` is the reference (oracle)
construction used by tests: it reads full HF tensors, which the reshard engine must never do.

A shard is `cat([hf[part.hf_name].narrow(dim, part.start, part.length) for part in parts], dim)` followed by
`pad_rows` zero rows along dim 0. The vLLM layouts this expresses (per TP rank r of size T):
- qkv_proj (kind 'qkv', dim 0): [q rows of heads r*H/T..; k rows of kv-head group r // replicas; v likewise],
  where replicas = max(1, T / num_kv_heads) (kv heads are replicated when T > num_kv_heads).
- gate_up_proj (kind 'gate_up', dim 0): [gate rows r*I/T..(r+1)*I/T; up rows likewise].
- column-parallel (dim 0) / row-parallel (kind 'row', dim 1, e.g. o_proj, down_proj): the r-th 1/T block.
- embed_tokens / lm_head (kind 'vocab', dim 0): vocab rows [org_vocab_start, org_vocab_end) of this rank, then
  `pad_rows` zero rows: vLLM pads the vocabulary to a multiple of 64 * T and splits the padded size evenly, so the
  last rank(s) hold fewer real rows.
- replicated (norms, MoE routers; kind 'replicated', dim None): the whole tensor on every rank.
- routed experts of a fused-MoE layer (kind 'experts', dim None): `experts.routed_experts.w13_weight`
  [E_local, 2*I/T, H] (per local expert [gate rows; up rows] of the rank's 1/T slice) and `w2_weight`
  [E_local, H, I/T]; T is 1 under vLLM expert parallelism, which places whole experts per rank. `parts` names the
  parameter itself (not HF tensors): `megarl.reshard.layouts.vllm_needs` describes the per-expert HF pieces, and
  `build_shard` refuses this kind.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Literal, Optional

import torch

ShardKind = Literal["qkv", "gate_up", "column", "row", "vocab", "replicated", "experts"]


@dataclasses.dataclass(frozen=True)
class ShardPart:
    """`hf[hf_name].narrow(dim, start, length)` (length = the tensor's full size for replicated parameters)."""

    hf_name: str
    start: int
    length: int


@dataclasses.dataclass(frozen=True)
class ParamShard:
    """One vLLM parameter on one rank, in the layout vLLM's weight loaders produce (before CPU oneDNN repacking).

    name: the vLLM parameter name (e.g. 'model.layers.0.self_attn.qkv_proj.weight').
    shape: this rank's shape. dtype: the engine's parameter dtype.
    dim: the dimension the parts are concatenated along and the TP split runs on (None: replicated).
    pad_rows: zero rows appended along dim 0 (vocab padding).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: ShardKind
    dim: Optional[int]
    parts: tuple[ShardPart, ...]
    pad_rows: int = 0
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def hf_names(self) -> tuple[str, ...]:
        return tuple(p.hf_name for p in self.parts)


def build_shard(shard: ParamShard, get_hf: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """Reference construction of `shard` from full HF tensors (`get_hf(name)`); returns a new contiguous tensor."""
    if shard.kind == "experts":
        raise ValueError(f"{shard.name}: stacked expert parameters are built per expert slot "
                         "(megarl.reshard.layouts.vllm_needs), not by build_shard")
    if shard.dim is None:
        out = get_hf(shard.parts[0].hf_name)
    else:
        out = torch.cat([get_hf(p.hf_name).narrow(shard.dim, p.start, p.length) for p in shard.parts], dim=shard.dim)
    if shard.pad_rows:
        out = torch.cat([out, out.new_zeros((shard.pad_rows,) + tuple(out.shape[1:]))], dim=0)
    out = out.to(shard.dtype).contiguous()
    if tuple(out.shape) != tuple(shard.shape):
        raise ValueError(f"{shard.name}: built shape {tuple(out.shape)} != expected {shard.shape}")
    return out
