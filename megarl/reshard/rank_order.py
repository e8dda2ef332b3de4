"""Co-design the actor's rank order with the rollout engine's TP groups (pure; no torch.distributed).

vLLM's external launcher makes every block of `infer_tp` consecutive global ranks one inference TP group, and the
rank at position j of its block inference TP rank j. Which Megatron coordinate each rank holds is ours to choose
(megarl builds Megatron's groups itself, `RoleTopology.rank_order`), and it decides how much of what inference rank
j needs is already local. Example, actor TP4 -> rollout TP2: inference rank j needs half j of every TP-sharded
tensor = Megatron shards 2j and 2j+1. In the natural order ranks 0 and 1 hold shards 0 and 1, so rank 1 holds none
of half 1 and receives all of it (1/2 of the TP-sharded bytes); with TP order [0, 2, 1, 3] every rank holds one of
the two shards it needs and receives the other (1/4).

`choose_rank_order` searches candidate orders, each a (dim order, TP permutation) pair:
  - dim order: which of tp, cp, dp, pp varies fastest over consecutive ranks (natural: tp, cp, dp, pp); orders
    that only reorder dims of size 1 are the same order and are tried once;
  - TP permutation: position p along the TP dim holds TP shard perm[p], the same in every TP group; all
    permutations when tp <= 4, otherwise the identity and the strided ones (position p -> shard
    (p % a) * (tp // a) + p // a for every divisor a of tp, which is how TP T -> t with t | T puts one of each
    inference rank's T/t shards in each of its T/t blocks).
A rank's bytes received depend only on its (tp, pp) coordinate and its inference TP rank: bytes that inference rank
needs minus (its Megatron holdings intersected with those needs), from `layouts` (`megatron_holdings`,
`vllm_needs`) exactly as `planner.lower_bound_bytes` counts them; the planner's plan receives exactly that.
Candidates are ranked by (max bytes received by any rank, total bytes received); ties keep the earlier candidate,
and the natural order is the first, so it is kept unless something is strictly better.

Training constraint: every TP group stays inside one node (global ranks [k*devices_per_node,
(k+1)*devices_per_node)) when the natural order achieves that. When it cannot (tp > devices_per_node, or
devices_per_node not a multiple of tp), only the natural dim order is tried (TP groups span the fewest nodes,
as in the natural order) with TP permutations inside it, which move no group to another node.
`devices_per_node=None` places no constraint.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Optional

from megarl.models.spec import ModelSpec
from megarl.parallel.topology import DIMS, RoleTopology
from megarl.reshard.layouts import megatron_holdings, piece_bytes, vllm_needs
from megarl.reshard.routing import merge_runs

MODES = ("natural", "reshard")


@dataclasses.dataclass(frozen=True)
class RankOrderChoice:
    """A chosen order and what it implies.

    Attributes:
        topology: the training topology with `rank_order` set (None = natural).
        dim_order: dims fastest-varying first over consecutive ranks.
        tp_perm: position along the TP dim -> TP shard.
        received: bytes each global rank receives at the reshard under this order (dtype of the call).
        natural_received: the same under the natural order.
    """

    topology: RoleTopology
    dim_order: tuple[str, ...]
    tp_perm: tuple[int, ...]
    received: dict[int, int]
    natural_received: dict[int, int]

    @property
    def max_bytes(self) -> int:
        return max(self.received.values())

    @property
    def mean_bytes(self) -> float:
        return sum(self.received.values()) / len(self.received)

    @property
    def natural_max_bytes(self) -> int:
        return max(self.natural_received.values())

    @property
    def natural_mean_bytes(self) -> float:
        return sum(self.natural_received.values()) / len(self.natural_received)


def order_from(topo: RoleTopology, dim_order: tuple[str, ...], tp_perm: tuple[int, ...]) -> RoleTopology:
    """`topo` with the coordinates laid over consecutive ranks in `dim_order` (fastest first) and TP position p
    holding TP shard `tp_perm[p]`."""
    if sorted(dim_order) != sorted(DIMS):
        raise ValueError(f"dim_order must order {list(DIMS)}, got {list(dim_order)}")
    if sorted(tp_perm) != list(range(topo.tp)):
        raise ValueError(f"tp_perm must be a permutation of 0..{topo.tp - 1}, got {list(tp_perm)}")
    sizes = {"tp": topo.tp, "cp": topo.cp, "dp": topo.dp, "pp": topo.pp}
    order = [0] * topo.world_size
    for local in range(topo.world_size):
        digits, rest = {}, local
        for d in dim_order:
            digits[d] = rest % sizes[d]
            rest //= sizes[d]
        tp = tp_perm[digits["tp"]]
        natural = tp + topo.tp * (digits["cp"] + topo.cp * (digits["dp"] + topo.dp * digits["pp"]))
        order[natural] = local
    base = dataclasses.replace(topo, rank_order=None)
    return dataclasses.replace(base, rank_order=tuple(order))


def received_table(spec: ModelSpec, topo: RoleTopology, infer_tp: int, dtype_bytes: int = 2) -> dict:
    """{(tp, pp, j): bytes a rank at Megatron (tp, pp) receives when it is inference TP rank j} (dp and cp hold the
    same weights). Needs of j minus (holdings intersected with needs), from the layouts alone."""
    natural = dataclasses.replace(topo, rank_order=None)
    needs = {j: vllm_needs(spec, infer_tp, j) for j in range(infer_tp)}
    table = {}
    for pp in range(topo.pp):
        for tp in range(topo.tp):
            held: dict[tuple[str, int], list[tuple[int, int]]] = {}
            for p in megatron_holdings(spec, natural, natural.rank_of(tp=tp, pp=pp)):
                held.setdefault((p.piece.hf_name, p.piece.dim), []).append((p.piece.start, p.piece.stop))
            for j in range(infer_tp):
                total = 0
                for need in needs[j]:
                    n = need.piece
                    runs = merge_runs(held.get((n.hf_name, n.dim), []))
                    covered = sum(max(0, min(hi, n.stop) - max(lo, n.start)) for lo, hi in runs)
                    total += piece_bytes(spec, dataclasses.replace(n, start=0, stop=n.length - covered), dtype_bytes)
                table[(tp, pp, j)] = total
    return table


def received_bytes(topo: RoleTopology, infer_tp: int, table: dict) -> dict[int, int]:
    """{global rank: bytes received} for `topo`'s order, inference TP rank = position in its block."""
    out = {}
    for c in topo.coords():
        out[c.rank] = table[(c.tp, c.pp, (c.rank - topo.rank_offset) % infer_tp)]
    return out


def _tp_perms(tp: int) -> list[tuple[int, ...]]:
    if tp <= 4:
        return list(itertools.permutations(range(tp)))
    perms = [tuple(range(tp))]
    for a in range(2, tp):
        if tp % a == 0:
            perms.append(tuple((p % a) * (tp // a) + p // a for p in range(tp)))
    return perms


def _dim_orders(topo: RoleTopology) -> list[tuple[str, ...]]:
    sizes = topo.sizes()
    seen, out = set(), []
    for order in itertools.permutations(DIMS):
        key = tuple(d for d in order if sizes[d] > 1)
        if key not in seen:
            seen.add(key)
            out.append(order)
    natural = next(o for o in out if tuple(d for d in o if sizes[d] > 1) == tuple(d for d in DIMS if sizes[d] > 1))
    return [natural] + [o for o in out if o != natural]


def tp_groups_in_nodes(topo: RoleTopology, devices_per_node: int) -> bool:
    """True when every TP group's global ranks lie inside one node of `devices_per_node` consecutive ranks."""
    return all(len({r // devices_per_node for r in g}) == 1 for g in topo.groups("tp"))


def choose_rank_order(spec: ModelSpec, topo: RoleTopology, infer_tp: int, dtype_bytes: int = 2,
                      devices_per_node: Optional[int] = None) -> RankOrderChoice:
    """The candidate order minimising (max bytes received by any rank, total bytes) at the reshard to rollout TP
    `infer_tp`; see the module docstring for the candidates and the node constraint."""
    if infer_tp < 1 or topo.world_size % infer_tp:
        raise ValueError(f"rollout tp={infer_tp} must divide the actor's {topo.world_size} ranks ({topo.describe()})")
    if topo.ep > 1:
        raise ValueError(f"rank order co-design does not handle ep={topo.ep} > 1 yet; use rank_order: natural")
    natural = dataclasses.replace(topo, rank_order=None)
    table = received_table(spec, natural, infer_tp, dtype_bytes)
    natural_received = received_bytes(natural, infer_tp, table)
    constrained = devices_per_node is not None and tp_groups_in_nodes(natural, devices_per_node)
    dim_orders = _dim_orders(natural) if devices_per_node is None or constrained else _dim_orders(natural)[:1]
    best = None
    for dim_order in dim_orders:
        for perm in _tp_perms(topo.tp):
            cand = order_from(natural, dim_order, perm)
            if constrained and not tp_groups_in_nodes(cand, devices_per_node):
                continue
            got = received_bytes(cand, infer_tp, table)
            score = (max(got.values()), sum(got.values()))
            if best is None or score < best[0]:
                best = (score, cand, dim_order, perm, got)
    _, cand, dim_order, perm, got = best
    return RankOrderChoice(cand, tuple(dim_order), tuple(perm), got, natural_received)


def resolve_rank_order(mode: str, spec: ModelSpec, topo: RoleTopology, infer_tp: int,
                       devices_per_node: Optional[int] = None) -> RoleTopology:
    """`topo` in the order config mode `mode` names: "natural" (unchanged) or "reshard" (`choose_rank_order`)."""
    if mode == "natural":
        return dataclasses.replace(topo, rank_order=None)
    if mode == "reshard":
        return choose_rank_order(spec, topo, infer_tp, devices_per_node=devices_per_node).topology
    raise ValueError(f"rank_order must be one of {list(MODES)}, got {mode!r}")


def actor_order_report(cfg) -> tuple[RoleTopology, str]:
    """(the actor's topology in `actor.parallel.rank_order`'s order, lines for `megarl train --dry-run`) of a
    validated `JobConfig`: the chosen order and the reshard bytes it implies next to the natural order's."""
    from megarl.config.arch import spec_from_arch
    from megarl.config.placement import role_topology
    from megarl.config.validate import role_archs

    mode = cfg.actor.parallel.rank_order
    topo = role_topology(cfg, "actor")
    dtype_bytes = 4 if cfg.model.dtype == "fp32" else 2
    spec = spec_from_arch(role_archs(cfg)["actor"])
    try:
        choice = choose_rank_order(spec, topo, cfg.rollout.tp, dtype_bytes,
                                   devices_per_node=cfg.resources.pools[cfg.actor.pool].devices_per_node)
    except ValueError as e:
        if mode == "natural":
            return topo, f"reshard bytes not estimated: {e}"
        raise
    natural = f"natural order: max {_size(choice.natural_max_bytes)}, mean {_size(choice.natural_mean_bytes)}"
    best = (f"co-designed order: max {_size(choice.max_bytes)}, mean {_size(choice.mean_bytes)} "
            f"(TP groups {choice.topology.groups('tp')})")
    chosen = choice.topology if mode == "reshard" else topo
    lines = [
        f"actor.parallel.rank_order: {mode}; TP groups {chosen.groups('tp')} (group rank order)",
        f"bytes received per rank at the reshard into rollout tp={cfg.rollout.tp} ({cfg.model.dtype}):",
        ("  * " if mode == "natural" else "    ") + natural,
        ("  * " if mode == "reshard" else "    ") + best,
    ]
    return chosen, "\n".join(lines)


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"
