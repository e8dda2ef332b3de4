"""Splitting one DP rank's share of a batch into micro-batches: by a fixed sample count or by a token budget.

`plan_micro_batches` is pure (sample lengths in, lists of sample indices out); `make_micro_batches` applies a
plan to a `Batch` and trims each micro-batch to its longest sequence; `restore_order` puts per-micro-batch
results back into the original sample order.

Token budget ("dynamic batch size"): ``micro_batch_tokens`` bounds the *padded* size of a micro-batch,
``samples * longest sequence``, because on this path micro-batches are padded, not packed. Sequences are packed
first-fit-decreasing (longest first, each into the first micro-batch it still fits), so similar lengths share a
micro-batch and little is padding. No sample is ever dropped; a sequence longer than the budget is an error.

Packed sequences (THD, no padding at all): megatron-core's packed-sequence path (`PackedSeqParams`) needs
Transformer Engine's or flash attention's variable-length kernels. With the local layer spec (always on CPU, and
on GPUs without TE) the attention is the unfused dot-product kernel, which does not take cu_seqlens, so megarl
pads. The plan's format (lists of indices per micro-batch) is what a THD path would consume as well.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from megarl.data.batch import Batch


def plan_micro_batches(
    lengths: Sequence[int],
    micro_batch_samples: Optional[int] = None,
    micro_batch_tokens: Optional[int] = None,
) -> list[list[int]]:
    """Group sample indices into micro-batches.

    Args:
        lengths: real tokens of each sample (prompt + response), in batch order.
        micro_batch_samples: fixed samples per micro-batch (consecutive, original order); the last may be smaller.
        micro_batch_tokens: token budget per micro-batch: ``len(group) * max(lengths in group) <= budget``.
        Exactly one may be set; with neither, every sample is its own micro-batch.
    Returns: lists of indices into `lengths`; each index appears exactly once. Within a token-budget group the
        indices are in ascending order.
    """
    lengths = [int(x) for x in lengths]
    n = len(lengths)
    if micro_batch_samples is not None and micro_batch_tokens is not None:
        raise ValueError(
            f"set micro_batch_samples ({micro_batch_samples}) or micro_batch_tokens ({micro_batch_tokens}), not both"
        )
    if micro_batch_tokens is None:
        size = micro_batch_samples or 1
        if size <= 0:
            raise ValueError(f"micro_batch_samples must be positive, got {size}")
        return [list(range(i, min(i + size, n))) for i in range(0, n, size)]
    if micro_batch_tokens <= 0:
        raise ValueError(f"micro_batch_tokens must be positive, got {micro_batch_tokens}")
    too_long = [(i, l) for i, l in enumerate(lengths) if l > micro_batch_tokens]
    if too_long:
        i, l = max(too_long, key=lambda x: x[1])
        raise ValueError(
            f"sample {i} has {l} tokens, more than micro_batch_tokens={micro_batch_tokens}: raise "
            f"micro_batch_tokens to at least the longest sequence ({l} tokens)"
        )
    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []  # each bin's first element is its longest sample (descending insertion)
    for i in order:
        for b in bins:
            if (len(b) + 1) * lengths[b[0]] <= micro_batch_tokens:
                b.append(i)
                break
        else:
            bins.append([i])
    return [sorted(b) for b in bins]


def make_micro_batches(batch: Batch, plan: list[list[int]]) -> list[Batch]:
    """Apply `plan` to `batch`: each micro-batch is trimmed to its longest real sequence (`attention_mask`)."""
    lengths = batch.lengths()
    out = []
    for idx in plan:
        mb = batch.index(idx)
        out.append(mb.trim(max(1, int(lengths[idx].max()))))
    return out


def restore_order(parts: Sequence[Batch], plan: list[list[int]], seq_len: Optional[int] = None) -> Batch:
    """Inverse of `make_micro_batches` for results: concatenate `parts` (one per plan entry), right-pad [B, S]
    tensors back to `seq_len`, and put rows back into the original sample order."""
    merged = Batch.concat(list(parts))
    if seq_len is not None:
        padded = {}
        for k, v in merged.tensors.items():
            if v.dim() >= 2 and v.shape[1] < seq_len:
                v = torch.nn.functional.pad(v, (0, 0) * (v.dim() - 2) + (0, seq_len - v.shape[1]))
            padded[k] = v
        merged = Batch(padded, merged.meta)
    flat = [i for idx in plan for i in idx]
    inverse = torch.empty(len(flat), dtype=torch.long)
    inverse[torch.as_tensor(flat, dtype=torch.long)] = torch.arange(len(flat))
    return merged.index(inverse)
