"""Whether two tokenizers are one: a distillation teacher must share the student's (`distillation.teachers`).

A teacher's log-prob of token id k is the student's token k's only if both vocabularies map k to the same string, so
a teacher whose tokenizer differs in size, in any id's token or in its special ids is refused at start-up
(`check_teacher_tokenizers`, run by the training session on the controller), naming both tokenizer paths and the
first difference.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from megarl.config.schema import JobConfig
from megarl.config.validate import is_megatron_checkpoint

# where a megarl Megatron checkpoint keeps its tokenizer and generation config (`megarl.checkpoint.dist_ckpt`)
CHECKPOINT_ASSETS = "hf_assets"


def teacher_tokenizer_dir(path: str) -> str:
    """Where a teacher checkpoint's tokenizer files are: the HF directory itself, or a megarl Megatron checkpoint's
    hf_assets/."""
    return os.path.join(path, CHECKPOINT_ASSETS) if is_megatron_checkpoint(path) else path


def tokenizer_difference(student: Any, teacher: Any) -> Optional[str]:
    """What differs between two HF tokenizers' vocabularies (sizes, added tokens included; else the first token id
    that maps to different strings), or None when they are the same."""
    sv, tv = student.get_vocab(), teacher.get_vocab()
    if len(sv) != len(tv):
        return f"vocabulary size {len(sv)} (student) vs {len(tv)} (teacher)"
    by_id_s = {i: tok for tok, i in sv.items()}
    by_id_t = {i: tok for tok, i in tv.items()}
    for i in sorted(set(by_id_s) | set(by_id_t)):
        if by_id_s.get(i) != by_id_t.get(i):
            return f"token id {i} is {by_id_s.get(i)!r} for the student but {by_id_t.get(i)!r} for the teacher"
    for special in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if getattr(student, special, None) != getattr(teacher, special, None):
            return (f"{special} {getattr(student, special, None)} (student) vs {getattr(teacher, special, None)} "
                    "(teacher)")
    return None


def check_teacher_tokenizers(cfg: JobConfig, student_tokenizer: Any) -> None:
    """Refuse (ValueError) a teacher whose tokenizer differs from the student's, naming the teacher, both tokenizer
    paths and what differs. `student_tokenizer`: the student's loaded HF tokenizer (the run's `PromptEncoder`'s)."""
    from transformers import AutoTokenizer

    student_path = cfg.model.tokenizer or cfg.model.path
    for name, t in cfg.distillation.teachers.items():
        if not t.enabled:
            continue
        where = teacher_tokenizer_dir(t.path)
        try:
            teacher = AutoTokenizer.from_pretrained(where)
        except (OSError, ValueError) as e:
            raise ValueError(f"distillation.teachers.{name}: cannot load the teacher's tokenizer from {where!r}: "
                             f"{e}") from None
        diff = tokenizer_difference(student_tokenizer, teacher)
        if diff is not None:
            raise ValueError(f"distillation.teachers.{name}: the teacher's tokenizer ({where}) differs from the "
                             f"student's ({student_path}): {diff}. On-policy distillation scores the student's token "
                             "ids with the teacher, so both must share one tokenizer")
