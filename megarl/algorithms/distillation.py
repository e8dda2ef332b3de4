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
