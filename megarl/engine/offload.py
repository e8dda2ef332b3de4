"""Move a role's parameters, gradient buffers and optimizer state to host memory between phases, and back.

The device copy is freed by resizing the tensor's storage to 0 bytes, not by rebinding `.data`: megatron-core's
DDP keeps every parameter (and `main_grad`) as a *view* into one flat buffer per dtype, and the distributed
optimizer keeps views of those, so the storages must stay the same objects. Reload resizes them back and copies
the host copy in. On GPU the host copies are pinned; on CPU both sides are host memory, so nothing is saved but
the bookkeeping (what is offloaded, bytes moved, contents restored bit for bit) runs the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

import torch


@dataclasses.dataclass
class OffloadedState:
    """What one `offload` call moved: per kind ('params', 'grads', 'optimizer'), (tensor, host copy) pairs."""

    stashed: dict[str, list[tuple[torch.Tensor, torch.Tensor]]]

    def bytes(self, kind: str | None = None) -> int:
        kinds = [kind] if kind else list(self.stashed)
        return sum(h.numel() * h.element_size() for k in kinds for _, h in self.stashed.get(k, []))

    @property
    def kinds(self) -> list[str]:
        return [k for k, v in self.stashed.items() if v]


def unique_storages(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """One tensor per distinct storage (the first seen); tensors already offloaded (0 bytes) are skipped."""
    seen, out = set(), []
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        if st.nbytes() == 0 or st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        out.append(t)
    return out


def _whole_storage_view(t: torch.Tensor) -> torch.Tensor:
    """A flat view covering the tensor's entire storage (views into a DDP buffer share the buffer's storage)."""
    n = t.untyped_storage().nbytes() // t.element_size()
    return t.new_empty(0).set_(t.untyped_storage(), 0, (n,))


def stash(tensors: Iterable[torch.Tensor], pool: Optional[list[torch.Tensor]] = None,
          ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copy each distinct storage to host memory and free it on the device; returns (flat view, host copy).

    pool: host buffers of an earlier `stash` of the same tensors (in the same order), reused when the i-th one has
        the i-th storage's dtype and size, and replaced in place otherwise: pinned host allocation (cudaHostAlloc,
        page-locking, ~GB/s) is paid once per role instead of at every offload. None: fresh buffers.
    """
    out = []
    pin = torch.cuda.is_available()
    for i, t in enumerate(unique_storages(tensors)):
        flat = _whole_storage_view(t)
        host = pool[i] if pool is not None and i < len(pool) else None
        if host is None or host.dtype != flat.dtype or host.shape != flat.shape:
            host = torch.empty(flat.shape, dtype=flat.dtype, device="cpu", pin_memory=pin)
            if pool is not None:
                pool[i:i + 1] = [host]
        host.copy_(flat, non_blocking=pin)
        out.append((flat, host))
    if pin:
        torch.cuda.synchronize()
    for flat, _ in out:
        flat.untyped_storage().resize_(0)
    return out


def restore(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Inverse of `stash`: reallocate each storage and copy its host copy back in."""
    for flat, host in pairs:
        flat.untyped_storage().resize_(host.numel() * host.element_size())
        flat.copy_(host, non_blocking=host.is_pinned())
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def param_tensors(engine) -> list[torch.Tensor]:
    if engine.trainable:  # DDP: parameters are views into the flat param buffers
        bufs = [b for m in engine.models for b in m.buffers + m.expert_parallel_buffers]
        flat = [b.param_data for b in bufs if b.param_data is not None]
        covered = {t.untyped_storage().data_ptr() for t in flat}
        extra = [p for p in engine.module.parameters() if p.untyped_storage().data_ptr() not in covered]
        return flat + extra
    return [p.data for p in engine.module.parameters()]


def grad_tensors(engine) -> list[torch.Tensor]:
    if not engine.trainable:
        return []
    return [b.grad_data for m in engine.models for b in m.buffers + m.expert_parallel_buffers]


def optimizer_tensors(engine) -> list[torch.Tensor]:
    """Adam moments and the fp32 master copies of bf16/fp16 parameters (fp32 masters are views of the params)."""
    if engine.optimizer is None:
        return []
    out = []
    for opt in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is not None:
            for state in inner.state.values():
                out.extend(v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        for group in getattr(opt, "shard_fp32_from_float16_groups", []) or []:
            out.extend(group)
    return out
