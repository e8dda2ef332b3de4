"""Pre-flight estimate of the static memory per GPU of a colocated hybrid worker (pure: no torch, no CUDA calls).

What one GPU of the actor's pool holds when vLLM starts (the actor is built first, `workers/hybrid.py`):

  actor params      N / (tp * pp) x dtype bytes               (bf16: 2 B; embedding/output split by TP, layers by PP)
  actor grads       N / (tp * pp) x 4 B                       (megatron DDP, grad_reduce_in_fp32=True: a full fp32
                                                               grad buffer per model-parallel shard, not DP-sharded)
  optimizer state   N / (tp * pp * dp) x 12 B                 (DistributedOptimizer: fp32 master + Adam m + v,
                                                               sharded over DP; with fp32 params the master copy
                                                               is the param itself: 8 B)
  reference params  N / (ref tp * ref pp) x dtype bytes       (forward-only roles on the actor's pool: reference,
                                                               reward model, each distillation teacher at its
                                                               own N, tp and pp; a teacher on a pool of its own
                                                               is counted there: `teacher_pool_memory`)
  vLLM              gpu_memory_utilization x device memory    (vLLM reserves this fraction of the *total* memory
                                                               for its weights and KV cache and refuses to start
                                                               when that much is not free)

The judge's pool (`reward.judge`, `judge_pool_memory`) holds only vLLM's share (rollout.gpu_memory_utilization x
device memory), of which the judge's weight shard: the size of its weight files / reward.judge.tp (the judge loads
in the dtype its files hold, `dtype="auto"`; any architecture vLLM serves, so no parameter count is derived).

With `actor.lora` (megarl.engine.lora) the base is frozen: actor params are N plus the adapters' n, grads and
optimizer state cover the n adapter parameters only (`lora_num_params`; adapters in the model's dtype, so bf16 ones
have an fp32 master copy), and no reference model is built (its log-probs come from the actor's base weights):
`lora_saved_bytes` is what this saves against full fine-tuning, shown by `describe`.

N = the HF parameter count (`ModelSpec.num_params`). Not counted: activations, the reshard bucket
(`rollout.reshard_bucket_mb`), CUDA context, allocator fragmentation; the numbers are a lower bound, an estimate.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from typing import Optional

from megarl.config.arch import spec_from_arch
from megarl.config.errors import ConfigError
from megarl.config.placement import device_kind
from megarl.config.validate import role_archs, teacher_arch

GB = 10**9
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GRAD_BYTES = 4  # grad_reduce_in_fp32=True (megarl/engine/megatron_engine.py)
ADAM_BYTES = 8  # exp_avg + exp_avg_sq, fp32


def _fmt(n: int) -> str:
    """Bytes as GB (10^9) or, below 1 GB, MB (10^6), right-aligned."""
    return f"{n / GB:9.2f} GB" if n >= GB else f"{n / 10**6:9.2f} MB"


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Static bytes per GPU, by part (see the module docstring). `rollout_bytes` is None when the device memory
    is unknown (vLLM's share is a fraction of it); `device_bytes` None = unknown (CPU, or no CUDA here)."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    other_roles_bytes: int
    gpu_memory_utilization: float
    device_bytes: Optional[int]
    lora_saved_bytes: int = 0  # with actor.lora: bytes full fine-tuning (and its reference model) would add

    @property
    def megatron_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.other_roles_bytes

    @property
    def rollout_bytes(self) -> Optional[int]:
        return None if self.device_bytes is None else int(self.gpu_memory_utilization * self.device_bytes)

    @property
    def total_bytes(self) -> Optional[int]:
        return None if self.device_bytes is None else self.megatron_bytes + self.rollout_bytes

    @property
    def fits(self) -> Optional[bool]:
        return None if self.device_bytes is None else self.total_bytes <= self.device_bytes

    def describe(self) -> str:
        """One line per part, in GB (10^9 bytes)."""
        lines = [
            f"actor params      {_fmt(self.params_bytes)}",
            f"actor grads fp32  {_fmt(self.grads_bytes)}",
            f"optimizer state   {_fmt(self.optimizer_bytes)}  (fp32 master + Adam m, v; sharded over DP)",
            f"other roles       {_fmt(self.other_roles_bytes)}  (forward-only roles on the actor's pool)",
        ]
        if self.lora_saved_bytes:
            lines.append(f"LoRA saves        {_fmt(self.lora_saved_bytes)}  (frozen base: grads and optimizer state of "
                         "the adapters only, no reference model)")
        if self.device_bytes is None:
            lines.append(f"vLLM              {self.gpu_memory_utilization:.2f} x device memory (device memory unknown)")
            lines.append(f"total             {_fmt(self.megatron_bytes)} + vLLM share  (estimate, per GPU)")
        else:
            lines.append(f"vLLM              {_fmt(self.rollout_bytes)}  "
                         f"({self.gpu_memory_utilization:.2f} x {self.device_bytes / GB:.2f} GB)")
            lines.append(f"total             {_fmt(self.total_bytes)} of {self.device_bytes / GB:.2f} GB "
                         f"(estimate, per GPU)")
        return "\n".join(lines)


def estimate_memory(num_params: int, *, dtype: str, tp: int, pp: int, dp: int, gpu_memory_utilization: float,
                    other_roles: tuple[tuple[int, str, int, int], ...] = (),
                    device_bytes: Optional[int] = None) -> MemoryEstimate:
    """Static per-GPU bytes of the actor (`num_params` HF parameters, `dtype`, layout tp/pp/dp) plus forward-only
    roles `other_roles` = ((num_params, dtype, tp, pp), ...) and vLLM's `gpu_memory_utilization` share of
    `device_bytes`."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    shard = num_params / (tp * pp)
    params = shard * DTYPE_BYTES[dtype]
    master = 0 if dtype == "fp32" else 4  # fp32 params are their own master copy
    optimizer = shard / dp * (master + ADAM_BYTES)
    others = sum(n / (t * p) * DTYPE_BYTES[d] for n, d, t, p in other_roles)
    return MemoryEstimate(int(params), int(shard * GRAD_BYTES), int(optimizer), int(others),
                          gpu_memory_utilization, device_bytes)


def lora_num_params(spec, rank: int, targets) -> int:
    """Adapter parameters of a dense `ModelSpec` with LoRA rank `rank` on `targets` (megarl.engine.lora.TARGETS):
    r * (in + out) per adapted linear per layer."""
    h, d = spec.hidden_size, spec.head_dim
    q, kv = spec.num_attention_heads * d, spec.num_query_groups * d
    ffn = spec.ffn_hidden_size
    sizes = {"qkv": (h, q + 2 * kv), "proj": (q, h), "fc1": (h, 2 * ffn), "fc2": (ffn, h)}
    return spec.num_layers * sum(rank * sum(sizes[t]) for t in targets)


def job_memory_estimate(cfg, device_bytes: Optional[int]) -> MemoryEstimate:
    """The estimate for a validated `JobConfig`: the actor, the forward-only roles (reference, reward model,
    distillation teachers) on the actor's pool, and vLLM. A critic on the actor's pool is counted like the actor
    (params + grads + optimizer)."""
    archs = role_archs(cfg)

    def n_params(arch) -> int:
        return spec_from_arch(arch).num_params

    a = cfg.actor.parallel
    lora = getattr(cfg.actor, "lora", None)
    others = []
    extra_trained = 0
    reference_bytes = 0
    for name in cfg.enabled_roles():
        role = cfg.role(name)
        if name == "actor" or role.pool != cfg.actor.pool:
            continue
        if name == "reference" and lora is not None:  # the actor's base weights with the adapters off
            p = role.parallel
            reference_bytes = int(n_params(archs[name]) / (p.tp * p.pp) * DTYPE_BYTES[cfg.model.dtype])
            continue
        model = getattr(role, "model", None) or cfg.model
        p = role.parallel
        if name == "critic":
            c = estimate_memory(n_params(archs[name]), dtype=model.dtype, tp=p.tp, pp=p.pp, dp=p.dp,
                                gpu_memory_utilization=0.0)
            extra_trained += c.megatron_bytes
        else:
            others.append((n_params(archs[name]), model.dtype, p.tp, p.pp))
    for name, t in cfg.distillation.teachers.items():  # the teachers colocated with the actor (`teacher_pool_memory`)
        if t.enabled and t.pool in (None, cfg.actor.pool):
            arch = teacher_arch(t.path, f"distillation.teachers.{name}")
            others.append((n_params(arch), cfg.model.dtype, t.parallel.tp, t.parallel.pp))
    # engines on a pool of their own (rollout.pool): the actor's pool keeps no vLLM share (`rollout_pool_memory`)
    share = cfg.rollout.gpu_memory_utilization if cfg.rollout.pool is None else 0.0
    est = estimate_memory(n_params(archs["actor"]), dtype=cfg.model.dtype, tp=a.tp, pp=a.pp, dp=a.dp,
                          gpu_memory_utilization=share, other_roles=tuple(others),
                          device_bytes=device_bytes)
    est = dataclasses.replace(est, other_roles_bytes=est.other_roles_bytes + extra_trained)
    if lora is None:
        return est
    n = lora_num_params(spec_from_arch(archs["actor"]), lora.rank, lora.targets)
    adapters = estimate_memory(n, dtype=cfg.model.dtype, tp=a.tp, pp=a.pp, dp=a.dp, gpu_memory_utilization=0.0)
    lora_est = dataclasses.replace(est, params_bytes=est.params_bytes + adapters.params_bytes,
                                   grads_bytes=adapters.grads_bytes, optimizer_bytes=adapters.optimizer_bytes)
    return dataclasses.replace(lora_est, lora_saved_bytes=est.megatron_bytes + reference_bytes -
                               lora_est.megatron_bytes)


def rollout_pool_memory(cfg, actor_estimate: MemoryEstimate) -> str:
    """'' when the engines share the actor's pool; else lines for `--dry-run`: the actor's pool without vLLM's share
    (above) and the rollout pool with it: vLLM's share of each device, of which the engine's weight shard (the model
    in its dtype / rollout.tp)."""
    if cfg.rollout.pool is None:
        return ""
    n = spec_from_arch(role_archs(cfg)["actor"]).num_params
    shard = int(n * DTYPE_BYTES[cfg.model.dtype] / cfg.rollout.tp)
    u, device = cfg.rollout.gpu_memory_utilization, actor_estimate.device_bytes
    share = (f"{u:.2f} x device memory (device memory unknown)" if device is None
             else f"{_fmt(int(u * device)).strip()} ({u:.2f} x {device / GB:.2f} GB)")
    return (f"\n(vLLM: none on the actor's pool; its engines run on pool {cfg.rollout.pool!r})"
            f"\n\n# memory per GPU of the rollout pool {cfg.rollout.pool!r}\n"
            f"vLLM              {share}\n"
            f"  of which weights {_fmt(shard)}  (the model in {cfg.model.dtype} / rollout.tp {cfg.rollout.tp})")


WEIGHT_FILE_PATTERNS = ("*.safetensors", "*.bin", "*.pt")


def weight_files_bytes(model_dir: str) -> Optional[int]:
    """Bytes of an HF directory's weight files (safetensors, else .bin / .pt); None when it holds none (a path not
    on this machine yet)."""
    for pattern in WEIGHT_FILE_PATTERNS:
        files = glob.glob(os.path.join(model_dir, pattern))
        if files:
            return sum(os.path.getsize(f) for f in files)
    return None


def judge_pool_memory(cfg, device_bytes: Optional[int]) -> str:
    """'' without reward.judge; else the `--dry-run` lines of the judge's pool: vLLM's share of each device
    (rollout.gpu_memory_utilization, the judge engines' too) and the judge's weight shard in it (its weight files /
    reward.judge.tp). Raises ConfigError when the device memory is known and the shard exceeds the share (vLLM would
    have no room for a KV cache)."""
    j = cfg.reward.judge
    if j is None:
        return ""
    weights = weight_files_bytes(j.model)
    u = cfg.rollout.gpu_memory_utilization
    share = (f"{u:.2f} x device memory (device memory unknown)" if device_bytes is None
             else f"{_fmt(int(u * device_bytes)).strip()} ({u:.2f} x {device_bytes / GB:.2f} GB)")
    if weights is None:
        shard_line = f"  of which weights unknown (no weight files in {j.model!r} on this machine)"
    else:
        shard = weights // j.tp
        shard_line = f"  of which weights {_fmt(shard)}  (the judge's weight files / reward.judge.tp {j.tp})"
        if device_bytes is not None and shard >= u * device_bytes:
            raise ConfigError(
                f"reward.judge: the judge's weights do not fit its engines' memory: {shard / GB:.2f} GB per device "
                f"(weight files of {j.model!r}, {weights / GB:.2f} GB, / reward.judge.tp {j.tp}) >= vLLM's share "
                f"{u * device_bytes / GB:.2f} GB (rollout.gpu_memory_utilization {u} x {device_bytes / GB:.2f} GB), "
                "leaving no KV cache; raise reward.judge.tp (the judge pool's devices per engine) or "
                "rollout.gpu_memory_utilization")
    return (f"\n\n# memory per GPU of the judge pool {j.pool!r} (reward.judge: vLLM only, never weight-synced)\n"
            f"vLLM              {share}\n{shard_line}")


def teacher_pool_memory(cfg, actor_estimate: MemoryEstimate) -> str:
    """'' when every teacher is colocated with the actor (or there are none); else lines for `--dry-run`: for each
    pool of teachers' own, per device, each teacher's weight shard there (its N / (tp * pp) in model.dtype) and their
    sum; the actor's pool (above) counts none of them."""
    pools: dict[str, list[str]] = {}
    for name, t in cfg.distillation.teachers.items():
        if t.enabled and t.pool not in (None, cfg.actor.pool):
            pools.setdefault(t.pool, []).append(name)
    out = []
    for pool, names in pools.items():
        lines, total = [], 0
        for name in names:
            t = cfg.distillation.teachers[name]
            n = spec_from_arch(teacher_arch(t.path, f"distillation.teachers.{name}")).num_params
            shard = int(n * DTYPE_BYTES[cfg.model.dtype] / (t.parallel.tp * t.parallel.pp))
            total += shard
            lines.append(f"teacher {name:<9} {_fmt(shard)}  (N={n / 1e6:,.1f}M in {cfg.model.dtype} / tp "
                         f"{t.parallel.tp} x pp {t.parallel.pp})")
            if t.backend == "vllm":
                u = cfg.rollout.gpu_memory_utilization
                lines.append(f"  vLLM engine: the weights above within its share of {u:.2f} x device memory "
                             "(weights + KV cache, rollout.gpu_memory_utilization)")
        device = actor_estimate.device_bytes
        of = "" if device is None else f" of {device / GB:.2f} GB"
        out.append(f"\n\n# memory per GPU of the teachers' pool {pool!r} (forward-only weights)\n"
                   + "\n".join(lines) + f"\ntotal             {_fmt(total)}{of}")
    return "".join(out)


def device_memory_bytes(cfg) -> Optional[int]:
    """Memory of one GPU of a `JobConfig`'s job: `resources.device_memory_gb`, else GPU 0's total memory when the
    job runs on CUDA and CUDA is present in this process; None otherwise (unknown: print the estimate, refuse
    nothing)."""
    if cfg.resources.device_memory_gb is not None:
        return int(cfg.resources.device_memory_gb * GB)
    if device_kind(cfg) != "cuda":
        return None
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def check_fits(est: MemoryEstimate) -> None:
    """Raise ConfigError with the numbers when the estimate exceeds the device memory (no-op when unknown)."""
    if est.fits is False:
        room = est.device_bytes - est.rollout_bytes
        raise ConfigError(
            f"the layout does not fit in GPU memory: estimated {est.total_bytes / GB:.2f} GB per GPU > "
            f"{est.device_bytes / GB:.2f} GB (Megatron roles {est.megatron_bytes / GB:.2f} GB: params "
            f"{est.params_bytes / GB:.2f} + grads {est.grads_bytes / GB:.2f} + optimizer "
            f"{est.optimizer_bytes / GB:.2f} + other roles {est.other_roles_bytes / GB:.2f}; vLLM "
            f"{est.rollout_bytes / GB:.2f} GB = rollout.gpu_memory_utilization {est.gpu_memory_utilization} x device; "
            f"{room / GB:.2f} GB left for Megatron). Raise actor.parallel.tp/pp or dp (shards the optimizer), "
            f"use more GPUs, or lower rollout.gpu_memory_utilization"
        )


def min_gpus(num_params: int, device_bytes: int, *, dtype: str = "bf16", gpu_memory_utilization: float = 0.5,
             reference: bool = True, max_gpus: int = 1024) -> Optional[int]:
    """Fewest GPUs (a power of two) on which some model-parallel layout tp*pp = n, dp = 1 fits by the estimate
    (for a fixed n, model parallelism divides all parts by n, while DP shards only the optimizer), with the
    reference on the same layout. None if none up to `max_gpus` fits."""
    n = 1
    while n <= max_gpus:
        others = ((num_params, dtype, n, 1),) if reference else ()
        est = estimate_memory(num_params, dtype=dtype, tp=n, pp=1, dp=1, gpu_memory_utilization=gpu_memory_utilization,
                              other_roles=others, device_bytes=device_bytes)
        if est.fits:
            return n
        n *= 2
    return None
