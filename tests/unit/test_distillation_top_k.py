"""The top-k forward KL of on-policy distillation (`megarl.algorithms.distillation`): the teacher's vocab-parallel
top-k distribution, the student's vocab-parallel log-probs of those ids and the loss term with its gradient, each
against a dense single-process torch computation (torch.log_softmax / torch.topk / torch.nn.functional.kl_div and
autograd on the full vocabulary), without a process group and at TP2 over gloo (two processes, spawned once per
module: ~3 s). Logits are random with a wide spread so the top-k has no ties."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megarl.algorithms.distillation import top_k_forward_kl, vocab_parallel_log_probs_of_ids, vocab_parallel_top_k

VOCAB, WORLD = 10, 2
K = 7  # more than one shard's 5 columns: the global top-k takes candidates from both ranks


def _inputs():
    g = torch.Generator().manual_seed(5)
    student = torch.randn(2, 3, VOCAB, generator=g) * 3
    teacher = torch.randn(2, 3, VOCAB, generator=g) * 3
    weights = torch.rand(2, 3, generator=g)  # upstream gradient of each position's KL
    return student, teacher, weights


def _dense(student: torch.Tensor, teacher: torch.Tensor, weights: torch.Tensor, k: int) -> dict:
    """The dense reference: torch's log-softmax and topk on the full vocabulary, the loss by formula, autograd."""
    t_logp = torch.log_softmax(teacher, -1)
    top, ids = t_logp.topk(k, -1)
    x = student.clone().requires_grad_(True)
    s_logp = torch.log_softmax(x, -1).gather(-1, ids)
    kl = (top.exp() * (top - s_logp)).sum(-1)
    (kl * weights).sum().backward()
    return {"ids": ids, "top": top, "kl": kl.detach(), "grad": x.grad}


def _ours(student, teacher, weights, k, group=None, start=0, shard=VOCAB) -> dict:
    ids, top = vocab_parallel_top_k(teacher[..., start:start + shard], k, group, start)
    x = student[..., start:start + shard].clone().requires_grad_(True)
    kl = top_k_forward_kl(top, vocab_parallel_log_probs_of_ids(x, ids, group, start))
    (kl * weights).sum().backward()
    return {"ids": ids, "top": top, "kl": kl.detach(), "grad": x.grad}


def test_without_a_process_group_the_functions_equal_the_dense_computation():
    student, teacher, weights = _inputs()
    want, got = _dense(student, teacher, weights, K), _ours(student, teacher, weights, K)
    assert torch.equal(got["ids"], want["ids"])
    for key in ("top", "kl", "grad"):
        torch.testing.assert_close(got[key], want[key])


def test_with_the_whole_vocabulary_the_loss_is_the_forward_kl():
    """k = V: the sum over the top-k is the exact KL(teacher || student) (torch.nn.functional.kl_div)."""
    student, teacher, _ = _inputs()
    ids, top = vocab_parallel_top_k(teacher, VOCAB, None, 0)
    got = top_k_forward_kl(top, vocab_parallel_log_probs_of_ids(student, ids, None, 0))
    want = torch.nn.functional.kl_div(torch.log_softmax(student, -1), torch.log_softmax(teacher, -1),
                                      log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(got, want)
    assert (want > 0.1).all()


def test_the_loss_by_hand_and_its_minimiser():
    """Two tokens of the teacher's top-2: p_T = (0.5, 0.25), p_S = (0.25, 0.25) gives 0.5 ln 2 + 0; a student equal to
    the teacher gives 0 and zero gradient."""
    teacher = torch.log(torch.tensor([[0.5, 0.25]]))
    student = torch.log(torch.tensor([[0.25, 0.25]]))
    assert torch.isclose(top_k_forward_kl(teacher, student), torch.tensor([0.5 * torch.log(torch.tensor(2.0))])).all()
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]])).requires_grad_(True)
    ids, top = vocab_parallel_top_k(logits.detach(), 2, None, 0)
    kl = top_k_forward_kl(top, vocab_parallel_log_probs_of_ids(logits, ids, None, 0))
    kl.sum().backward()
    assert abs(float(kl.detach())) < 1e-6
    # not renormalised: the gradient is P_T(top-k) p_S - p_T 1[top-k] = 0.75 p - (0.5, 0.25, 0, 0), not 0
    torch.testing.assert_close(logits.grad, torch.tensor([[-0.125, -0.0625, 0.09375, 0.09375]]))


def test_k_beyond_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match=r"top-k: k=11 must be in 1..10"):
        vocab_parallel_top_k(torch.zeros(1, VOCAB), 11, None, 0)


def _worker(rank: int, tmpdir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmpdir}/rendezvous", rank=rank, world_size=WORLD)
    try:
        group = dist.new_group([0, 1])
        student, teacher, weights = _inputs()
        shard = VOCAB // WORLD
        out = {k: _ours(student, teacher, weights, k, group, rank * shard, shard) for k in (3, K)}
        torch.save(out, os.path.join(tmpdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp2_results(tmp_path_factory):
    tmpdir = str(tmp_path_factory.mktemp("top_k_tp2"))
    mp.spawn(_worker, args=(tmpdir,), nprocs=WORLD, join=True)
    return [torch.load(os.path.join(tmpdir, f"rank{r}.pt")) for r in range(WORLD)]


@pytest.mark.parametrize("k", [3, K])
def test_at_tp2_the_top_k_the_loss_and_its_gradient_equal_the_dense_computation(tp2_results, k):
    """Each TP rank holds half the vocabulary: both get the dense top-k (ids, log-probs) and loss; the shards'
    gradients, concatenated, are the dense gradient."""
    student, teacher, weights = _inputs()
    want = _dense(student, teacher, weights, k)
    for rank in tp2_results:
        assert torch.equal(rank[k]["ids"], want["ids"])
        torch.testing.assert_close(rank[k]["top"], want["top"])
        torch.testing.assert_close(rank[k]["kl"], want["kl"])
    torch.testing.assert_close(torch.cat([r[k]["grad"] for r in tp2_results], -1), want["grad"])
