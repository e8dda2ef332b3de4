"""Teachers of on-policy distillation (`distillation.teachers`): frozen Megatron forward-only roles, built like the
reference (`megarl.roles.actor.Reference`) but each from its own checkpoint, that compute the log-probs of the
student's sampled tokens. (A teacher with `backend: vllm` is served on engines instead:
`megarl.workers.teacher_host`, `megarl.rollout.teacher_engine`.)

A teacher's `path` is an HF directory (weights loaded directly at the teacher's layout) or a megarl Megatron
distributed checkpoint (a run's `step_NNNNNN/actor`: weights loaded with `load_engine_checkpoint`, its HF config and
tokenizer files read from the checkpoint's metadata and `hf_assets/`). The student's tokenizer and every teacher's
must be the same (`megarl.data.tokenizer_match.check_teacher_tokenizers`, on the controller at start-up).

Placement (`pool`): null = the actor's pool (built by the actor pool's workers, offloaded per `offload` while idle);
another pool = the teachers' own (a `megarl.workers.role_host.TeacherWorker` group there, a world of its own). The
teachers of one pool share one layout (validated); teachers on different pools may differ.
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


def teacher_pool(cfg: JobConfig, t: TeacherConfig) -> str:
    """The resource pool teacher `t` runs on: its `pool`, or the actor's (colocated) when null."""
    return t.pool if t.pool is not None else cfg.actor.pool


def teacher_pools(cfg: JobConfig) -> dict[str, list[str]]:
    """pool -> the enabled Megatron teachers (backend megatron) placed on it, in config order (validated: the
    teachers of one pool share one layout, so one DP split of the batch serves them all there)."""
    pools: dict[str, list[str]] = {}
    for name in enabled_teachers(cfg):
        t = cfg.distillation.teachers[name]
        if t.backend == "megatron":
            pools.setdefault(teacher_pool(cfg, t), []).append(name)
    return pools


def engine_teachers(cfg: JobConfig) -> list[str]:
    """Names of the enabled vLLM-served teachers (backend vllm; each on a pool of its own, validated)."""
    return [name for name in enabled_teachers(cfg) if cfg.distillation.teachers[name].backend == "vllm"]
