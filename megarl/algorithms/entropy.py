"""Entropy of the token distribution from logits: full-vocabulary and vocab-parallel (tensor-parallel) versions.

``H = logsumexp(x) - sum_j softmax(x)_j x_j`` (nats). Logits must be finite (no -inf masking).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from megarl.algorithms._vocab_parallel import all_reduce, shifted_logits


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the last dim, numerically stable (max-shifted, via logsumexp).

    Args: logits [..., V] float (computed in float32). Returns: [...] float32, nats; differentiable.
    """
    # shift by the max first: lse(x) - E_p[x] cancels catastrophically in float32 when |x| is large (1000.69 - 1000)
    z = logits.float()
    z = z - z.detach().amax(dim=-1, keepdim=True)
    probs = torch.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - (probs * z).sum(-1)


class _VocabParallelEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_shard, group):
        z = shifted_logits(logits_shard, group)  # [..., Vl] float32, z = x - max
        exp_z = z.exp()
        # one collective for [sum exp(z), sum exp(z) * z]
        stats = all_reduce(torch.stack([exp_z.sum(-1), (exp_z * z).sum(-1)]), dist.ReduceOp.SUM, group)
        sum_exp, mean_z = stats[0], stats[1] / stats[0]  # mean_z = sum_j p_j z_j
        ctx.save_for_backward(z, sum_exp, mean_z)
        return sum_exp.log() - mean_z

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        z, sum_exp, mean_z = ctx.saved_tensors
        # dH/dx_j = -p_j (x_j - E_p[x]) ; shift-invariant, so z may stand in for x. No communication needed.
        probs = z.exp().div_(sum_exp.unsqueeze(-1))
        grad = probs.mul_(z - mean_z.unsqueeze(-1)).mul_(-grad_out.unsqueeze(-1))  # saved z left intact
        return grad, None


def entropy_from_vocab_parallel(logits_shard: torch.Tensor, tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    """Entropy from vocab-parallel logits, as ``entropy_from_logits`` on the full vocabulary.

    Each TP rank holds ``logits_shard`` [..., V/tp]. Two all-reduces over ``tp_group``: the max, then
    [sum of exp, sum of exp * logit] stacked; the full logits are never gathered.

    Args: logits_shard [..., V/tp] float (computed in float32); tp_group: the tensor-parallel group (``None``:
        default group; see ``_vocab_parallel``).
    Returns: [...] float32, nats, identical on every TP rank; differentiable in ``logits_shard`` (no
        communication in backward). Memory: one [..., V/tp] float32 buffer kept for backward.
    """
    return _VocabParallelEntropy.apply(logits_shard, tp_group)
