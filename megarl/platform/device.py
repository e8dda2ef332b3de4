"""Device selection: CUDA when present, else CPU. The one place that decides where tensors live."""

from __future__ import annotations

import os

import torch


def device_kind(requested: str = "auto") -> str:
    """'cuda' or 'cpu'. `requested` is 'auto' (CUDA when available), 'cuda' or 'cpu'.

    Raises RuntimeError naming the fix when 'cuda' is requested on a machine without it.
    """
    if requested not in ("auto", "cuda", "cpu"):
        raise ValueError(f"device must be one of auto|cuda|cpu, got {requested!r}")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but CUDA is not available; set resources.device=cpu or auto")
    return requested


def local_device(kind: str | None = None) -> torch.device:
    """This process's device: cuda:LOCAL_RANK on GPU machines, cpu otherwise."""
    kind = kind or device_kind()
    if kind == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def compute_device() -> torch.device:
    """Where micro-batches go: this rank's current GPU, or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def empty_device_cache() -> None:
    """Return the CUDA caching allocator's unused blocks to the driver (no-op without CUDA). Memory cached by torch
    counts as used for anything that sizes itself from free device memory (vLLM at start-up and on wake_up)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
