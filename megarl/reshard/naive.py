"""The naive baseline: gather every full parameter on every rank, then slice out the inference shard.

For each Megatron parameter, in order: all-gather its TP shards over the TP group, broadcast the full tensor from
the pipeline stage that owns it over the PP group, convert it to HF tensors, and cut this rank's vLLM pieces from
them. This is how early hybrid engines synchronised weights; it moves (model bytes - bytes held) into every rank
and builds each full parameter everywhere. Used by `benchmarks/reshard.py` as the same-run baseline and by tests
as an independent reference. Collective over the actor's ranks.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
import torch.distributed as dist

from megarl.checkpoint.name_map import hf_shapes, param_layouts, scatter_shard, shard_segments
from megarl.parallel.groups import RoleGroups
from megarl.reshard.executor import ReshardReport, WeightSink
from megarl.reshard.layouts import DEFAULT_TRAIN_LAYOUT, stage_layers, vllm_needs, vllm_param_shapes
from megarl.reshard.planner import ReshardPlan


@torch.no_grad()
def naive_reshard(
    plan: ReshardPlan, groups: RoleGroups, sources: dict[str, torch.Tensor], sink: WeightSink
) -> ReshardReport:
    """Gather-then-slice into `sink`; returns a report with the bytes this rank received and its peak buffers."""
    start = time.perf_counter()
    spec, topo = plan.spec, plan.train
    if topo.ep > 1 or topo.expert_tp != topo.tp or plan.train_layout != DEFAULT_TRAIN_LAYOUT:
        raise NotImplementedError(f"the naive gather baseline covers even pipeline splits without expert or virtual "
                                  f"pipeline parallelism; got {topo.describe()} {plan.train_layout}")
    if not plan.colocated:
        raise NotImplementedError(f"the naive gather baseline runs on colocated plans; this plan's engines are "
                                  f"{plan.infer.describe()}, its training ranks {plan.train.describe()}")
    rank = dist.get_rank()
    coord = groups.coord
    # The plan's element size decides the dtype (as in the executor): a CPU bf16 engine keeps fp32 norms, which are
    # cast so every rank agrees on the wire format.
    dtype = next(t.dtype for t in sources.values() if t.element_size() == plan.dtype_bytes)
    device = next(iter(sources.values())).device
    shapes = hf_shapes(spec)
    my_infer = plan.infer_rank_of[rank]
    needs_by_hf = defaultdict(list)
    for p in vllm_needs(spec, plan.infer_tp, my_infer, plan.infer_ep):
        needs_by_hf[p.piece.hf_name].append(p)
    vshapes = vllm_param_shapes(spec, plan.infer_tp, my_infer, plan.infer_ep)
    remaining = defaultdict(int)
    for ps in needs_by_hf.values():
        for p in ps:
            remaining[p.param] += p.piece.length
    targets: dict[str, torch.Tensor] = {}
    received = peak = 0
    pp_src = {s: groups.pp_ranks[s] for s in range(topo.pp)}

    for layout in param_layouts(spec):
        if layout.layer is not None:
            owner = next(s for s in range(topo.pp) if layout.layer in stage_layers(spec, topo, s))
        elif layout.megatron_name.startswith("embedding."):
            owner = 0
        else:
            owner = topo.pp - 1
        name = layout.megatron_name
        full_shape = None
        gathered = None
        if coord.pp == owner:
            shard = sources[name].to(dtype).contiguous()
            if topo.tp > 1:
                parts = [torch.empty_like(shard) for _ in range(topo.tp)]
                dist.all_gather(parts, shard, group=groups.pgs.tp)
                received += shard.numel() * shard.element_size() * (topo.tp - 1)
            else:
                parts = [shard]
            gathered = torch.stack(parts)
            full_shape = gathered.shape
        if topo.pp > 1:
            shard_shape = _shard_shape(spec, layout, topo.tp, sources, name, coord.pp == owner)
            if gathered is None:
                gathered = torch.empty((topo.tp, *shard_shape), dtype=dtype, device=device)
                received += gathered.numel() * gathered.element_size()
            dist.broadcast(gathered, src=pp_src[owner], group=groups.pgs.pp)
        hf = {n: torch.empty(shapes[n], dtype=dtype, device=device) for n in layout.hf_names}
        for t in range(topo.tp):
            scatter_shard(spec, layout, t, topo.tp, gathered[t], hf)
        peak = max(
            peak, gathered.numel() * gathered.element_size() + sum(x.numel() * x.element_size() for x in hf.values())
        )
        for hf_name, full in hf.items():
            for p in needs_by_hf.get(hf_name, []):
                if p.param not in targets:
                    targets[p.param] = sink.target(p.param, vshapes[p.param], dtype)
                dst = targets[p.param].narrow(p.piece.dim, p.offset, p.piece.length)
                dst.copy_(full.narrow(p.piece.dim, p.piece.start, p.piece.length))
                remaining[p.param] -= p.piece.length
                if remaining[p.param] == 0:
                    sink.commit(p.param)
        del gathered, hf, full_shape
    sink.finish()
    stats = next(s for s in plan.stats if s.rank == rank)
    return ReshardReport(
        rank=rank, bytes_received=received, bytes_sent=0, bytes_local=0,
        bytes_lower_bound=stats.bytes_lower_bound, bytes_naive=stats.bytes_naive,
        peak_extra_bytes=peak, buckets=0, time_s=time.perf_counter() - start,
    )


def _shard_shape(spec, layout, tp, sources, name, owned) -> tuple[int, ...]:
    """Shape of one TP shard of `layout` (known locally on the owner; computed from segments elsewhere)."""
    if owned:
        return tuple(sources[name].shape)
    shapes = hf_shapes(spec)
    first = shapes[layout.hf_names[0]]
    if layout.partition_dim is None:
        return tuple(first)
    size = sum(s.size for s in shard_segments(spec, layout, 0, tp))
    shape = list(first)
    shape[layout.partition_dim] = size
    return tuple(shape)
