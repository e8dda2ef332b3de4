"""Teachers of on-policy distillation (`distillation.teachers`): frozen Megatron forward-only roles, built like the
reference (`megarl.roles.actor.Reference`) but each from its own checkpoint, that compute the log-probs of the
student's sampled tokens.

A teacher's `path` is an HF directory (weights loaded directly at the teacher's layout) or a megarl Megatron
distributed checkpoint (a run's `step_NNNNNN/actor`: weights loaded with `load_engine_checkpoint`, its HF config and
tokenizer files read from the checkpoint's metadata and `hf_assets/`). The student's tokenizer and every teacher's
must be the same (`megarl.data.tokenizer_match.check_teacher_tokenizers`, on the controller at start-up).
"""

from __future__ import annotations

from megarl.config.schema import JobConfig, TeacherConfig
from megarl.config.validate import is_megatron_checkpoint


def teacher_spec(path: str):
    """The `ModelSpec` of a teacher checkpoint (HF config.json, or the config recorded in a Megatron checkpoint)."""
    from megarl.models.spec import ModelSpec

    if is_megatron_checkpoint(path):
        from megarl.checkpoint.dist_ckpt import read_meta

        return ModelSpec.from_hf_config(read_meta(path)["hf_config"])
    return ModelSpec.from_hf_dir(path)


def teacher_topology(t: TeacherConfig, rank_offset: int = 0):
    """The Megatron layout (`RoleTopology`) of a validated teacher config (dp resolved), from `rank_offset`."""
    from megarl.parallel.topology import RoleTopology

    p = t.parallel
    return RoleTopology(tp=p.tp, pp=p.pp, dp=p.dp, cp=p.cp, ep=p.ep, etp=p.etp, rank_offset=rank_offset)


def build_teacher(t: TeacherConfig, *, dtype: str, seed: int, samples_per_prompt: int = 1, rank_offset: int = 0):
    """The teacher of a validated teacher config `t` on this rank: a frozen `Reference` at the teacher's layout
    (from `rank_offset`) in `dtype` (the run's model.dtype), its weights from `t.path` (HF directory or megarl
    Megatron checkpoint). Collective over the torch.distributed world (its process groups are created here, and a
    Megatron checkpoint is read collectively). Returns None on ranks outside it."""
    from megarl.parallel.groups import build_role_groups
    from megarl.roles.actor import Reference
    from megarl.roles.base import BatchingSettings

    groups = build_role_groups(teacher_topology(t, rank_offset))
    megatron = is_megatron_checkpoint(t.path)
    role = None
    if groups.is_member:
        role = Reference(
            teacher_spec(t.path), groups,
            batching=BatchingSettings.from_config(t, samples_per_prompt=samples_per_prompt),
            dtype=dtype, seed=seed, hf_dir=None if megatron else t.path,
            first_stage_layers=t.parallel.first_stage_layers, last_stage_layers=t.parallel.last_stage_layers,
            vpp=t.parallel.vpp,
        )
    if megatron:
        from megarl.checkpoint.dist_ckpt import load_engine_checkpoint

        load_engine_checkpoint(None if role is None else role.engine, t.path, with_optimizer=False)
    return role


def enabled_teachers(cfg: JobConfig) -> list[str]:
    """Names of the enabled teachers, in config order."""
    return [name for name, t in cfg.distillation.teachers.items() if t.enabled]



