"""Syncing a LoRA actor's weights into the rollout engine, two ways (issue 34, item 4):

- **adapter** (`sync_adapter`): only the adapters travel (PEFT names and layout, full tensors: rank x (in + out)
  elements per adapted linear); the engine keeps its base weights and applies the adapter through vLLM's LoRA
  support, loaded in memory (`RolloutEngine.load_lora`, `megarl.rollout.vllm_lora`). Verified twice: the
  checksums of the received tensors against the sender's (`adapter_checksums`, transport), then the engine's slot
  buffers against the received tensors, bit for bit (what the kernels read).
- **merged** (`merge_lora_sources`): base + (alpha / rank) B·A per adapted linear, fed to the ordinary reshard as
  its sources (`execute_reshard(plan, merge_lora_sources(megatron_sources(engine), deltas), sink, delta=state)`);
  the engine serves plain weights. With delta mode only the adapted linears travel (B·A changes every element of
  them at every step, so those ops go dense; embeddings, norms and untargeted linears are unchanged and move
  nothing); `verify_sync` checks every written piece as for full weights (`megarl.reshard.verify`).

Wiring into the actor's sync (not done here: `megarl.engine.lora` lands on another branch). Where the hybrid worker
builds its sources (`megarl/workers/hybrid.py`, `megatron_sources(self.actor.engine)`; `workers/pool_sync.py` alike):
  merged:  `merge_lora_sources(sources, {canonical name of m's weight: lora_delta(m) for m in lora_modules(chunks)})`
           (the adapter parameters among the sources are never read: the plan names base weights only);
  adapter: `engine_lora_shards(engine)` + `peft_tensors(...)` (megarl.checkpoint.lora_export) on the actor's first
           rank, broadcast to every inference rank, `sync_adapter(rollout_engine, tensors, peft_adapter_config(...),
           sent_checksums)` there, after one full base sync (the base never changes: no reshard at later steps).

Bytes per sync (element size e; per adapted linear of in x out, rank r): adapter r (in + out) e to every inference
rank (each needs the full adapter: vLLM slices it); merged in x out x e spread over a replica's ranks, to every
replica. `sync_bytes` computes both; `benchmarks/lora_sync.py` measures them and the time per sync.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from megarl.reshard.verify import ReshardVerificationError, checksum


def adapter_checksums(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{name: int64[2]} bitwise checksums (`megarl.reshard.verify.checksum`) of the adapter tensors, what the sender
    computes before they travel and the receiver recomputes on arrival."""
    return {name: checksum(t) for name, t in sorted(tensors.items())}


def sync_adapter(engine: Any, tensors: dict[str, torch.Tensor], config: dict[str, Any],
                 sent_checksums: Optional[dict[str, torch.Tensor]] = None, verify: bool = True,
                 version: Optional[int] = None) -> list[str]:
    """Adapter-only sync into `engine` (a `RolloutEngine` built with LoRA support), replacing its previous adapter.

    tensors / config: the adapter in PEFT names and layout and its adapter_config (see `RolloutEngine.load_lora`).
    sent_checksums: the sender's `adapter_checksums` (with `verify`: the received tensors must match them, names
        included; raises `ReshardVerificationError` naming the tensors that differ, before anything is loaded).
    verify: also compare the engine's slot buffers with the received tensors (`load_lora(verify=True)`).
    Returns the engine's adapted modules.
    """
    if verify and sent_checksums is not None:
        got = adapter_checksums(tensors)
        missing = sorted(set(sent_checksums) ^ set(got))
        differ = sorted(n for n in set(sent_checksums) & set(got) if not torch.equal(sent_checksums[n], got[n]))
        if missing or differ:
            raise ReshardVerificationError(
                f"LoRA adapter sync: {len(differ)} tensor(s) arrived with other bits than were sent "
                f"(e.g. {differ[:3]}) and {len(missing)} name(s) were sent or received only once (e.g. {missing[:3]})")
    return engine.load_lora(tensors, config, verify=verify, version=version)


def merge_lora_sources(sources: dict[str, torch.Tensor], deltas: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Reshard sources with each adapted weight replaced by base + delta (new tensors; the others as they are).

    sources: this rank's Megatron parameters by canonical name (`megatron_sources`).
    deltas: {canonical base weight name: (alpha / rank) B·A in that weight's local layout and shape}
        (`megarl.engine.lora.lora_delta(module)` for each adapted linear). Summed in float32 and rounded once to
        the base's dtype. Extra memory: one copy of this rank's adapted weights, alive while the reshard runs.
    Raises KeyError / ValueError naming a delta without its base weight or of another shape.
    """
    unknown = sorted(set(deltas) - set(sources))
    if unknown:
        raise KeyError(f"LoRA deltas for {unknown[:3]} have no base weight among this rank's reshard sources "
                       f"(e.g. {sorted(sources)[:2]}): deltas are keyed by the canonical base weight name")
    merged = dict(sources)
    for name, delta in deltas.items():
        base = sources[name]
        if tuple(delta.shape) != tuple(base.shape):
            raise ValueError(f"LoRA delta for {name} has shape {tuple(delta.shape)}, its base weight "
                             f"{tuple(base.shape)}: the delta must be in the base weight's local layout")
        merged[name] = (base.float() + delta.float()).to(base.dtype)
    return merged


def sync_bytes(linears: list[tuple[int, int]], rank: int, elem_bytes: int, infer_tp: int,
               replicas: int) -> dict[str, int]:
    """Bytes moved per sync after the first, both ways, summed over the inference ranks.

    linears: (in_features, out_features) of every adapted linear of the model (q, k, v, gate and up separate, as
        HF lists them). adapter: every inference rank receives the full adapter (infer_tp x replicas copies);
        merged (delta mode): every replica receives each adapted weight once, spread over its ranks; nothing else
        changes. Control messages (delta counts, checksums) are not counted.
    """
    adapter = sum(rank * (i + o) for i, o in linears) * elem_bytes
    merged = sum(i * o for i, o in linears) * elem_bytes
    return {"adapter": adapter * infer_tp * replicas, "merged": merged * replicas,
            "adapter_per_rank": adapter, "merged_per_rank": merged // infer_tp}


def actor_sync_sources(engine) -> dict[str, torch.Tensor]:
    """The reshard sources of the actor's weight sync: `megatron_sources(engine)`, and with `actor.lora` (merged
    sync) each adapted weight replaced by base + (alpha / rank) B·A (`merge_lora_sources`) and the adapter matrices
    dropped (the plan names base weights only). Without LoRA: `megatron_sources(engine)` as it is (no copies)."""
    from megarl.checkpoint.engine_io import canonical_name, expert_offset, stage_layer_offset
    from megarl.engine.lora import engine_lora_settings, is_lora_param, lora_delta, lora_modules
    from megarl.reshard.sources import megatron_sources

    sources = megatron_sources(engine)
    if engine_lora_settings(engine) is None:
        return sources
    experts = expert_offset(engine)
    deltas = {}
    for chunk in engine.chunks:  # chunk-local names -> canonical (global layer) names, chunk by chunk (VPP)
        offset = stage_layer_offset(chunk)
        for name, module in lora_modules(chunk):
            deltas[canonical_name(f"{name}.weight", offset, experts)] = lora_delta(module)
    return merge_lora_sources({n: t for n, t in sources.items() if not is_lora_param(n)}, deltas)
