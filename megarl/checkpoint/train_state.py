"""Everything a trainable engine's next step depends on besides its weights: the distributed optimizer's state,
the LR scheduler, the step counter, and this process's random number generators.

Optimizer state goes through megatron-core's own `DistributedOptimizer.sharded_state_dict` in the
`fully_reshardable` form (megatron-core 0.16.1): every model parameter of global shape S gets `exp_avg` and
`exp_avg_sq` (and for bf16/fp16 weights `param`, the fp32 main copy; fp32 weights are their own main copy) tensors
of the same global shape S, fp32, keyed `optimizer.state.<kind>.<model key>` and sharded exactly like the parameter.
They therefore reshard across TP, PP and DP like the weights do. Each DP
rank all-gathers its DP group's optimizer shards when saving (peak extra host memory: 3 x 4 bytes x the rank's
model-parallel share of the parameters) and slices its own range back out when loading.

Why not the other megatron-core 0.16.1 forms:
  - `fully_sharded_model_space` (DP-sharded, no gather) builds ShardedTensors with `flattened_range`, and 0.16.1's
    `ShardedTensor.validate_metadata_integrity` raises "ShardedTensor.flattened_range is not supported." for any
    such tensor (`dist_checkpointing/mapping.py`), which that very method calls: it cannot save at all.
  - `dp_reshardable` stores the optimizer's flat gradient buckets (`...gbuf_idx_0.dtype_...bucket_idx_0.exp_avg`):
    a bucket's contents depend on the TP/PP layout, so it reloads only at the same TP x PP.

The non-tensor part (Adam's param groups with their step count, the grad scaler, the scheduler, the engine's step
counter) is identical on every rank of a role; `common_state` returns it and the checkpoint keeps one copy.
"""

from __future__ import annotations

import os
import random
from typing import Any, Optional

import numpy as np
import torch

SHARDING_TYPE = "fully_reshardable"
OPTIMIZER_KEY = "optimizer.state."  # prefix of the optimizer's ShardedTensor keys (megatron-core's)


def sub_optimizers(engine) -> list:
    """The `DistributedOptimizer`s of `engine` (megatron-core wraps them in a `ChainedOptimizer`: one per kind of
    parameter buffer; a dense model has one)."""
    return list(getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]))


def ensure_optimizer_state(engine) -> None:
    """Give Adam zero moments and step 0 where it has no state yet (a fresh engine that never stepped).

    megatron-core 0.16.1's `DistributedOptimizer.state_dict` (called by `sharded_state_dict`) asserts that every
    parameter's state carries one common `step`; a fresh torch Adam has no state at all."""
    for sub in sub_optimizers(engine):
        opt = sub.optimizer  # the torch Adam inside megatron's DistributedOptimizer
        for group in opt.param_groups:
            for p in group["params"]:
                state = opt.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p.data)
                    state["exp_avg_sq"] = torch.zeros_like(p.data)


def optimizer_sharded_state(engine, raw_model_sd: dict, is_loading: bool) -> dict:
    """megatron-core's sharded optimizer state, {sub-optimizer index: {param index: {"param"|"exp_avg"|"exp_avg_sq":
    ShardedTensor or factory}}}, for `raw_model_sd`, the module's own sharded state dict (its ShardedTensors' `data`
    must be the parameters themselves: that is how megatron matches optimizer state to parameters). Collective over
    the role's DP group (an all-gather of the optimizer shards when saving)."""
    ensure_optimizer_state(engine)
    out = {}
    for i, sub in enumerate(sub_optimizers(engine)):
        sd = sub.sharded_state_dict(
            raw_model_sd, is_loading=is_loading, metadata={"distrib_optim_sharding_type": SHARDING_TYPE}
        )
        if sd.get("param_state_sharding_type") != SHARDING_TYPE or sd.get("param_state") is None:
            raise RuntimeError(f"megatron-core returned no {SHARDING_TYPE} optimizer state: {sorted(sd)}")
        out[i] = sd["param_state"]
    return out


def common_state(engine) -> dict:
    """The role-wide, non-tensor state: per sub-optimizer its Adam param groups (lr, betas, eps, weight decay, step
    count) and grad scaler (fp16); the LR scheduler; `engine.steps` (optimizer steps taken). Plain Python data."""
    ensure_optimizer_state(engine)
    return {
        "optimizer": [sub.state_dict() for sub in sub_optimizers(engine)],
        "scheduler": engine.scheduler.state_dict(),
        "steps": int(engine.steps),
        "sharding_type": SHARDING_TYPE,
    }


def merge_common_states(states: list[Optional[dict]]) -> Optional[dict]:
    """One common state for the role from every rank's (None outside the role). Param groups are the union over
    ranks, by megatron's group identity (weight-decay and LR multipliers): a pipeline stage may lack a kind of
    parameter another stage has, and a rank loading at another layout must find its groups."""
    states = [s for s in states if s is not None]
    if not states:
        return None
    merged = dict(states[0])
    merged["optimizer"] = []
    for i, first in enumerate(states[0]["optimizer"]):
        groups: dict[tuple, dict] = {}
        for s in states:
            for g in s["optimizer"][i]["optimizer"]["param_groups"]:
                groups.setdefault(_group_id(g), g)
        param_groups = list(groups.values())
        merged["optimizer"].append({**first, "optimizer": {**first["optimizer"], "param_groups": param_groups}})
    return merged


def _group_id(group: dict) -> tuple:
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    return tuple(repr(group.get(k, group.get(f"pre_{k}"))) for k in param_group_identifier_keys)


def load_common_and_params(engine, common: dict, param_state: dict) -> None:
    """Restore the optimizer (Adam moments, fp32 main parameters, step count), the scheduler's position and the
    engine's step counter. `param_state`: the loaded `optimizer_sharded_state` tensors ({sub-optimizer: {param
    index: {kind: tensor}}}), each at its parameter's full local shape on this rank.

    The scheduler takes its step count from the checkpoint and its shape (peak LR, warm-up, decay length) from the
    current config, which the trainer compares with the saved config before this runs."""
    subs = sub_optimizers(engine)
    if len(common["optimizer"]) != len(subs):
        raise RuntimeError(f"the checkpoint has {len(common['optimizer'])} optimizer(s), this engine {len(subs)}")
    for i, sub in enumerate(subs):
        sub.load_state_dict(common["optimizer"][i])  # param groups, Adam's step, state allocation (no param_state)
        # megatron-core 0.16.1 (torch Adam path) gives every parameter's state the *same* `step` tensor object;
        # torch's Adam increments it in place once per parameter, so the next step would see step + n_params in
        # its bias correction. One tensor each, as a fresh Adam has.
        for state in sub.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
        _copy_param_state(sub, param_state[i])
    sched = engine.scheduler
    sched.num_steps = int(common["scheduler"]["num_steps"])
    sched.step(increment=0)  # sets the param groups' lr / weight decay for num_steps
    engine.steps = int(common["steps"])


@torch.no_grad()
def _copy_param_state(opt, param_state: dict) -> None:
    """This DP rank's range of each loaded full-shape tensor into its fp32 main parameter and Adam moments.

    Same walk as megatron-core 0.16.1's `DistributedOptimizer.load_parameter_state_from_fully_reshardable` (one
    index per parameter of each grad buffer, in `param_index_map` order, local or not), which cannot be used with
    torch's Adam (no apex / Transformer Engine, as on CPU): its `_set_main_param_and_optimizer_states` copies every
    key of the live state, `step` included, from a dict it built without `step` (KeyError: 'step')."""
    from collections import ChainMap

    idx = -1
    for gbuf_idx, gbuf_range_maps in enumerate(opt.gbuf_ranges):
        for maps in gbuf_range_maps.values():
            ranges = ChainMap(*(m["param_map"] for m in maps))
            for model_param in opt.buffers[gbuf_idx].param_index_map:
                idx += 1
                if model_param not in ranges:
                    continue
                r = ranges[model_param]["param"]
                live = opt._get_main_param_and_optimizer_states(model_param)
                for kind, loaded in param_state[idx].items():  # no "param" for fp32 weights (they are the main copy)
                    src = loaded.flatten()[r.start:r.end]
                    if src.numel() != live[kind].numel():
                        raise RuntimeError(f"optimizer state {kind} of parameter {idx}: checkpoint slice has "
                                           f"{src.numel()} elements, this rank's shard {live[kind].numel()}")
                    live[kind].copy_(src.view_as(live[kind]))


# ----------------------------------------------------------------------------------------------- RNG
def capture_rng(megatron: bool = True) -> dict[str, Any]:
    """This process's random number generators: Python `random`, numpy, torch's default CPU generator, CUDA's
    (every device) when present; with `megatron` also megatron-core's model-parallel RNG tracker states and, on CPU,
    the generator the compatibility layer gives that tracker (`megarl.platform.megatron_cpu_compat.DEVICE_RNG`).
    The controller passes megatron=False (it never imports megatron-core)."""
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    # numpy's key array as a tensor: every value here is plain data or a tensor (loads with weights_only=True)
    state = {"python": random.getstate(), "torch_cpu": torch.get_rng_state(),
             "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached_gaussian))}
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    if megatron:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        from megarl.platform import megatron_cpu_compat

        state["megatron_tracker"] = {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()}
        if not torch.cuda.is_available():
            state["cpu_device_rng"] = megatron_cpu_compat.DEVICE_RNG.get_state()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Inverse of `capture_rng` (on the same kind of device; a CUDA state is skipped on CPU and vice versa)."""
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached_gaussian))
    torch.set_rng_state(state["torch_cpu"])
    if torch.cuda.is_available() and "torch_cuda" in state:
        torch.cuda.set_rng_state_all(state["torch_cuda"])
    if "megatron_tracker" in state:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        from megarl.platform import megatron_cpu_compat

        get_cuda_rng_tracker().set_states(state["megatron_tracker"])
        if not torch.cuda.is_available() and "cpu_device_rng" in state:
            megatron_cpu_compat.DEVICE_RNG.set_state(state["cpu_device_rng"])


def rng_path(step_dir: str, pool: str, rank: int) -> str:
    return os.path.join(step_dir, "rng", f"{pool}_rank{rank:05d}.pt")


def save_rng(step_dir: str, pool: str, rank: int, layout: str, megatron: bool = True) -> None:
    """This process's generators (`capture_rng`) to `rng_path`, with `layout` (what the restoring process must
    match: the pool's world size and its roles' layouts), written atomically."""
    path = rng_path(step_dir, pool, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    torch.save({"layout": layout, "state": capture_rng(megatron)}, tmp)
    os.replace(tmp, path)


def load_rng(step_dir: str, pool: str, rank: int, layout: str) -> str:
    """Restore this process's generators from `rng_path` when it was saved at the same `layout`; returns what
    happened ('restored', or why not: the generators then keep their seeded state, which with dropout off changes
    nothing megarl computes)."""
    path = rng_path(step_dir, pool, rank)
    if not os.path.isfile(path):
        return f"not restored: {path} is missing"
    import pickle

    try:
        saved = torch.load(path, weights_only=True)
    except pickle.UnpicklingError:
        return f"not restored: {path} holds pickled Python objects (an older megarl's format), not loaded"
    if saved["layout"] != layout:
        return f"not restored: saved at layout {saved['layout']}, now {layout}"
    restore_rng(saved["state"])
    return "restored"
