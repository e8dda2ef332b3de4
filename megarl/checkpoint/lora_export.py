"""LoRA adapters (megarl.engine.lora) as a PEFT adapter directory: `adapter_config.json` + `adapter_model.safetensors`
that `peft.PeftModel.from_pretrained(hf_base, dir)` loads onto the HF base and vLLM's `LoRARequest` serves.

Megatron's fused linears map to several HF linears, each with its own PEFT adapter:
  - linear_qkv -> q_proj, k_proj, v_proj: each gets the same A (the fused layer's input is shared) and its own rows
    of B, cut from Megatron's per-query-group [q_g; k_g; v_g] layout as the base weight is (`name_map.scatter_shard`);
  - linear_fc1 -> gate_proj, up_proj: the same A, B's [gate_shard; up_shard] rows of every TP rank;
  - linear_proj -> o_proj, linear_fc2 -> down_proj: A (split on input columns over TP) and B as they are.
(B_q A, B_k A, B_v A stacked per group is exactly Megatron's B A: the export is lossless.) PEFT's scaling is
lora_alpha / r, as megarl's.
"""

from __future__ import annotations

import json
import os
from typing import Mapping, Optional

import torch

from megarl.checkpoint.name_map import cached_hf_shapes, module_param_layout, scatter_shard
from megarl.engine.lora import TARGETS, LoraSettings
from megarl.models.spec import ModelSpec

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def _module(hf_weight_name: str) -> str:
    return hf_weight_name[: -len(".weight")]


def peft_tensors(spec: ModelSpec, settings: LoraSettings,
                 shards: Mapping[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """PEFT adapter tensors from Megatron adapter shards.

    shards: canonical Megatron name (global layer, e.g. "decoder.layers.3.mlp.linear_fc1.lora_B.weight") -> that
    tensor's TP shards in TP rank order (one entry for a replicated matrix).
    Returns {"base_model.model.model.layers.3.mlp.gate_proj.lora_B.weight": [ffn, rank], ...}.
    """
    out: dict[str, torch.Tensor] = {}
    shapes = cached_hf_shapes(spec)
    for name, parts in shards.items():
        base, _, which = name.rpartition(".lora_")  # which = "A.weight" | "B.weight"
        target = next((t for t, ((p, a), _) in TARGETS.items() if base.endswith(f"{p}.{a}")), None)
        if target is None:
            raise ValueError(f"{name}: not a LoRA adapter of {', '.join(TARGETS)}")
        kind = TARGETS[target][1]
        layout = module_param_layout(spec, base + ".weight")
        split = (kind == "column" and which == "B.weight") or (kind == "row" and which == "A.weight")
        if not split:  # replicated over TP: every HF linear of the fused one gets it as it is
            for hf in layout.hf_names:
                out[f"{PEFT_PREFIX}{_module(hf)}.lora_{which}"] = parts[0].clone()
            continue
        rank = parts[0].shape[1 if which == "B.weight" else 0]
        full = {hf: torch.empty((shapes[hf][0], rank) if which == "B.weight" else (rank, shapes[hf][1]),
                                dtype=parts[0].dtype) for hf in layout.hf_names}
        for tp_rank, shard in enumerate(parts):
            scatter_shard(spec, layout, tp_rank, len(parts), shard, full, pad_vocab=False)
        for hf, t in full.items():
            out[f"{PEFT_PREFIX}{_module(hf)}.lora_{which}"] = t
    return out


def peft_target_modules(settings: LoraSettings, spec: ModelSpec) -> list[str]:
    """The HF module names (q_proj, ...) PEFT adapts for `settings.targets`."""
    names = []
    for target in settings.targets:
        (parent, attr), _ = TARGETS[target]
        layout = module_param_layout(spec, f"decoder.layers.0.{parent}.{attr}.weight")
        names += [_module(hf).rsplit(".", 1)[1] for hf in layout.hf_names]
    return names


def peft_adapter_config(settings: LoraSettings, spec: ModelSpec, base_model: Optional[str]) -> dict:
    """PEFT's `LoraConfig` as JSON."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "target_modules": peft_target_modules(settings, spec),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def write_peft_adapter(out: str, spec: ModelSpec, settings: LoraSettings, tensors: Mapping[str, torch.Tensor],
                       base_model: Optional[str] = None, overwrite: bool = False) -> dict:
    """Write `tensors` (`peft_tensors`) and the adapter config to the directory `out` (renamed into place when
    complete). Returns {"out", "bytes"}."""
    import shutil
    import tempfile

    from safetensors.torch import save_file

    from megarl.checkpoint.atomic import check_output_dir

    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    check_output_dir(out, overwrite)
    tmp = tempfile.mkdtemp(prefix=".lora-export-", dir=parent)
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, os.path.join(tmp, ADAPTER_WEIGHTS),
                  metadata={"format": "pt"})
        with open(os.path.join(tmp, ADAPTER_CONFIG), "w") as f:
            json.dump(peft_adapter_config(settings, spec, base_model), f, indent=2)
        if os.path.exists(out):
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"out": os.path.abspath(out), "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}


def engine_lora_shards(engine, grads: bool = False) -> Optional[dict[str, list[torch.Tensor]]]:
    """Collective over the role's ranks: every adapter of the engine, {canonical name: TP shards in TP order} (CPU),
    returned on the role's first rank (None elsewhere). Shards are gathered over TP, stages over PP. `grads`: their
    reduced gradients (`main_grad`, after `run`; DP 1) instead of their values."""
    import torch.distributed as dist

    from megarl.checkpoint.engine_io import engine_named_parameters
    from megarl.engine.lora import is_lora_param

    groups = engine.groups
    mine = {}
    for canonical, _, param in engine_named_parameters(engine):
        if not is_lora_param(canonical):
            continue
        value = (param.main_grad if grads else param.data).float().contiguous()
        parts = [torch.empty_like(value) for _ in range(groups.topology.tp)]
        dist.all_gather(parts, value, group=groups.pgs.tp)
        mine[canonical] = [p.cpu() for p in parts]
    stages: list = [None] * groups.topology.pp
    dist.all_gather_object(stages, mine if groups.coord.tp == 0 else {}, group=groups.pgs.pp)
    if groups.coord.rank != 0:
        return None
    return {k: v for stage in stages for k, v in stage.items()}
