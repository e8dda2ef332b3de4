"""Per-sync verification of the reshard: every shard piece an inference rank wrote is checked against its source.

Data path (per bucket, `execute_reshard(..., verify=True)`, the default; `rollout.verify_sync`):
  sender, per remote op: `checksum(piece)` of the Megatron slice it sends, in the wire dtype, per
      destination (float64[ops, 2]), one extra message per peer pair (tag 2) through the reshard transport,
      posted before the bucket's payload and waited after it;
  local ops: the same checksum of the local source slice;
  receiver, once every op of the bucket was written and before the sink commits any parameter: `checksum` of
      the destination slice each op wrote (so a later op overwriting an earlier one is caught too) == the
      sender's. A mismatch raises `ReshardVerificationError` naming the vLLM parameter, the HF run, this rank's
      inference TP rank and global rank, and the source rank; nothing of that bucket is committed.
In delta mode the sender checksums the whole current piece, so the receiver's patched shard is checked in full.

The checksum is cheap (one vectorised pass, about a copy's cost for fp32) and layout-independent: per row (last
dim), the float32 sum of the elements; then S1 = sum of the row sums and S2 = sum of row sum x ((row index mod 251)
+ 1), both in float64 over the small vector of row sums (rows in the wrong order differ). A row reduction depends
only on the row's length and unit inner stride, not on the outer strides, so a strided Megatron slice and the
contiguous vLLM slice give identical bits (checked by the tests; sender and receiver run the same torch build and
device kind). 1-D pieces (norms, biases) use the elements themselves as rows. It catches any corruption that moves
a row sum by more than its float32 rounding (a wrong offset, a shifted or swapped run, a flipped exponent or high
mantissa bit, a stale delta target); it can miss a flip of the lowest mantissa bits of one element in a long row,
a permutation inside a row, and a wrong *source* slice (the sender checks what it sends): it verifies transport and
placement; the layouts themselves are verified against transformers and vLLM by the test suite.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from megarl.reshard.planner import TransferOp
from megarl.reshard.transport import Message, Pending, Transport

CHECKSUM_TAG = 2
_ROW_WEIGHT_MODULUS = 251  # row weights 1..251: rows in another order give another S2


class ReshardVerificationError(RuntimeError):
    """A resharded shard piece does not match its source's checksum."""


def checksum(t: torch.Tensor) -> torch.Tensor:
    """float64[2] (S1, S2) of `t` (any strides with a unit last stride); see the module docstring. Equal bits for
    equal values whatever the outer strides."""
    if t.dim() == 0:
        t = t.reshape(1)
    if t.stride(-1) != 1:
        t = t.contiguous()
    rows = t.sum(dim=-1, dtype=torch.float32).reshape(-1) if t.dim() > 1 else t.to(torch.float32)
    rows = rows.to(torch.float64)
    weights = (torch.arange(rows.numel(), device=rows.device) % _ROW_WEIGHT_MODULUS + 1).to(torch.float64)
    return torch.stack([rows.sum(), (rows * weights).sum()])


def post_checksums(
    send_ops: dict[int, list[TransferOp]],
    recv_ops: dict[int, list[TransferOp]],
    piece_of: Callable[[TransferOp], torch.Tensor],
    dtype: torch.dtype,
    transport: Transport,
    device: torch.device,
) -> tuple[Pending, dict[TransferOp, torch.Tensor]]:
    """Senders checksum the pieces they send (cast to the wire `dtype`) and post them, one message per peer pair
    (peers in sorted order), before the bucket's payload so both travel together. Returns the pending exchange and,
    for every op this rank receives, the buffer that holds the sender's checksum (float64[2]) once it is waited."""
    sends = []
    for dst, ops in send_ops.items():
        sums = [checksum(p if p.dtype == dtype else p.to(dtype)) for op in ops for p in [piece_of(op)]]
        sends.append(Message(dst, torch.stack(sums).to(device), tag=CHECKSUM_TAG))
    bufs = {src: torch.empty(len(ops), 2, dtype=torch.float64, device=device) for src, ops in recv_ops.items()}
    pending = transport.post(sends, [Message(src, b, tag=CHECKSUM_TAG) for src, b in bufs.items()])
    return pending, {op: bufs[src][i] for src, ops in recv_ops.items() for i, op in enumerate(ops)}


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
    differ = want.view(torch.int64) != got.view(torch.int64)  # bitwise: NaN weights on both sides agree
    if not bool(differ.any()):
        return
    bad = differ.any(dim=1).nonzero().flatten().tolist()
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
