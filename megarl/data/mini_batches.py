"""Which rows of an update's batch each data-parallel rank trains on, mini-batch by mini-batch: the one rule the
controller's cut (`megarl.controller.dispatch.split_mini_batches`) and the roles' training loop
(`megarl.roles.base.Role._train`) both follow. Pure: sizes in, row ranges out.

The rule: the batch (B samples, in the controller's order) is cut into consecutive mini-batches of
`mini_batch_samples` (one optimizer step each; None = the whole batch is one mini-batch), and every mini-batch into
`dp` equal contiguous shares, DP rank k taking the k-th. Example, B = 8, mini-batches of 4, dp = 2:

    mini-batch 0: rows 0 1 | 2 3        DP rank 0 trains on rows 0 1, then 4 5
    mini-batch 1: rows 4 5 | 6 7        DP rank 1 trains on rows 2 3, then 6 7

A DP rank's *share of the update* is its rows of every mini-batch concatenated in mini-batch order ([0, 1, 4, 5] for
rank 0 above); `share_layout` gives it with `ShareLayout.local_bounds`, the mini-batches inside it. PPO epochs pass
over the same mini-batches again, in the same order.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

# `Batch.meta` key of a DP rank's share of an update: a `ShareLayout.to_meta()` dict
SHARE_META = "dp_mini_batch_share"


def plan_mini_batches(samples: int, mini_batch_samples: Optional[int], dp: int) -> list[list[tuple[int, int]]]:
    """[mini-batch][DP rank] -> [lo, hi) rows of the batch, mini-batches in training order.

    Raises ValueError (with the numbers) when `samples` is not a multiple of the mini-batch size or a mini-batch does
    not split evenly over `dp` ranks."""
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    size = mini_batch_samples or samples
    if size < 1 or samples % size != 0:
        raise ValueError(f"batch of {samples} samples is not a multiple of mini_batch_samples={size}")
    if size % dp != 0:
        raise ValueError(f"mini-batch of {size} samples does not split over dp={dp} data-parallel ranks")
    per = size // dp
    return [[(lo + k * per, lo + (k + 1) * per) for k in range(dp)] for lo in range(0, samples, size)]


@dataclasses.dataclass(frozen=True)
class ShareLayout:
    """DP rank `dp_rank`'s share of an update of `samples` rows (the rule in the module docstring).

    Attributes:
        samples: rows of the whole batch (all DP ranks).
        mini_batch_samples: rows per mini-batch, global (all DP ranks); the whole batch when it was None.
        dp, dp_rank: data-parallel size and this share's rank.
    """

    samples: int
    mini_batch_samples: int
    dp: int
    dp_rank: int

    @property
    def plan(self) -> list[list[tuple[int, int]]]:
        return plan_mini_batches(self.samples, self.mini_batch_samples, self.dp)

    @property
    def rows(self) -> list[tuple[int, int]]:
        """[lo, hi) rows of the whole batch in this share, in order (one range per mini-batch)."""
        return [mini[self.dp_rank] for mini in self.plan]

    @property
    def local_bounds(self) -> list[tuple[int, int]]:
        """[lo, hi) of each mini-batch's rows inside the share (the share being `rows` concatenated)."""
        out, at = [], 0
        for lo, hi in self.rows:
            out.append((at, at + hi - lo))
            at += hi - lo
        return out

    def __len__(self) -> int:
        return sum(hi - lo for lo, hi in self.rows)

    def to_meta(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_meta(cls, meta: dict) -> "ShareLayout":
        return cls(**{f.name: int(meta[f.name]) for f in dataclasses.fields(cls)})


def share_layout(samples: int, mini_batch_samples: Optional[int], dp: int, dp_rank: int) -> ShareLayout:
    """The layout of DP rank `dp_rank`'s share; validates the sizes (`plan_mini_batches`) and the rank."""
    if not 0 <= dp_rank < dp:
        raise ValueError(f"dp_rank={dp_rank} outside 0..{dp - 1}")
    plan_mini_batches(samples, mini_batch_samples, dp)
    return ShareLayout(samples, mini_batch_samples or samples, dp, dp_rank)
