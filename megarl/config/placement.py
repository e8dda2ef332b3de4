"""Where each role's ranks land: pools -> global ranks -> (node, device), and each rank's parallel coordinates.

Pure: no torch.distributed, no Ray. The controller places workers with these numbers; `megarl train --dry-run`
prints them.

Global ranks: pools are numbered in the order they appear in `resources.pools`; a pool of `nodes` x
`devices_per_node` devices owns that many consecutive global ranks, node-major. Roles on the same pool are
colocated: they share the pool's ranks (the hybrid engine), each with its own `RoleTopology`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megarl.config.schema import JobConfig, PoolConfig, ResourcesConfig
from megarl.parallel.topology import RoleTopology, layer_split


def pool_size(pool: PoolConfig) -> int:
    """Devices in a pool."""
    return pool.nodes * pool.devices_per_node


def pool_offsets(resources: ResourcesConfig) -> dict[str, int]:
    """First global rank of each pool."""
    offsets, next_rank = {}, 0
    for name, pool in resources.pools.items():
        offsets[name] = next_rank
        next_rank += pool_size(pool)
    return offsets


def role_topology(cfg: JobConfig, role: str) -> RoleTopology:
    """The Megatron layout of a role of a validated config (dp resolved), offset to its pool's first rank."""
    r = cfg.role(role)
    p = r.parallel
    return RoleTopology(tp=p.tp, pp=p.pp, dp=p.dp, cp=p.cp, ep=p.ep, etp=p.etp,
                        rank_offset=pool_offsets(cfg.resources)[r.pool])


@dataclasses.dataclass(frozen=True)
class RankPlacement:
    """One row of the placement table.

    `layers` is the half-open range [start, stop) of transformer layers on this rank's pipeline stage; None for
    the rollout engine, which holds the whole model (its `tp` is the engine's TP rank, `dp` the engine index).
    """

    role: str
    rank: int
    node: int
    device: str
    tp: int
    pp: int
    dp: int
    cp: int
    layers: Optional[tuple[int, int]]


def device_kind(cfg: JobConfig) -> str:
    """'cuda' or 'cpu'; 'auto' asks torch (imported only then)."""
    if cfg.resources.device != "auto":
        return cfg.resources.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def placement(cfg: JobConfig, num_layers_by_role: dict[str, int], kind: str,
              topologies: Optional[dict[str, RoleTopology]] = None) -> list[RankPlacement]:
    """Rows for every rank of every enabled role, plus the rollout engines (on the actor's pool, or `rollout.pool`)
    and the judge's engines (reward.judge, on its pool). Engine rows (the rollout's, the judge's, a vLLM-served
    teacher's) have `layers` None, tp = the engine's TP rank, dp = the engine index.

    `num_layers_by_role` gives each enabled role's layer count (roles may run different models; each enabled
    distillation teacher's under "teacher/<name>"); `topologies`
    overrides `role_topology` for some roles (the actor in a co-designed rank order).
    """
    offsets = pool_offsets(cfg.resources)
    rows: list[RankPlacement] = []

    def where(pool_name: str, rank: int) -> tuple[int, str]:
        pool = cfg.resources.pools[pool_name]
        local = rank - offsets[pool_name]
        node, index = divmod(local, pool.devices_per_node)
        return node, (f"cuda:{index}" if kind == "cuda" else "cpu")

    for role in cfg.enabled_roles():
        r = cfg.role(role)
        topo = (topologies or {}).get(role) or role_topology(cfg, role)
        split = layer_split(
            num_layers_by_role[role], topo.pp, r.parallel.first_stage_layers, r.parallel.last_stage_layers
        )
        starts = [sum(split[:i]) for i in range(len(split))]
        for c in topo.coords():
            node, device = where(r.pool, c.rank)
            layers = (starts[c.pp], starts[c.pp] + split[c.pp])
            rows.append(RankPlacement(role, c.rank, node, device, c.tp, c.pp, c.dp, c.cp, layers))

    for name, t in cfg.distillation.teachers.items():  # on the actor's pool or their own, each at its own layout
        if not t.enabled:
            continue
        p, role = t.parallel, f"teacher/{name}"
        pool = t.pool if t.pool is not None else cfg.actor.pool
        if t.backend == "vllm":  # engines of its own: one per tp devices of its pool, each the whole model
            for local in range(pool_size(cfg.resources.pools[pool])):
                node, device = where(pool, offsets[pool] + local)
                engine, tp_rank = divmod(local, p.tp)
                rows.append(RankPlacement(role, offsets[pool] + local, node, device, tp_rank, 0, engine, 0, None))
            continue
        topo = RoleTopology(tp=p.tp, pp=p.pp, dp=p.dp, cp=p.cp, ep=p.ep, etp=p.etp, rank_offset=offsets[pool])
        split = layer_split(num_layers_by_role[role], topo.pp, p.first_stage_layers, p.last_stage_layers)
        starts = [sum(split[:i]) for i in range(len(split))]
        for c in topo.coords():
            node, device = where(pool, c.rank)
            rows.append(RankPlacement(role, c.rank, node, device, c.tp, c.pp, c.dp, c.cp,
                                      (starts[c.pp], starts[c.pp] + split[c.pp])))

    engines_pool = cfg.rollout.pool if cfg.rollout.pool is not None else cfg.actor.pool  # null: the actor's
    for local in range(pool_size(cfg.resources.pools[engines_pool])):
        rank = offsets[engines_pool] + local
        node, device = where(engines_pool, rank)
        engine, tp_rank = divmod(local, cfg.rollout.tp)
        rows.append(RankPlacement("rollout", rank, node, device, tp_rank, 0, engine, 0, None))
    judge = cfg.reward.judge
    if judge is not None:  # the judge's engines on a pool of their own (validated)
        for local in range(pool_size(cfg.resources.pools[judge.pool])):
            rank = offsets[judge.pool] + local
            node, device = where(judge.pool, rank)
            engine, tp_rank = divmod(local, judge.tp)
            rows.append(RankPlacement("judge", rank, node, device, tp_rank, 0, engine, 0, None))
    return rows


def format_table(rows: list[RankPlacement], num_layers_by_role: dict[str, int]) -> str:
    """Fixed-width text table of `rows`."""
    header = ("role", "rank", "node", "device", "tp", "pp", "dp", "cp", "layers")
    lines = [header]
    for r in rows:
        if r.layers is None:  # a rollout or judge engine rank: whole model, no pipeline or context split
            pp, cp, layers = "-", "-", f"all (engine {r.dp})"
        else:
            pp, cp, layers = str(r.pp), str(r.cp), f"{r.layers[0]}-{r.layers[1] - 1} of {num_layers_by_role[r.role]}"
        lines.append((r.role, str(r.rank), str(r.node), r.device, str(r.tp), pp, str(r.dp), cp, layers))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)
