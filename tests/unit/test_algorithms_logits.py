"""Log-probs and entropy from logits: full vocabulary (hand-computed) and vocab-parallel over 2 gloo ranks.

The 2-rank check spawns its processes once per module (``vocab_parallel_results``) and compares the forward
values and the per-shard gradients of both vocab-parallel functions with the full-vocabulary versions.
"""

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megarl.algorithms import (
    entropy_from_logits,
    entropy_from_vocab_parallel,
    log_probs_from_logits,
    vocab_parallel_log_probs,
    vocab_parallel_log_probs_and_entropy,
)

VOCAB, WORLD = 10, 2


def test_log_probs_from_logits_hand_computed_and_stable():
    logits = torch.tensor([[0.0, math.log(3.0)], [1000.0, 0.0]])  # softmax row 0 = [0.25, 0.75]
    out = log_probs_from_logits(logits, torch.tensor([1, 1]))
    torch.testing.assert_close(out, torch.tensor([math.log(0.75), -1000.0]))
    assert log_probs_from_logits(logits.to(torch.bfloat16), torch.tensor([0, 0])).dtype == torch.float32


def test_entropy_from_logits_hand_computed_stable_and_differentiable():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -1e4, -1e4], [1000.0, 1000.0, 0.0, 0.0]])
    expected = [math.log(4.0), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), math.log(2.0)]
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor(expected))
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(0), requires_grad=True)
    entropy_from_logits(x).sum().backward()
    y = x.detach().clone().requires_grad_(True)
    torch.distributions.Categorical(logits=y).entropy().sum().backward()
    torch.testing.assert_close(x.grad, y.grad)


def test_vocab_parallel_functions_without_a_process_group_equal_full_vocab():
    assert not dist.is_initialized()
    logits = torch.randn(2, 3, VOCAB, generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, VOCAB, (2, 3), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(vocab_parallel_log_probs(logits, labels, None, 0), log_probs_from_logits(logits, labels))
    torch.testing.assert_close(entropy_from_vocab_parallel(logits, None), entropy_from_logits(logits))


def _inputs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, VOCAB, generator=g)
    logits[0, 0, 7] = 200.0  # the max lives on rank 1 only: exp(200 - local max) would overflow on rank 0
    logits[1, 2, 2] = -200.0
    labels = torch.tensor([[7, 0, 4], [5, 9, 2]])  # both shards, both edges of each shard
    w_lp = torch.randn(2, 3, generator=g)  # upstream gradients
    w_ent = torch.randn(2, 3, generator=g)
    return logits, labels, w_lp, w_ent


def _worker(rank: int, tmpdir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmpdir}/rendezvous", rank=rank, world_size=WORLD)
    try:
        group = dist.new_group([0, 1])
        solo = [dist.new_group([r]) for r in range(WORLD)][rank]  # a TP group of one rank (its collectives skipped)
        logits, labels, w_lp, w_ent = _inputs()
        shard = VOCAB // WORLD
        start = rank * shard
        x = logits[..., start : start + shard].clone().requires_grad_(True)
        lp = vocab_parallel_log_probs(x, labels, group, start)
        (lp * w_lp).sum().backward()
        lp_grad, x.grad = x.grad.clone(), None
        ent = entropy_from_vocab_parallel(x, group)
        (ent * w_ent).sum().backward(retain_graph=True)
        ent_grad = x.grad.clone()
        x.grad = None
        (ent * w_ent).sum().backward()  # a second backward through the same graph must give the same gradient
        out = {"lp": lp.detach(), "lp_grad": lp_grad, "ent": ent.detach(), "ent_grad": ent_grad, "ent_grad2": x.grad}
        # the fused pass: log-probs (differentiable) and the entropy as a constant, over the 2-rank group ...
        x = logits[..., start : start + shard].clone().requires_grad_(True)
        lp, ent = vocab_parallel_log_probs_and_entropy(x, labels, group, start)
        (lp * w_lp).sum().backward()
        out["fused"] = {"lp": lp.detach(), "lp_grad": x.grad, "ent": ent, "ent_requires_grad": ent.requires_grad}
        # ... and over a group of one rank holding the whole vocabulary
        x = logits.clone().requires_grad_(True)
        lp, ent = vocab_parallel_log_probs_and_entropy(x, labels, solo, 0)
        (lp * w_lp).sum().backward()
        out["solo"] = {"lp": lp.detach(), "lp_grad": x.grad, "ent": ent,
                       "lp_only": vocab_parallel_log_probs(logits, labels, solo, 0),
                       "ent_only": entropy_from_vocab_parallel(logits, solo)}
        torch.save(out, os.path.join(tmpdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def vocab_parallel_results(tmp_path_factory):
    tmpdir = str(tmp_path_factory.mktemp("vocab_parallel"))
    mp.spawn(_worker, args=(tmpdir,), nprocs=WORLD, join=True)
    return [torch.load(os.path.join(tmpdir, f"rank{r}.pt")) for r in range(WORLD)]


@pytest.fixture(scope="module")
def full_vocab_reference():
    logits, labels, w_lp, w_ent = _inputs()
    x = logits.clone().requires_grad_(True)
    lp = log_probs_from_logits(x, labels)
    (lp * w_lp).sum().backward()
    lp_grad, x.grad = x.grad.clone(), None
    ent = entropy_from_logits(x)
    (ent * w_ent).sum().backward()
    return {"lp": lp.detach(), "lp_grad": lp_grad, "ent": ent.detach(), "ent_grad": x.grad}


def test_vocab_parallel_log_probs_match_full_vocab(vocab_parallel_results, full_vocab_reference):
    ref = full_vocab_reference
    assert torch.isfinite(ref["lp"]).all()
    for result in vocab_parallel_results:  # identical on every TP rank
        torch.testing.assert_close(result["lp"], ref["lp"])
    grad = torch.cat([r["lp_grad"] for r in vocab_parallel_results], dim=-1)
    torch.testing.assert_close(grad, ref["lp_grad"])


def test_vocab_parallel_entropy_matches_full_vocab(vocab_parallel_results, full_vocab_reference):
    ref = full_vocab_reference
    for result in vocab_parallel_results:
        torch.testing.assert_close(result["ent"], ref["ent"])
    grad = torch.cat([r["ent_grad"] for r in vocab_parallel_results], dim=-1)
    torch.testing.assert_close(grad, ref["ent_grad"])
    grad2 = torch.cat([r["ent_grad2"] for r in vocab_parallel_results], dim=-1)
    torch.testing.assert_close(grad2, ref["ent_grad"])


def test_fused_log_probs_and_entropy_match_full_vocab(vocab_parallel_results, full_vocab_reference):
    """`vocab_parallel_log_probs_and_entropy` over 2 ranks and over a one-rank group: the full-vocabulary log-probs,
    their gradient and the entropy; the entropy a constant; over one rank the same bits as the two separate
    functions (the metric the update logs did not move)."""
    ref = full_vocab_reference
    for result in vocab_parallel_results:
        fused, solo = result["fused"], result["solo"]
        assert not fused["ent_requires_grad"]
        for got in (fused, solo):
            torch.testing.assert_close(got["lp"], ref["lp"])
            torch.testing.assert_close(got["ent"], ref["ent"])
        torch.testing.assert_close(solo["lp_grad"], ref["lp_grad"])
        assert torch.equal(solo["lp"], solo["lp_only"]) and torch.equal(solo["ent"], solo["ent_only"])
    grad = torch.cat([r["fused"]["lp_grad"] for r in vocab_parallel_results], dim=-1)
    torch.testing.assert_close(grad, ref["lp_grad"])
