"""`megarl export CHECKPOINT --out HF_DIR`: a trained role's weights from a trainer checkpoint as a HuggingFace model.

CHECKPOINT is a trainer step directory (`<checkpoint.dir>/step_000020`, whose `actor/` is exported) or a role's
Megatron checkpoint directory itself (holding `megarl_checkpoint.json`). Any TP/PP/DP layout it was saved at reads
back (megatron-core resharding on load); the optimizer state in it is ignored. The output is written through
`megatron_to_hf`: safetensors shards, config.json (the model's HF config with the checkpoint's dtype), generation
config and tokenizer files, in a temporary directory renamed when complete. Runs as a world of one process.
"""

from __future__ import annotations

import os

from megarl.checkpoint.dist_ckpt import META_NAME, read_meta
from megarl.checkpoint.errors import CheckpointError

EXPORTABLE_ROLES = ("actor",)  # the critic's scalar head has no HF causal-LM equivalent


def resolve_role_dir(path: str, role: str = "actor") -> str:
    """The Megatron checkpoint directory of `role` in `path` (a step directory), or `path` itself when it is one."""
    if role not in EXPORTABLE_ROLES:
        raise CheckpointError(f"--role {role}: only {', '.join(EXPORTABLE_ROLES)} can be exported as an HF causal LM")
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    if os.path.isfile(os.path.join(path, META_NAME)):
        return path
    candidate = os.path.join(path, role)
    if os.path.isfile(os.path.join(candidate, META_NAME)):
        return candidate
    raise CheckpointError(f"{path} is neither a trainer step directory with {role}/ (e.g. "
                          f"<checkpoint.dir>/step_000020) nor a megarl Megatron checkpoint ({META_NAME} missing)")


def export_lora(path: str, out: str, role: str = "actor", overwrite: bool = False) -> dict:
    """Write the LoRA adapters of `role` in the checkpoint at `path` (saved with `actor.lora`) as a PEFT adapter
    directory at `out` (`megarl.checkpoint.lora_export`); returns {"out", "source", "bytes", "base_model"}. Builds the
    model at TP1 PP1 in a one-process world (the base weights are not read: the checkpoint holds the adapters only)
    and loads the adapters into it (megatron-core reshards them from any saved layout)."""
    import torch.distributed as dist

    from megarl.checkpoint.atomic import check_output_dir
    from megarl.checkpoint.dist_ckpt import load_engine_checkpoint
    from megarl.checkpoint.hf_io import spec_from_hf_config
    from megarl.checkpoint.lora_export import engine_lora_shards, peft_tensors, write_peft_adapter
    from megarl.engine import MegatronEngine
    from megarl.engine.lora import LoraSettings, lora_transform
    from megarl.parallel.groups import build_role_groups
    from megarl.parallel.topology import RoleTopology
    from megarl.platform.distributed import init_distributed

    mdir = resolve_role_dir(path, role)
    meta = read_meta(mdir)
    if meta.get("lora") is None:
        raise CheckpointError(f"{mdir} holds no LoRA adapters (saved without actor.lora): export the whole model "
                              "without --lora")
    lora = meta["lora"]
    settings = LoraSettings(rank=lora["rank"], alpha=lora["alpha"], dropout=lora["dropout"],
                            targets=tuple(lora["targets"]))
    check_output_dir(out, overwrite)
    started = not dist.is_initialized()
    init_distributed()
    try:
        if dist.get_world_size() != 1:
            raise CheckpointError("export_lora runs in a world of one process")
        spec = spec_from_hf_config(meta["hf_config"])
        engine = MegatronEngine(spec, build_role_groups(RoleTopology()), dtype=meta["dtype"], init_weights=False,
                                transforms=[lora_transform(settings)])
        load_engine_checkpoint(engine, mdir)
        tensors = peft_tensors(spec, settings, engine_lora_shards(engine))
        stats = write_peft_adapter(out, spec, settings, tensors, base_model=meta.get("base_model"),
                                   overwrite=overwrite)
    finally:
        if started:
            dist.destroy_process_group()
    return {**stats, "source": os.path.abspath(mdir), "base_model": meta.get("base_model")}


def export_hf(path: str, out: str, role: str = "actor", overwrite: bool = False, max_shard_gb: float = 2.0) -> dict:
    """Write `role` of the checkpoint at `path` to the HF directory `out`; returns {"out", "source", "bytes"}.
    Starts (and ends) a one-process torch.distributed world when none is running."""
    import torch.distributed as dist

    from megarl.checkpoint.atomic import check_output_dir
    from megarl.checkpoint.dist_ckpt import megatron_to_hf
    from megarl.platform.distributed import init_distributed

    mdir = resolve_role_dir(path, role)
    if read_meta(mdir).get("lora") is not None:  # validated before starting torch.distributed
        raise CheckpointError(f"{mdir} holds LoRA adapters only (actor.lora; the base stays in its HF directory): "
                              "export them with --lora, a PEFT adapter directory for that base")
    check_output_dir(out, overwrite)
    started = not dist.is_initialized()
    init_distributed()
    try:
        stats = megatron_to_hf(mdir, out, overwrite=overwrite, max_shard_bytes=int(max_shard_gb * 1024**3))
    finally:
        if started:
            dist.destroy_process_group()
    return {"out": os.path.abspath(out), "source": os.path.abspath(mdir), **stats}
