"""Build a role from a validated job config: the configured layout, model and weights, on this rank.

`model.path` (an HF directory) is loaded directly at the configured TP/PP: each rank reads only the slices of the
safetensors tensors its own shards need, with no offline conversion step. An inline `model.arch` builds a
randomly initialised model (seeded by `trainer.seed`; with pp=1 the initial weights do not depend on TP or DP).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megarl.config.arch import spec_from_arch
from megarl.config.placement import role_topology
from megarl.config.schema import JobConfig, ModelConfig
from megarl.engine.lora import LoraSettings
from megarl.engine.moe import MoeSettings
from megarl.models.spec import ModelSpec
from megarl.parallel.groups import RoleGroups, build_role_groups
from megarl.parallel.topology import RoleTopology
from megarl.reshard.rank_order import resolve_rank_order
from megarl.roles.actor import Actor, PolicyLossSettings, Reference
from megarl.roles.base import BatchingSettings, Role, optimizer_settings_from_config
from megarl.roles.critic import Critic, RewardModel

ROLE_CLASSES = {"actor": Actor, "reference": Reference, "critic": Critic, "reward_model": RewardModel}


def spec_from_model_config(model: ModelConfig) -> ModelSpec:
    """`ModelSpec` of a model config: from `path`'s config.json, or from the inline `arch` block."""
    if model.path is not None:
        return ModelSpec.from_hf_dir(model.path)
    return spec_from_arch(model.arch)


def role_model_config(cfg: JobConfig, role: str) -> ModelConfig:
    """The model a role runs: its own `model` block (critic, reward model) or the top-level one."""
    own = getattr(cfg.role(role), "model", None)
    return own if own is not None else cfg.model


def actor_topology_in_order(cfg: JobConfig, topo: RoleTopology) -> RoleTopology:
    """The actor's `topo` in `actor.parallel.rank_order`'s order: natural, or co-designed with rollout.tp's engine
    blocks (`megarl.reshard.rank_order`; TP groups kept inside a node of the pool's devices_per_node)."""
    mode = cfg.actor.parallel.rank_order
    if mode == "natural":
        return topo
    spec = spec_from_model_config(role_model_config(cfg, "actor"))
    per_node = cfg.resources.pools[cfg.actor.pool].devices_per_node
    return resolve_rank_order(mode, spec, topo, cfg.rollout.tp, devices_per_node=per_node)


def build_role(cfg: JobConfig, role: str, groups: Optional[RoleGroups] = None,
               rank_offset: Optional[int] = None) -> Optional[Role]:
    """Build `role` ('actor', 'reference', 'critic', 'reward_model') of `cfg` on this rank.

    Collective over the world when `groups` is None (the role's process groups are created here). `rank_offset`
    is the role's first rank in this torch.distributed world: the pool's offset in the job-wide rank table by
    default, 0 when each pool is its own world (the Ray trainer). Returns None on ranks outside the role. Trained
    roles get their optimizer (LR schedule over `trainer.total_steps` x `algorithm.ppo_epochs` x mini-batches per
    step), batching from the role's micro/mini-batch keys, and the actor its loss from `algorithm`.
    """
    if role not in ROLE_CLASSES:
        raise ValueError(f"unknown role {role!r}; roles: {', '.join(ROLE_CLASSES)}")
    role_cfg = cfg.role(role)
    if groups is None:
        topo = role_topology(cfg, role)
        if rank_offset is not None:
            topo = dataclasses.replace(topo, rank_offset=rank_offset)
        if role == "actor":
            topo = actor_topology_in_order(cfg, topo)
        groups = build_role_groups(topo)
    if not groups.is_member:
        return None
    model = role_model_config(cfg, role)
    spec = spec_from_model_config(model)
    dtype = model.dtype
    samples_per_prompt = cfg.rollout.samples_per_prompt
    epochs = cfg.algorithm.ppo_epochs if role in ("actor", "critic") else 1
    kwargs = dict(
        batching=BatchingSettings.from_config(role_cfg, samples_per_prompt=samples_per_prompt, epochs=epochs),
        dtype=dtype, seed=cfg.trainer.seed, hf_dir=model.path,
        first_stage_layers=role_cfg.parallel.first_stage_layers, last_stage_layers=role_cfg.parallel.last_stage_layers,
        vpp=role_cfg.parallel.vpp,
    )
    if role in ("actor", "critic"):
        mini = getattr(role_cfg, "mini_batch_prompts", None) or cfg.data.prompts_per_step
        steps_per_rl_step = epochs * max(1, cfg.data.prompts_per_step // mini)
        kwargs["optimizer"] = optimizer_settings_from_config(
            role_cfg.optimizer, total_steps=cfg.trainer.total_steps * steps_per_rl_step
        )
        kwargs["moe"] = MoeSettings(aux_loss_coeff=role_cfg.moe.aux_loss_coeff, z_loss_coeff=role_cfg.moe.z_loss_coeff,
                                    token_dispatcher=role_cfg.moe.token_dispatcher)
    if role == "actor":
        kwargs["loss"] = PolicyLossSettings.from_config(cfg.algorithm, max_new_tokens=cfg.rollout.max_new_tokens)
        if cfg.distillation.enabled and cfg.distillation.top_k:  # the top-k forward KL to the teachers
            kwargs["loss"] = dataclasses.replace(kwargs["loss"], top_k_kl_coef=cfg.distillation.top_k_coef)
        kwargs["router_replay"] = cfg.algorithm.router_replay
        if cfg.actor.lora is not None:
            lora = cfg.actor.lora
            kwargs["lora"] = LoraSettings(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                                          targets=tuple(lora.targets))
    if role == "critic":
        kwargs["value_clip"] = role_cfg.value_clip
        kwargs["agg"] = cfg.algorithm.setting("loss_agg")
    return ROLE_CLASSES[role](spec, groups, **kwargs)
