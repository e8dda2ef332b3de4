"""On-policy distillation maths: the student samples, a teacher scores each sampled token.

The sampled-token reverse KL: for a token y_t the student sampled, KL(student || teacher) at that position is
estimated by log pi_student(y_t) - log pi_teacher(y_t) (its expectation under the student's sampling is the reverse
KL). Its negation, teacher log-prob minus student log-prob, is a per-token reward that is dense (every sampled token
gets one) and needs no baseline: used as the advantage of a policy-gradient loss, it pushes up the tokens the teacher
likes more than the student does (Agarwal et al. 2024, GKD; Thinking Machines' "On-policy distillation", 2025).

Tensors are [B, S] token-aligned with a 0/1 `mask` (the batch's loss mask: 1 on the tokens the student sampled).
"""

from __future__ import annotations

import torch


def reverse_kl_advantages(teacher_log_probs: torch.Tensor, student_log_probs: torch.Tensor, mask: torch.Tensor,
                          coef: float) -> torch.Tensor:
    """[B, S] float32: coef * (teacher_log_probs - student_log_probs) on the mask, 0 elsewhere.

    `teacher_log_probs`, `student_log_probs`: [B, S] log-probs (nats) of the sampled tokens, token-aligned (the
    student's are the old-policy log-probs the update's ratio starts from). No gradient flows through either."""
    if teacher_log_probs.shape != student_log_probs.shape or teacher_log_probs.shape != mask.shape:
        raise ValueError(f"teacher {tuple(teacher_log_probs.shape)}, student {tuple(student_log_probs.shape)} and "
                         f"mask {tuple(mask.shape)} log-probs must have one shape [B, S]")
    diff = teacher_log_probs.detach().float() - student_log_probs.detach().float()
    return coef * diff * mask.float()


def combine_advantages(distill: torch.Tensor, task: torch.Tensor, task_coef: float) -> torch.Tensor:
    """[B, S]: the distillation advantage plus task_coef * the task reward's advantage (both already masked)."""
    return distill + task_coef * task if task_coef else distill


def reverse_kl_mean(teacher_log_probs: torch.Tensor, student_log_probs: torch.Tensor, mask: torch.Tensor) -> float:
    """The sampled-token reverse KL (student log-prob - teacher log-prob), mean over the mask's tokens (nats per
    token); 0.0 for an empty mask."""
    m = mask.float()
    n = float(m.sum())
    if n == 0:
        return 0.0
    return float(((student_log_probs.float() - teacher_log_probs.float()) * m).sum()) / n


def rows_by_source(sources: list, teachers: dict) -> dict[str, torch.Tensor]:
    """Which rows each teacher scores: teacher name -> [B] bool, from each row's data source (`sources`, length B)
    and each teacher's `data_source` (`teachers`: name -> data source or None). A teacher with a data source takes
    the rows of that source; the one teacher without (if any) takes the rest. Raises on a row no teacher takes,
    naming its source and the teachers' sources."""
    claimed = {src: name for name, src in teachers.items() if src is not None}
    fallback = [name for name, src in teachers.items() if src is None]
    if len(fallback) > 1:
        raise ValueError(f"teachers {fallback} all leave data_source null; at most one teacher may take the samples "
                         "no other teacher claims")
    owners = []
    for i, src in enumerate(sources):
        owner = claimed.get(src, fallback[0] if fallback else None)
        if owner is None:
            raise ValueError(f"sample {i} has data source {src!r}, which no teacher scores (teachers' data sources: "
                             f"{sorted(claimed)}); give one teacher data_source: null to take the rest")
        owners.append(owner)
    return {name: torch.tensor([o == name for o in owners], dtype=torch.bool) for name in teachers}


# --------------------------------------------------------------------------------------------------- top-k forward KL
#
# The teacher's top-k distribution at each position (its k most likely next tokens and their log-probs, under the full
# softmax) and, on the student, sum_{j in top-k} p_T(j) * (log p_T(j) - log p_S(j)): the forward KL restricted to the
# teacher's top-k, *not renormalised*. It equals the forward KL KL(teacher || student) when the top-k holds all of the
# teacher's mass (k = V); otherwise the tail's terms are dropped. Its gradient in the student's logits is
# P_T(top-k) * p_S - p_T * 1[top-k]: it pulls the student's distribution toward the teacher's top-k distribution
# renormalised (the minimiser), each position weighted by the mass the top-k holds. Both tensors are computed
# vocab-parallel from each TP rank's logits shard: full-vocabulary logits are never gathered.


def vocab_parallel_top_k(logits_shard: torch.Tensor, k: int, tp_group, vocab_start: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k tokens of the full-vocabulary softmax from vocab-parallel logits (no gradient).

    Args:
        logits_shard: [..., V/tp] float, this TP rank's columns [vocab_start, vocab_start + V/tp) (equal shards).
        k: tokens kept per position, 1 <= k <= V.
        tp_group: the tensor-parallel group (None: the default group, or no process group = a group of one).
        vocab_start: first global vocabulary index of this rank's shard.
    Returns:
        (ids [..., k] int64 global token ids, log_probs [..., k] float32 nats), most likely first; identical on
        every TP rank. Collectives over `tp_group`: two all-reduces (max, sum of exp) and one all-gather of each
        rank's k candidates ([..., k] ids and log-probs).
    """
    import torch.distributed as dist

    from megarl.algorithms._vocab_parallel import all_reduce, shifted_logits

    with torch.no_grad():
        z = shifted_logits(logits_shard, tp_group)  # [..., Vl] float32, minus the global max
        lse = all_reduce(z.exp().sum(-1), dist.ReduceOp.SUM, tp_group).log()  # [...]
        shard = z.shape[-1]
        tp = dist.get_world_size(tp_group) if (tp_group is not None or dist.is_initialized()) else 1
        if not 1 <= k <= shard * tp:
            raise ValueError(f"top-k: k={k} must be in 1..{shard * tp} (the vocabulary size)")
        local_k = min(k, shard)
        vals, idx = z.topk(local_k, dim=-1)  # this shard's candidates: the global top-k is among them all
        logp = vals - lse.unsqueeze(-1)
        ids = idx + vocab_start
        if tp > 1:
            logp_parts = [torch.empty_like(logp) for _ in range(tp)]
            id_parts = [torch.empty_like(ids) for _ in range(tp)]
            dist.all_gather(logp_parts, logp.contiguous(), group=tp_group)
            dist.all_gather(id_parts, ids.contiguous(), group=tp_group)
            logp, ids = torch.cat(logp_parts, -1), torch.cat(id_parts, -1)
        top, pos = logp.topk(k, dim=-1)
        return ids.gather(-1, pos).long(), top


class _VocabParallelLogProbsOfIds(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_shard, ids, group, vocab_start):
        import torch.distributed as dist

        from megarl.algorithms._vocab_parallel import all_reduce, shifted_logits

        z = shifted_logits(logits_shard, group)  # [..., Vl] float32
        shard = z.shape[-1]
        local = ids.long() - vocab_start  # [..., k]
        in_shard = (local >= 0) & (local < shard)
        local = local.clamp(0, shard - 1)
        picked = torch.where(in_shard, z.gather(-1, local), 0.0)  # [..., k]: each id's logit on the rank holding it
        exp_z = z.exp_()
        stats = all_reduce(torch.cat([picked, exp_z.sum(-1, keepdim=True)], -1), dist.ReduceOp.SUM, group)
        picked, sum_exp = stats[..., :-1], stats[..., -1:]
        softmax = exp_z.div_(sum_exp)
        ctx.save_for_backward(softmax, local, in_shard)
        return picked - sum_exp.log()

    @staticmethod
    def backward(ctx, grad_out):
        softmax, local, in_shard = ctx.saved_tensors
        # d logp_j / d logit_v = 1[v == id_j] - softmax_v, summed over j with grad_out[..., j]
        grad = softmax * -grad_out.sum(-1, keepdim=True)
        grad.scatter_add_(-1, local, grad_out * in_shard)
        return grad, None, None, None


def vocab_parallel_log_probs_of_ids(logits_shard: torch.Tensor, ids: torch.Tensor, tp_group, vocab_start: int
                                    ) -> torch.Tensor:
    """Log-probs [..., k] float32 of the global token ids `ids` [..., k] (the same on every TP rank) under the
    full-vocabulary softmax of vocab-parallel logits `logits_shard` [..., V/tp]; differentiable in `logits_shard`
    (no communication in backward). Two all-reduces over `tp_group` (max; then the picked logits and the sum of exp,
    stacked); as `log_probs_from_logits` with k labels per position."""
    return _VocabParallelLogProbsOfIds.apply(logits_shard, ids, tp_group, vocab_start)


def top_k_forward_kl(teacher_top_k_log_probs: torch.Tensor, student_log_probs: torch.Tensor) -> torch.Tensor:
    """[...] sum_j p_T(j) * (log p_T(j) - log p_S(j)) over the teacher's top-k (not renormalised; see above).

    `teacher_top_k_log_probs` [..., k]: the teacher's log-probs of its top-k ids (constants); `student_log_probs`
    [..., k]: the student's log-probs of the same ids (differentiable). Nats per position."""
    t = teacher_top_k_log_probs.detach().float()
    return (t.exp() * (t - student_log_probs)).sum(-1)
