"""DAPO's dynamic sampling (Yu et al. 2025, "DAPO", section 3.2): which sampled groups a step trains on.

A group (one prompt's `samples_per_prompt` responses) whose scores are all equal has advantage 0 everywhere under a
group baseline (GRPO, RLOO, REINFORCE++-baseline): it contributes no gradient, only dilutes the batch. The trainer
drops such groups and generates more prompts, round after round, until the step holds `target` informative groups
or `max_rounds` rounds ran; if still short, the first all-equal groups fill the batch (so the batch keeps its size
and the mini-batch / DP splits still divide), and are counted.

Pure functions over plain lists; `megarl.trainer.rl_trainer.RLLoop` runs the rounds.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch


def informative_groups(scores: torch.Tensor, group_ids: torch.Tensor, num_groups: int) -> list[bool]:
    """For each group 0..num_groups-1: whether its samples' scores differ (max > min).

    `scores` [B] float (the final scores the advantages are computed from), `group_ids` [B] int64 in
    [0, num_groups). A group with no sample (its prompt was dropped before generation) or a single sample is not
    informative."""
    out = []
    for g in range(num_groups):
        s = scores[group_ids == g]
        out.append(bool(s.numel() > 1 and (s.max() > s.min()).item()))
    return out


@dataclasses.dataclass(frozen=True)
class GroupSelection:
    """The groups a step trains on, as (round, prompt index within that round) pairs in training order (informative
    groups in generation order, then the fill), and what happened to the rest (counts of groups)."""

    selected: list[tuple[int, int]]
    filled: int  # all-equal groups kept because the rounds ran out (max_rounds)
    dropped: int  # all-equal groups discarded
    surplus: int  # informative groups generated beyond the target, discarded


def select_groups(rounds: Sequence[Sequence[bool | None]], target: int) -> GroupSelection:
    """Choose `target` groups from the rounds generated so far.

    `rounds[r][p]`: whether prompt p of round r gave an informative group (True), an all-equal one (False), or none
    at all (None: the prompt was dropped before generation; never selected). The first `target` informative groups
    in (round, prompt) order are taken; when there are fewer, the earliest all-equal groups fill the rest (fewer than
    `target` in all only if not enough groups exist)."""
    informative = [(r, p) for r, flags in enumerate(rounds) for p, f in enumerate(flags) if f is True]
    equal = [(r, p) for r, flags in enumerate(rounds) for p, f in enumerate(flags) if f is False]
    taken = informative[:target]
    fill = equal[: max(0, target - len(taken))]
    return GroupSelection(selected=taken + fill, filled=len(fill), dropped=len(equal) - len(fill),
                          surplus=len(informative) - len(taken))


def enough_groups(rounds: Sequence[Sequence[bool | None]], target: int) -> bool:
    """Whether the rounds so far hold `target` informative groups (no further round needed)."""
    return sum(f is True for flags in rounds for f in flags) >= target
