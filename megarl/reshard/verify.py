"""Per-sync verification of the reshard: every shard piece an inference rank wrote is checked against its source.

Data path (per bucket, `execute_reshard(..., verify=True)`, the default; `rollout.verify_sync`):
  sender, per remote op: `checksum(piece)` of the Megatron slice it sends, in the wire dtype -> int64[ops, 2] per
      destination, one extra message per peer pair (tag 2) through the reshard transport;
  local ops: the same checksum of the local source slice;
  receiver, once every op of the bucket was written and before the sink commits any parameter: `checksum` of
      the destination slice each op wrote (so a later op overwriting an earlier one is caught too) == the
      sender's. A mismatch raises `ReshardVerificationError` naming the vLLM parameter, the HF run, this rank's
      inference TP rank and global rank, and the source rank; nothing of that bucket is committed.
In delta mode the sender checksums the whole current piece, so the receiver's patched shard is checked in full.

The checksum is exact and independent of memory layout: the elements' bits as int16 lanes (bf16/fp16: one lane,
fp32: two), summed per row in int64 (S1 = sum of all lanes) and weighted by (row index mod 251) + 1 (S2, so rows in
the wrong order differ). Integer sums do not depend on reduction order, so a strided Megatron slice and the
contiguous vLLM slice agree bit for bit; any changed bit changes S1. It does not see a permutation of elements
inside a row (S1 and S2 are sums) nor a wrong *source* slice (the sender checks what it sends): it verifies
transport and placement, the layouts are verified against transformers and vLLM by the test suite.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from megarl.reshard.planner import TransferOp
from megarl.reshard.transport import Message, Transport, exchange

CHECKSUM_TAG = 2
_ROW_WEIGHT_MODULUS = 251  # keeps |S2| < 2**63: |row sum| < 2**15 * lanes per row, times <= 251, summed over rows


class ReshardVerificationError(RuntimeError):
    """A resharded shard piece does not match its source's checksum."""


def checksum(t: torch.Tensor) -> torch.Tensor:
    """int64[2] (S1, S2) of `t` (any strides with a unit last stride, any 1/2/4-byte float dtype); see the module
    docstring. Equal for equal values whatever the memory layout."""
    if t.dim() == 0:
        t = t.reshape(1)
    if t.stride(-1) != 1:
        t = t.contiguous()
    lanes = t.view(torch.int16) if t.element_size() in (2, 4) else t.view(torch.int8)
    rows = lanes.sum(dim=-1, dtype=torch.int64).reshape(-1) if lanes.dim() > 1 else lanes.to(torch.int64)
    weights = torch.arange(rows.numel(), device=rows.device, dtype=torch.int64) % _ROW_WEIGHT_MODULUS + 1
    return torch.stack([rows.sum(), (rows * weights).sum()])


def exchange_checksums(
    send_ops: dict[int, list[TransferOp]],
    recv_ops: dict[int, list[TransferOp]],
    piece_of: Callable[[TransferOp], torch.Tensor],
    dtype: torch.dtype,
    transport: Transport,
    device: torch.device,
) -> dict[TransferOp, torch.Tensor]:
    """Senders checksum the pieces they send (cast to the wire `dtype`); returns, for every op this rank receives,
    the sender's checksum. One message per peer pair (peers in sorted order, as the payload)."""
    sends = []
    for dst, ops in send_ops.items():
        sums = [checksum(p if p.dtype == dtype else p.to(dtype)) for op in ops for p in [piece_of(op)]]
        sends.append(Message(dst, torch.stack(sums).to(device), tag=CHECKSUM_TAG))
    bufs = {src: torch.empty(len(ops), 2, dtype=torch.int64, device=device) for src, ops in recv_ops.items()}
    exchange(transport, sends, [Message(src, b, tag=CHECKSUM_TAG) for src, b in bufs.items()])
    return {op: bufs[src][i] for src, ops in recv_ops.items() for i, op in enumerate(ops)}


def check_written(
    expected: dict[TransferOp, torch.Tensor],
    view_of: Callable[[TransferOp], torch.Tensor],
    rank: int,
    infer_rank: int,
) -> None:
    """Compare each op's destination slice with its expected checksum; raise naming the first mismatches."""
    if not expected:
        return
    ops = list(expected)
    want = torch.stack([expected[op] for op in ops])
    got = torch.stack([checksum(view_of(op)).to(want.device) for op in ops])
    if torch.equal(want, got):
        return
    bad = (want != got).any(dim=1).nonzero().flatten().tolist()
    lines = [
        f"vLLM parameter {ops[i].dst_param!r} (HF {ops[i].piece.hf_name} [{ops[i].piece.start}:{ops[i].piece.stop}] "
        f"along dim {ops[i].piece.dim}) from source rank {ops[i].src}: checksum {got[i].tolist()}, source sent "
        f"{want[i].tolist()}"
        for i in bad[:5]
    ]
    raise ReshardVerificationError(
        f"reshard verification failed on inference TP rank {infer_rank} (global rank {rank}), {len(bad)} piece(s) "
        f"differ from their source:\n  " + "\n  ".join(lines)
        + "\nThe weights were not committed. This is a reshard bug (layout or transport): please report it with "
        "the model config and the actor/rollout layouts; `rollout.verify_sync: false` skips this check."
    )


def local_checksum(piece: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """Checksum of a local op's source slice in the wire dtype."""
    return checksum(piece if dtype is None or piece.dtype == dtype else piece.to(dtype))
