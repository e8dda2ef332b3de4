"""GAE on the critic's ranks (`gae_on_share`): each DP share's advantages and returns are the controller's
`gae(scores_to_token_rewards(...), ...)` over the whole batch, bit for bit, for any cut of the batch into shares.

The reference is the controller-side function itself (`megarl.algorithms.advantages.gae`, what `RLLoop._advantages`
runs), on the whole batch; the shares' all-gather is a list of the other shares' tuples, as
`torch.distributed.all_gather_object` returns them (in any order)."""

import pytest
import torch

from megarl.algorithms.advantages import gae, gae_on_share, scores_to_token_rewards
from megarl.controller.dispatch import chunk_bounds


def _batch(rows: int, seq: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, seq // 2, (rows,), generator=g)
    total = torch.minimum(prompt + torch.randint(1, seq, (rows,), generator=g), torch.tensor(seq))
    pos = torch.arange(seq)
    mask = ((pos >= prompt[:, None]) & (pos < total[:, None])).long()
    mask[0, prompt[0] + 1] = 0  # a gap inside one row (multi-turn): GAE bootstraps through it
    scores = torch.randn(rows, generator=g)
    values = torch.randn(rows, seq, generator=g) * 3
    return scores, values, mask


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_every_share_is_the_controllers_rows_bit_for_bit(dp):
    rows, seq, gamma, lam = 13, 24, 0.99, 0.95
    scores, values, mask = _batch(rows, seq, seed=dp)
    want_adv, want_ret = gae(scores_to_token_rewards(scores, mask), values, mask, gamma, lam)
    bounds = [chunk_bounds(rows, dp, k) for k in range(dp)]
    # what each rank contributes to the all-gather, computed by that rank's own call (first pass: recorded, then stop)
    contributions = [_contribution(scores, values, mask, gamma, lam, b) for b in bounds]

    def share(k):
        lo, hi = bounds[k]
        gather = (lambda mine: [*reversed(contributions)]) if dp > 1 else None  # every rank's, in another order
        return gae_on_share(scores[lo:hi], values[lo:hi], mask[lo:hi], gamma, lam, (lo, hi), gather=gather)

    for k, (lo, hi) in enumerate(bounds):
        adv, ret = share(k)
        assert adv.dtype == torch.float32 and ret.dtype == torch.float32
        # bit for bit, signed zeros included
        assert torch.equal(adv.view(torch.int32), want_adv[lo:hi].view(torch.int32)), (dp, k)
        assert torch.equal(ret.view(torch.int32), want_ret[lo:hi].view(torch.int32)), (dp, k)


class _Stop(Exception):
    pass


def _contribution(scores, values, mask, gamma, lam, bounds):
    lo, hi = bounds
    seen = []

    def gather(mine):
        seen.append(mine)
        raise _Stop

    with pytest.raises(_Stop):
        gae_on_share(scores[lo:hi], values[lo:hi], mask[lo:hi], gamma, lam, (lo, hi), gather=gather)
    return seen[0]


def test_a_sum_of_share_statistics_would_not_be_bit_identical_but_this_is():
    """Why the shares are gathered and whitened as one tensor: the whitened advantages from per-share sums (a
    reduction of partial sums) differ in the last bits from the controller's on this batch, so a test of the
    gathered path against the controller's can fail."""
    rows, seq = 64, 200
    scores, values, mask = _batch(rows, seq, seed=7)
    want, _ = gae(scores_to_token_rewards(scores, mask), values, mask, 1.0, 0.95)
    from megarl.algorithms.advantages import gae_unwhitened
    raw, _ = gae_unwhitened(scores_to_token_rewards(scores, mask), values, mask, 1.0, 0.95)
    m = mask.bool()
    parts = [(torch.where(m[i:i + 16], raw[i:i + 16], 0).sum(), m[i:i + 16].sum()) for i in range(0, rows, 16)]
    mean = sum(p[0] for p in parts) / sum(p[1] for p in parts)
    sq = sum(torch.where(m[i:i + 16], (raw[i:i + 16] - mean) ** 2, 0).sum() for i in range(0, rows, 16))
    by_parts = torch.where(m, (raw - mean) * torch.rsqrt(sq / (m.sum() - 1) + 1e-8), 0)
    assert not torch.equal(by_parts, want)


def test_shares_that_do_not_tile_the_batch_are_refused():
    scores, values, mask = _batch(8, 10, seed=1)
    with pytest.raises(ValueError, match="tile the batch"):
        gae_on_share(scores[:4], values[:4], mask[:4], 1.0, 1.0, (0, 4),
                     gather=lambda mine: [mine, (5, mine[1], mine[2])])
    with pytest.raises(ValueError, match=r"rows \[0, 4\)"):
        gae_on_share(scores[:3], values[:4], mask[:4], 1.0, 1.0, (0, 4))
