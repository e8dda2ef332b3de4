"""Pure description of one role's parallel layout: which global rank holds which (tp, cp, dp, pp) coordinate.

Nothing here touches torch.distributed; `megarl.parallel.groups` turns a `RoleTopology` into process groups.

Rank order matches megatron-core's default `initialize_model_parallel(order="tp-cp-ep-dp-pp")`:
tp varies fastest, then cp, then dp, then pp, so

    rank = rank_offset + tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

Expert layers have their own grid over the same ranks (megatron-core's expert `RankGenerator`: the default order
"tp-cp-ep-dp-pp" with tp := etp and cp := 1): within a pipeline stage, the rank's position s in 0..tp*cp*dp-1 gives

    etp_rank = s % etp,  ep_rank = (s // etp) % ep,  edp_rank = s // (etp * ep)

so etp*ep must divide tp*cp*dp (`expert_coord`). With etp = tp (megatron-core's default, `etp=None`) expert
parallelism is carved out of the dp*cp ranks; with etp < tp it may also span TP ranks (e.g. tp=2, dp=1, ep=2, etp=1).

`rank_order` (optional) moves coordinates to other ranks: the coordinate whose natural index (the formula above,
without the offset) is `i` lives on local rank `rank_order[i]`. Groups are then listed in coordinate order (group
rank = the coordinate along the group's dims), so a TP group may be e.g. ranks [0, 2, 1, 3]: rank 1 holds TP shard
2. `megarl.reshard.rank_order` chooses such orders to cut reshard bytes; None is the natural order.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterator

DIMS = ("tp", "cp", "dp", "pp")  # fastest-varying first


class TopologyError(ValueError):
    """A layout that cannot be built; the message names the offending numbers."""


@dataclasses.dataclass(frozen=True)
class RankCoord:
    """Coordinates of one global rank inside a role's layout."""

    rank: int
    tp: int
    cp: int
    dp: int
    pp: int


@dataclasses.dataclass(frozen=True)
class ExpertCoord:
    """Coordinates of one global rank in a role's expert grid (megatron-core's expert `RankGenerator`).

    etp: expert tensor-parallel rank (slices each expert's FFN width); ep: expert-parallel rank (which experts);
    edp: expert data-parallel rank (replicas of the same expert slice; gradients are reduced over them); pp: stage.
    """

    rank: int
    etp: int
    ep: int
    edp: int
    pp: int


@dataclasses.dataclass(frozen=True)
class RoleTopology:
    """Layout of one role over `world_size = tp*cp*dp*pp` consecutive global ranks starting at `rank_offset`.

    Attributes:
        tp: tensor-parallel size (splits attention heads and MLP columns/rows).
        pp: pipeline-parallel size (splits the layer stack into stages).
        dp: data-parallel size (replicas; the distributed optimizer shards its state over them).
        cp: context-parallel size (splits the sequence).
        ep: expert-parallel size for MoE layers (1 for dense models).
        etp: expert tensor-parallel size for MoE layers (megatron-core `expert_tensor_parallel_size`); None = tp.
            etp*ep must divide tp*cp*dp (the expert grid, see the module docstring).
        rank_offset: first global rank of this role (roles in other pools start elsewhere).
        rank_order: None (natural order) or a permutation of range(world_size): natural coordinate index i ->
            the local rank (global rank - rank_offset) that holds it.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    rank_offset: int = 0
    rank_order: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise TopologyError(f"{name} must be a positive integer, got {value!r}")
        if self.etp is not None and (not isinstance(self.etp, int) or self.etp < 1):
            raise TopologyError(f"etp must be a positive integer or None (= tp), got {self.etp!r}")
        if self.etp == self.tp:
            object.__setattr__(self, "etp", None)  # etp = tp has one spelling (megatron-core's default)
        if self.rank_offset < 0:
            raise TopologyError(f"rank_offset must be >= 0, got {self.rank_offset}")
        per_stage = self.tp * self.cp * self.dp
        if per_stage % (self.expert_tp * self.ep) != 0:
            if self.etp is None:
                raise TopologyError(
                    f"ep={self.ep} must divide dp*cp={self.dp}*{self.cp}={self.dp * self.cp} "
                    "(expert parallelism is carved out of the data/context-parallel ranks when etp = tp; "
                    "a smaller etp lets it span tensor-parallel ranks too)"
                )
            raise TopologyError(
                f"etp*ep={self.expert_tp}*{self.ep}={self.expert_tp * self.ep} must divide "
                f"tp*cp*dp={self.tp}*{self.cp}*{self.dp}={per_stage} (megatron-core's expert grid)"
            )
        if self.rank_order is not None:
            object.__setattr__(self, "rank_order", tuple(self.rank_order))
            if sorted(self.rank_order) != list(range(self.world_size)):
                raise TopologyError(
                    f"rank_order must be a permutation of 0..{self.world_size - 1} (tp*cp*dp*pp), "
                    f"got {self.rank_order}"
                )
            if self.ep > 1 or self.expert_tp != self.tp:
                raise TopologyError(f"rank_order is not supported with ep={self.ep} > 1 or etp={self.etp} != tp "
                                    "(expert groups)")
            if list(self.rank_order) == list(range(self.world_size)):
                object.__setattr__(self, "rank_order", None)  # the natural order has one spelling

    @property
    def world_size(self) -> int:
        """Number of ranks this role occupies."""
        return self.tp * self.cp * self.dp * self.pp

    @property
    def expert_tp(self) -> int:
        """Expert tensor-parallel size: `etp`, or `tp` when unset (megatron-core's default)."""
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """Expert data-parallel size: tp*cp*dp / (etp*ep) ranks per stage hold the same expert slice."""
        return self.tp * self.cp * self.dp // (self.expert_tp * self.ep)

    @property
    def ranks(self) -> range:
        """Global ranks of this role, in order."""
        return range(self.rank_offset, self.rank_offset + self.world_size)

    def sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}

    def coord(self, rank: int) -> RankCoord:
        """(tp, cp, dp, pp) coordinates of global `rank`."""
        if rank not in self.ranks:
            raise TopologyError(
                f"rank {rank} is outside this role's ranks {self.ranks.start}..{self.ranks.stop - 1}"
            )
        local = rank - self.rank_offset
        if self.rank_order is not None:
            local = self._natural_index_of[local]
        tp_rank = local % self.tp
        local //= self.tp
        cp_rank = local % self.cp
        local //= self.cp
        dp_rank = local % self.dp
        pp_rank = local // self.dp
        return RankCoord(rank=rank, tp=tp_rank, cp=cp_rank, dp=dp_rank, pp=pp_rank)

    def expert_coord(self, rank: int) -> ExpertCoord:
        """(etp, ep, edp, pp) coordinates of global `rank` in the expert grid (see the module docstring)."""
        c = self.coord(rank)
        s = c.tp + self.tp * (c.cp + self.cp * c.dp)  # position inside the pipeline stage, natural order
        etp = self.expert_tp
        return ExpertCoord(rank=rank, etp=s % etp, ep=(s // etp) % self.ep, edp=s // (etp * self.ep), pp=c.pp)

    def rank_of(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """Global rank at the given coordinates (inverse of `coord`)."""
        for name, value in (("tp", tp), ("cp", cp), ("dp", dp), ("pp", pp)):
            size = getattr(self, name)
            if not 0 <= value < size:
                raise TopologyError(f"{name} coordinate {value} is outside 0..{size - 1}")
        natural = tp + self.tp * (cp + self.cp * (dp + self.dp * pp))
        return self.rank_offset + (natural if self.rank_order is None else self.rank_order[natural])

    @functools.cached_property
    def _natural_index_of(self) -> tuple[int, ...]:
        """Inverse of `rank_order`: local rank -> natural coordinate index."""
        inverse = [0] * self.world_size
        for natural, local in enumerate(self.rank_order or range(self.world_size)):
            inverse[local] = natural
        return tuple(inverse)

    @property
    def natural_order(self) -> bool:
        return self.rank_order is None

    def coords(self) -> Iterator[RankCoord]:
        for rank in self.ranks:
            yield self.coord(rank)

    def groups(self, dims: tuple[str, ...] | str) -> list[list[int]]:
        """Rank lists of the groups spanning `dims` (every other coordinate fixed).

        `groups("tp")` gives the tensor-parallel groups, `groups(("tp", "pp"))` the model-parallel groups, and
        `groups(("dp", "cp"))` the groups that gradients are reduced over. Each list is in coordinate order along
        `dims` (fastest-varying first), which is the group rank order; in the natural order that is sorted. The
        order of the list of groups is deterministic, so every rank can create them in the same order.
        """
        if isinstance(dims, str):
            dims = (dims,)
        unknown = [d for d in dims if d not in DIMS]
        if unknown:
            raise TopologyError(f"unknown parallel dims {unknown}; valid: {list(DIMS)}")
        fixed = [d for d in DIMS if d not in dims]
        varying = [d for d in DIMS if d in dims]
        buckets: dict[tuple[int, ...], list[tuple[tuple[int, ...], int]]] = {}
        for c in self.coords():
            key = tuple(getattr(c, d) for d in fixed)
            buckets.setdefault(key, []).append((tuple(getattr(c, d) for d in varying[::-1]), c.rank))
        return [[r for _, r in sorted(v)] for _, v in sorted(buckets.items(), key=lambda kv: kv[0][::-1])]

    def embedding_group(self, pp_group: list[int]) -> list[int]:
        """Ranks sharing tied word embeddings in one pipeline group: first and last stage."""
        return sorted({pp_group[0], pp_group[-1]})

    def describe(self) -> str:
        out = f"tp={self.tp} pp={self.pp} dp={self.dp} cp={self.cp}" + (f" ep={self.ep}" if self.ep > 1 else "")
        out += f" etp={self.etp}" if self.etp is not None else ""
        return out + (f" rank_order={list(self.rank_order)}" if self.rank_order is not None else "")


def layer_split(
    num_layers: int, pp: int, first_stage_layers: int | None = None, last_stage_layers: int | None = None
) -> list[int]:
    """Number of transformer layers on each pipeline stage.

    Even split unless `first_stage_layers` / `last_stage_layers` are given (megatron-core's uneven split:
    the remaining layers spread evenly over the middle stages). Raises `TopologyError` naming the numbers
    when the split is impossible.
    """
    if pp < 1:
        raise TopologyError(f"pp must be >= 1, got {pp}")
    if first_stage_layers is None and last_stage_layers is None:
        if num_layers % pp != 0:
            raise TopologyError(
                f"num_layers={num_layers} is not divisible by pp={pp}; choose a pp that divides it or set "
                "first_stage_layers / last_stage_layers for an uneven split"
            )
        return [num_layers // pp] * pp
    if pp == 1:
        raise TopologyError("first_stage_layers / last_stage_layers need pp > 1")
    first = first_stage_layers if first_stage_layers is not None else None
    last = last_stage_layers if last_stage_layers is not None else None
    middle_stages = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    if rest < 0 or (middle_stages == 0 and rest != 0) or (middle_stages > 0 and rest % middle_stages != 0):
        raise TopologyError(
            f"cannot split num_layers={num_layers} over pp={pp} with first_stage_layers={first_stage_layers}, "
            f"last_stage_layers={last_stage_layers}: the {rest} remaining layers do not divide evenly over "
            f"{middle_stages} middle stage(s)"
        )
    per_middle = rest // middle_stages if middle_stages else 0
    split = [per_middle] * pp
    if first is not None:
        split[0] = first
    if last is not None:
        split[-1] = last
    return split
