"""Process groups for one role, built from its `RoleTopology` and handed to megatron-core explicitly.

Every rank of the torch.distributed world must call `build_role_groups` for every role, in the same order:
`torch.distributed.new_subgroups_by_enumeration` is collective over the world. Ranks outside the role get a
`RoleGroups` whose `pgs` is None. Nothing is stored in module globals, so an actor at TP=2 and a critic at TP=1
coexist in one job; each role passes its own `ProcessGroupCollection` to GPTModel, DDP, the optimizer and the
pipeline schedule.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

import torch.distributed as dist

from megarl.parallel.topology import RankCoord, RoleTopology

if TYPE_CHECKING:  # megatron-core is imported only when groups are built, keeping `plan_role_groups` pure
    from megatron.core.process_groups_config import ProcessGroupCollection


@dataclasses.dataclass
class RoleGroups:
    """A role's groups as seen from this rank.

    Attributes:
        topology: the role's layout.
        coord: this rank's coordinates, or None when this rank is not part of the role.
        pgs: megatron-core's collection (tp, pp, mp, cp, dp, dp_cp, tp_cp, embd, pos_embd, expert groups) or None.
        pp_ranks: global ranks of this rank's pipeline group, in stage order (empty outside the role).
    """

    topology: RoleTopology
    coord: Optional[RankCoord]
    pgs: Optional["ProcessGroupCollection"]
    pp_ranks: list[int]

    @property
    def is_member(self) -> bool:
        return self.coord is not None

    @property
    def is_first_stage(self) -> bool:
        return self.coord is not None and self.coord.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coord is not None and self.coord.pp == self.topology.pp - 1


def _expert_enumerations(topo: RoleTopology) -> dict[str, list[list[int]]]:
    """Expert-layer groups in megatron-core's expert grid order etp-ep-edp-pp (`RoleTopology.expert_coord`;
    parallel_state.initialize_model_parallel's `expert_decoder_rank_generator`).

    ep: experts split over it (the alltoall dispatcher's group); expt_tp: each expert's FFN width split over it;
    expt_dp: same expert slice, gradients reduced over it; tp_ep: etp x ep (tokens travel over it); tp_ep_pp.
    For dense models (ep=1, etp=tp) these degenerate to: ep = singletons, expt_tp = tp, expt_dp = dp*cp.
    """
    coords = {}
    for rank in topo.ranks:
        c = topo.expert_coord(rank)
        coords[rank] = (c.etp, c.ep, c.edp, c.pp)

    def enum(varying: tuple[int, ...]) -> list[list[int]]:  # each group in coordinate order (= group rank order)
        buckets: dict[tuple, list[tuple[tuple, int]]] = {}
        for rank, c in coords.items():
            key = tuple(c[i] for i in range(4) if i not in varying)
            buckets.setdefault(key, []).append((tuple(c[i] for i in varying[::-1]), rank))
        return [[r for _, r in sorted(v)] for _, v in sorted(buckets.items(), key=lambda kv: kv[0][::-1])]

    return {
        "ep": enum((1,)),
        "expt_tp": enum((0,)),
        "expt_dp": enum((2,)),
        "tp_ep": enum((0, 1)),
        "tp_ep_pp": enum((0, 1, 3)),
    }


def plan_role_groups(topo: RoleTopology) -> dict[str, list[list[int]]]:
    """Pure: the rank enumeration of every group megatron-core needs for this role (name -> list of rank lists)."""
    pp_groups = topo.groups("pp")
    plan = {
        "tp": topo.groups("tp"),
        "pp": pp_groups,
        "cp": topo.groups("cp"),
        "dp": topo.groups("dp"),
        "dp_cp": topo.groups(("dp", "cp")),
        "tp_cp": topo.groups(("tp", "cp")),
        "mp": topo.groups(("tp", "pp")),
        "tp_dp_cp": topo.groups(("tp", "dp", "cp")),
        # Tied word embeddings: first and last stage of each pipeline share the embedding gradient all-reduce.
        "embd": [topo.embedding_group(g) for g in pp_groups],
        # Learned position embeddings live on the first stage only.
        "pos_embd": [[g[0]] for g in pp_groups],
        # One distributed-optimizer instance spanning the whole role: megatron-core reduces gradient statistics
        # (grad norm, zero count) over it (optimizer/__init__.py sets grad_stats_parallel_group to it).
        "intra_dist_opt": [list(topo.ranks)],
    }
    plan.update(_expert_enumerations(topo))
    return plan


def build_role_groups(topo: RoleTopology) -> RoleGroups:
    """Collective over the whole world: create this role's groups and return this rank's view of them."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call megarl.platform.init_distributed() first")
    world = dist.get_world_size()
    if topo.rank_offset + topo.world_size > world:
        raise ValueError(
            f"role layout {topo.describe()} needs ranks {topo.rank_offset}..{topo.rank_offset + topo.world_size - 1}"
            f" but the world has {world} rank(s)"
        )
    from megatron.core.process_groups_config import ProcessGroupCollection

    rank = dist.get_rank()
    member = rank in topo.ranks
    pgs = ProcessGroupCollection() if member else None
    created: dict[tuple, Optional[dist.ProcessGroup]] = {}  # identical enumerations share one group
    for name, enumeration in plan_role_groups(topo).items():
        key = tuple(tuple(g) for g in enumeration)
        if key not in created:
            created[key] = _new_groups(enumeration)
        group = created[key]
        if pgs is not None:
            setattr(pgs, name, group)
    if pgs is not None:
        # Dense distributed optimizer: one instance spanning the whole dp*cp group.
        pgs.intra_dp_cp = pgs.dp_cp
        pgs.intra_expt_dp = pgs.expt_dp
    coord = topo.coord(rank) if member else None
    pp_ranks = next((g for g in topo.groups("pp") if rank in g), []) if member else []
    return RoleGroups(topology=topo, coord=coord, pgs=pgs, pp_ranks=pp_ranks)


def _new_groups(enumeration: list[list[int]]) -> Optional[dist.ProcessGroup]:
    """Create one group per rank list (collective over the world); return the one holding this rank, if any.

    The list order is the group rank order (`sort_ranks=False`): with a permuted `RoleTopology.rank_order` a TP
    group such as [0, 2, 1, 3] makes global rank 2 TP rank 1. Natural-order lists are sorted, as torch would make
    them anyway.
    """
    rank = dist.get_rank()
    mine = None
    for ranks in enumeration:
        group = dist.new_group(ranks=ranks, sort_ranks=False)
        if rank in ranks:
            mine = group
    return mine
