"""The worker-to-worker halves of results kept on the ranks, on 3 gloo ranks (plain torch.distributed, no Megatron:
the collectives are the whole of what is tested): `exchange_rows` gives every rank exactly its update share's rows of
a result whose rows the ranks kept as DP_SPLIT shares (expected: `share_layout`'s rows of the whole tensor), and
`gae_on_share` with `all_gather_objects` gives every rank its rows of the controller's `gae` over the whole batch, bit
for bit (what `RoleHost.compute_values(gae=)` runs with several critic DP ranks).

One spawn of 3 processes (~5 s) for both: the real runs that cover these paths (PPO with DP2 and 2 mini-batches)
take over a minute."""

import torch

from megarl.platform.spawn import run_ranks

ROWS, SEQ, MINI = 36, 7, 12  # 3 mini-batches over DP3: 2 of each rank's 3 update pieces are its peers' rows


def _whole():
    g = torch.Generator().manual_seed(3)
    values = torch.randn(ROWS, SEQ, generator=g)
    mask = (torch.rand(ROWS, SEQ, generator=g) < 0.7).long()
    scores = torch.randn(ROWS, generator=g)
    return values, mask, scores


def _worker(rank, world_size):
    import torch.distributed as dist

    from megarl.algorithms.advantages import gae_on_share
    from megarl.controller.dispatch import chunk_bounds
    from megarl.data.mini_batches import share_layout
    from megarl.workers.kept_rows import all_gather_objects, exchange_rows

    values, mask, scores = _whole()
    group = dist.new_group(list(range(world_size)))
    lo, hi = chunk_bounds(ROWS, world_size, rank)
    rows = share_layout(ROWS, MINI, world_size, rank).rows
    exchanged = exchange_rows(values[lo:hi].clone(), (lo, hi), rows, group)
    adv, ret = gae_on_share(scores[lo:hi], values[lo:hi], mask[lo:hi], 0.99, 0.95, (lo, hi),
                            gather=lambda mine: all_gather_objects(mine, group))
    return {"rows": rows, "bounds": (lo, hi), "exchanged": exchanged, "adv": adv, "ret": ret}


def test_exchange_and_gae_gather_on_gloo_ranks():
    from megarl.algorithms.advantages import gae, scores_to_token_rewards

    values, mask, scores = _whole()
    want_adv, want_ret = gae(scores_to_token_rewards(scores, mask), values, mask, 0.99, 0.95)
    for r in run_ranks(3, _worker, timeout_s=120):
        want = torch.cat([values[a:b] for a, b in r["rows"]])
        assert len(r["rows"]) == 3 and any(a < r["bounds"][0] or b > r["bounds"][1] for a, b in r["rows"])
        assert torch.equal(r["exchanged"], want)
        lo, hi = r["bounds"]
        assert torch.equal(r["adv"].view(torch.int32), want_adv[lo:hi].view(torch.int32))
        assert torch.equal(r["ret"].view(torch.int32), want_ret[lo:hi].view(torch.int32))
