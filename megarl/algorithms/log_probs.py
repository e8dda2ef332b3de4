"""Log-probabilities of given tokens from logits: full-vocabulary and vocab-parallel (tensor-parallel) versions."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from megarl.algorithms._vocab_parallel import all_reduce, shifted_logits


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[labels]`` without materialising the full log-softmax.

    Args: logits [..., V] float (any float dtype; computed in float32); labels [...] int64 token ids in [0, V).
    Returns: [...] float32, nats; differentiable in ``logits``.
    """
    logits = logits.float()
    target = logits.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    return target - torch.logsumexp(logits, dim=-1)


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_shard, labels, group, vocab_start, with_entropy=False):
        z = shifted_logits(logits_shard, group)  # [..., Vl] float32
        shard_size = z.shape[-1]
        local = labels.long() - vocab_start
        in_shard = (local >= 0) & (local < shard_size)
        local = local.clamp(0, shard_size - 1)
        target = torch.where(in_shard, z.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0)
        exp_z = z.exp() if with_entropy else z.exp_()  # z is our own float32 tensor: reuse its memory when it may go
        # one collective for every sum: [target logit (only one rank contributes), sum of exp(, sum of exp * z)]
        sums = [target, exp_z.sum(-1)] + ([(exp_z * z).sum(-1)] if with_entropy else [])
        stats = all_reduce(torch.stack(sums), dist.ReduceOp.SUM, group)
        target, sum_exp = stats[0], stats[1]
        softmax = exp_z.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, in_shard)
        log_sum_exp = sum_exp.log()
        log_probs = target - log_sum_exp
        if not with_entropy:
            return log_probs
        entropy = log_sum_exp - stats[2] / stats[1]  # as `entropy_from_vocab_parallel`: log sum exp(z) - E_p[z]
        ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_entropy=None):
        softmax, local, in_shard = ctx.saved_tensors
        # d logp / d logit_j = 1[j == label] - softmax_j ; only the rank holding the label adds the one-hot
        grad = softmax * -grad_out.unsqueeze(-1)  # out of place: backward may run again with retain_graph
        grad.scatter_add_(-1, local.unsqueeze(-1), (grad_out * in_shard).unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_log_probs(
    logits_shard: torch.Tensor, labels: torch.Tensor, tp_group: dist.ProcessGroup | None, vocab_start: int
) -> torch.Tensor:
    """Log-probs of ``labels`` from vocab-parallel logits, as ``log_probs_from_logits`` on the full vocabulary.

    Each TP rank holds ``logits_shard`` [..., V/tp], the columns ``[vocab_start, vocab_start + V/tp)``. Two
    all-reduces over ``tp_group`` (max; then [target logit, sum of exp] stacked), never the full logits.

    Args:
        logits_shard: [..., V/tp] float (computed in float32).
        labels: [...] int64 *global* token ids, the same on every TP rank.
        tp_group: the tensor-parallel group (``None``: default group; see ``_vocab_parallel``).
        vocab_start: first global vocabulary index of this rank's shard.
    Returns: [...] float32, nats, identical on every TP rank; differentiable in ``logits_shard`` (the backward
        needs no communication: each rank gets the gradient for its own columns). Memory: one [..., V/tp]
        float32 buffer (the softmax) is kept for backward.
    """
    return _VocabParallelLogProbs.apply(logits_shard, labels, tp_group, vocab_start)


def vocab_parallel_log_probs_and_entropy(
    logits_shard: torch.Tensor, labels: torch.Tensor, tp_group: dist.ProcessGroup | None, vocab_start: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``vocab_parallel_log_probs`` and, from the same pass, the entropy of each position's distribution as a
    constant (the update's entropy metric; the same values as ``entropy_from_vocab_parallel``, which a loss that
    differentiates the entropy uses instead): one max, one exp and one stacked all-reduce for both instead of two
    of each.

    Args: as ``vocab_parallel_log_probs``. Returns: (log_probs [...] float32 nats, differentiable in
        ``logits_shard``; entropy [...] float32 nats, not differentiable). Memory: one [..., V/tp] float32 buffer
        kept for backward (the softmax), one more transient (the shifted logits).
    """
    return _VocabParallelLogProbs.apply(logits_shard, labels, tp_group, vocab_start, True)
