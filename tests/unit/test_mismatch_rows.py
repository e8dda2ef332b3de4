"""The mismatch metrics computed on the actor's ranks (issue 30, item 1, part 2): each DP rank turns its share of the
old log-prob forward into [b] rows (`mismatch_rows`), the controller adds them up (`mismatch_from_forward`); the
values equal the controller-side formula used before (`_mismatch_on_the_controller` below, the former
`RLLoop._mismatch` verbatim) on the same tensors."""

import pytest
import torch

from megarl.algorithms.rollout_correction import MISMATCH_ROWS, mismatch_metrics, mismatch_rows
from megarl.trainer.rl_trainer import mismatch_from_forward


def _mismatch_on_the_controller(t: dict, c: float, trained_version: int) -> dict[str, float]:
    """The former `RLLoop._mismatch` (old log-probs fetched to the controller), on the whole batch's tensors."""
    m = mismatch_metrics(t["old_log_probs"], t["rollout_log_probs"], t["loss_mask"], c=c)
    out = {f"mismatch/{k}": float(v) for k, v in m.items()}
    mask = t["loss_mask"].bool()
    versions = t["policy_version"][mask].unique().tolist()
    if len(versions) > 1:
        for v in versions:
            part = (t["loss_mask"].bool() & (t["policy_version"] == v)).to(t["loss_mask"].dtype)
            lag = mismatch_metrics(t["old_log_probs"], t["rollout_log_probs"], part, c=c)
            out.update({f"mismatch/lag{trained_version - int(v)}/{k}": float(x) for k, x in lag.items()})
    return out


def _batch(versions: list[int], rows: int = 12, seq: int = 10) -> dict:
    g = torch.Generator().manual_seed(3)
    mask = (torch.rand(rows, seq, generator=g) > 0.3).long()
    mask[5] = 0  # a row without response tokens
    rollout = -torch.rand(rows, seq, generator=g) * 3
    old = rollout + torch.randn(rows, seq, generator=g) * 0.6  # some tokens and rows outside the band
    version = torch.tensor(versions)[torch.randint(len(versions), (rows, seq), generator=g)]
    return {"old_log_probs": old, "rollout_log_probs": rollout, "loss_mask": mask, "policy_version": version}


@pytest.mark.parametrize("versions,shares", [([4], [(0, 12)]), ([4], [(0, 5), (5, 12)]),
                                             ([2, 3, 4], [(0, 3), (3, 6), (6, 9), (9, 12)])])
def test_rows_summed_over_shares_equal_the_controller_formula(versions, shares):
    t, c, trained = _batch(versions), 1.5, 4
    want = _mismatch_on_the_controller(t, c, trained)
    mixed = _versions_of(t)
    parts = [mismatch_rows(t["old_log_probs"][lo:hi], t["rollout_log_probs"][lo:hi], t["loss_mask"][lo:hi], c,
                           t["policy_version"][lo:hi] if len(mixed) > 1 else None,
                           mixed if len(mixed) > 1 else None) for lo, hi in shares]
    rows = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    assert all(v.shape == (12,) for v in rows.values())  # only [B] numbers come up
    got = mismatch_from_forward(rows, trained, mixed if len(mixed) > 1 else [])
    assert sorted(got) == sorted(want)
    if len(versions) > 1:
        assert {"mismatch/lag0/kl", "mismatch/lag2/kl"} <= set(got)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, rel=1e-6, abs=1e-7), k
    assert 0 < want["mismatch/ratio_out_frac"] < 1 and 0 < want["mismatch/seq_ratio_out_frac"] < 1  # not vacuous


def _versions_of(t: dict) -> list[int]:
    return [int(v) for v in t["policy_version"][t["loss_mask"].bool()].unique().tolist()]


def test_versions_need_the_policy_version():
    t = _batch([1, 2])
    with pytest.raises(ValueError, match="versions need the batch's policy_version"):
        mismatch_rows(t["old_log_probs"], t["rollout_log_probs"], t["loss_mask"], 2.0, None, [1, 2])
    rows = mismatch_rows(t["old_log_probs"], t["rollout_log_probs"], t["loss_mask"], 2.0)
    assert sorted(rows) == sorted(MISMATCH_ROWS + k for k in ("abs_diff_sum", "kl_sum", "kl_k1_sum", "ratio_out_count",
                                                              "tokens", "seq_ratio_out_count", "sequences",
                                                              "abs_diff_max"))
