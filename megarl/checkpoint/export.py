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


def export_hf(path: str, out: str, role: str = "actor", overwrite: bool = False, max_shard_gb: float = 2.0) -> dict:
    """Write `role` of the checkpoint at `path` to the HF directory `out`; returns {"out", "source", "bytes"}.
    Starts (and ends) a one-process torch.distributed world when none is running."""
    import torch.distributed as dist

    from megarl.checkpoint.atomic import check_output_dir
    from megarl.checkpoint.dist_ckpt import megatron_to_hf
    from megarl.platform.distributed import init_distributed

    mdir = resolve_role_dir(path, role)
    read_meta(mdir)  # validate before starting torch.distributed
    check_output_dir(out, overwrite)
    started = not dist.is_initialized()
    init_distributed()
    try:
        stats = megatron_to_hf(mdir, out, overwrite=overwrite, max_shard_bytes=int(max_shard_gb * 1024**3))
    finally:
        if started:
            dist.destroy_process_group()
    return {"out": os.path.abspath(out), "source": os.path.abspath(mdir), **stats}
