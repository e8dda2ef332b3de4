"""Delta mode for the reshard executor: after a first full sync, send only the elements that changed.

Between two RL steps many weights do not change bit for bit (bf16 rounding absorbs small updates; frozen or
sparsely-updated parameters). Delta mode keeps, on each rank, what it last sent and what it last received, and
on later syncs moves only the changed elements of every remote `TransferOp`:

  source rank, per remote op it sends:
      mask = bits(current piece) != bits(snapshot of what it last sent)     # bitwise: NaN and -0.0 handled
      count = mask.sum()
      kind = "none" (count 0) | "sparse" (int32 flat indices + values) | "dense" (every value, as without delta)
  per bucket, two `post`/`wait` rounds of the reshard transport per peer pair:
      1. counts: int64[ops from src to dst in this bucket]  (both sides then know every op's kind and payload size)
      2. payload: values (weight dtype, tag 0) and, when some op is sparse, indices (int32, tag 1)
  destination rank: applies each op's payload onto the persistent destination shard (the previous sync's result),
      which the sink then delivers as without delta mode.

Sparse costs `count * (4 + e)` bytes against `numel * e` dense (e = element bytes), so an op is sent sparse only
while fewer than e / (4 + e) of its elements changed: 1/3 for bf16, 1/2 for fp32 (`wire_kind`). Local ops are
copied whole, as without delta mode (no traffic).

Memory (per rank, on top of the default path):
  - snapshots: one contiguous copy of every piece this rank sends (= the default path's `bytes_sent`), kept in
    `DeltaState` between syncs;
  - the destination shards must persist between syncs in the sink (`DictSink(persistent=True)`,
    `VllmShardSink(engine, persistent=True)`): on the CPU vLLM build that is one extra inference shard of the model;
    on GPU, a sink that hands out the engine's own parameters costs nothing extra;
  - an int32 index buffer for the sparse ops of the largest bucket (grown on demand, kept in `DeltaState`), and
    while a bucket is packed, one bool change mask per element this rank sends in it (counted in `peak_extra_bytes`).

Coherence: a delta is only correct if the receiver's shard still equals what the sender's snapshot says it sent.
Each sync starts with a handshake (one int64 each way per peer rank of the plan, through the transport): a rank is
ready when its state completed a sync of the same plan since the last `reset()` and no sync raised midway; between
two peers deltas flow only when both are ready, otherwise every op between them travels dense (count = numel) and
the snapshots are retaken. So the first sync is full, and a rank that resets re-syncs fully with its peers alone;
no collective over a group is needed (the default path is point-to-point only, and so is delta mode). Call
`reset()` whenever the inference weights were replaced behind the executor's back (engine rebuilt, weights
offloaded and reloaded from elsewhere, another sink).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from megarl.reshard.planner import ReshardPlan, TransferOp
from megarl.reshard.transport import Message, Transport, exchange

NONE, SPARSE, DENSE = "none", "sparse", "dense"
INDEX_BYTES = 4  # int32 flat indices
_MAX_SPARSE_NUMEL = 2**31 - 1  # int32 indices: larger pieces always go dense
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t` reinterpreted as same-width integers (no copy; works on strided views)."""
    return t.view(_BITS[t.element_size()])


def changed_mask(current: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """bool[current.shape]: elements whose bits differ (NaN == NaN when identical bits; -0.0 != 0.0)."""
    return _bits(current) != _bits(previous)


def wire_kind(changed: int, numel: int, elem_bytes: int) -> str:
    """How an op with `changed` of `numel` elements travels: NONE, SPARSE (indices + values) or DENSE (values).

    Sparse is chosen only when strictly cheaper: changed * (4 + elem_bytes) < numel * elem_bytes.
    """
    if changed == 0:
        return NONE
    if numel <= _MAX_SPARSE_NUMEL and changed * (INDEX_BYTES + elem_bytes) < numel * elem_bytes:
        return SPARSE
    return DENSE


def payload_elems(changed: int, numel: int, elem_bytes: int) -> tuple[int, int]:
    """(value elements, index elements) an op puts on the wire."""
    kind = wire_kind(changed, numel, elem_bytes)
    if kind == SPARSE:
        return changed, changed
    return (numel, 0) if kind == DENSE else (0, 0)


def pack(current: torch.Tensor, mask: torch.Tensor, kind: str, values_out: torch.Tensor,
         indices_out: torch.Tensor) -> None:
    """Write an op's payload: values (row-major order of `current`'s shape) and, if SPARSE, int32 flat indices.

    `values_out` / `indices_out`: flat buffers of exactly `payload_elems(...)` elements.
    """
    if kind == DENSE:
        values_out.view(current.shape).copy_(current)
    elif kind == SPARSE:
        if values_out.dtype == current.dtype:
            torch.masked_select(current, mask, out=values_out)
        else:  # fp32 norms of a bf16 engine travel as bf16
            values_out.copy_(current[mask])
        indices_out.copy_(mask.reshape(-1).nonzero().squeeze(1))


def unpack(target: torch.Tensor, kind: str, values: torch.Tensor, indices: torch.Tensor) -> None:
    """Apply an op's payload onto `target` (the receiver's previous copy of the piece; any strides), in place.

    The payload arrives on the transport's device; `target` may live elsewhere (a host staging tensor fed by a CUDA
    workspace): indices and values are moved to `target`'s device first (index_put_ needs them there)."""
    if kind == DENSE:
        target.copy_(values.view(target.shape))
    elif kind == SPARSE:
        values = values.to(target.device)
        flat = indices.to(target.device).long()
        where = torch.unravel_index(flat, target.shape) if target.dim() > 1 else (flat,)
        target.index_put_(where, values)


def update_snapshot(snapshot: torch.Tensor, current: torch.Tensor, mask: torch.Tensor, kind: str) -> None:
    """Bring the sender's snapshot to what the receiver now holds."""
    if kind == DENSE:
        snapshot.copy_(current)
    elif kind == SPARSE:
        snapshot[mask] = current[mask]


class DeltaState:
    """What one rank remembers between syncs in delta mode (pass the same object to every `execute_reshard`).

    Holds a snapshot of every piece this rank sent at the last sync (bytes = the plan's `bytes_sent` for this
    rank) and a grow-only int32 index buffer. `reset()` drops them: the next sync is full.
    """

    def __init__(self) -> None:
        self.snapshots: dict[TransferOp, torch.Tensor] = {}
        self.syncs = 0  # completed syncs since the last reset
        self.pair_ready: dict[int, bool] = {}  # peer rank -> deltas flow with it in the current sync
        self._plan_id: Optional[int] = None
        self._in_flight = False
        self._index_buf: Optional[torch.Tensor] = None

    def reset(self) -> None:
        self.snapshots.clear()
        self.syncs = 0
        self.pair_ready = {}
        self._plan_id = None
        self._in_flight = False
        self._index_buf = None

    def snapshot_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.snapshots.values())

    def begin(self, plan: ReshardPlan, rank: int, transport: Transport, device: torch.device) -> bool:
        """Start a sync: handshake with every peer of `rank` in `plan`; True when deltas flow with all of them."""
        ready = self.syncs > 0 and not self._in_flight and self._plan_id == id(plan)
        if not ready:
            self.snapshots.clear()
        peers = sorted({op.dst if op.src == rank else op.src for op in plan.ops
                        if op.src != op.dst and rank in (op.src, op.dst)})
        mine = torch.tensor([int(ready)], dtype=torch.int64, device=device)
        theirs = {p: torch.zeros(1, dtype=torch.int64, device=device) for p in peers}
        exchange(transport, [Message(p, mine) for p in peers], [Message(p, t) for p, t in theirs.items()])
        self.pair_ready = {p: ready and bool(t.item()) for p, t in theirs.items()}
        self._plan_id = id(plan)
        self._in_flight = True
        return ready and all(self.pair_ready.values())

    def end(self) -> None:
        self._in_flight = False
        self.syncs += 1

    def remember(self, op: TransferOp, sent: torch.Tensor) -> None:
        """A dense send: keep (or refresh) a copy of what `op` sent."""
        snap = self.snapshots.get(op)
        if snap is None or snap.shape != sent.shape or snap.dtype != sent.dtype:
            self.snapshots[op] = sent.clone(memory_format=torch.contiguous_format)
        else:
            snap.copy_(sent)

    def index_buffer(self, n: int, device: torch.device) -> torch.Tensor:
        if self._index_buf is None or self._index_buf.numel() < n or self._index_buf.device != device:
            self._index_buf = torch.empty(max(n, 1), dtype=torch.int32, device=device)
        return self._index_buf


class BucketDelta:
    """Tallies of one delta sync on this rank (receiver side for changed/considered; both sides for bytes)."""

    def __init__(self) -> None:
        self.received = self.sent = self.control = self.peak = 0
        self.considered = self.changed = 0
        self.sparse_ops = self.dense_ops = 0


def _message_sizes(ops_counts, elem: int) -> tuple[int, int]:
    """(value elements, index elements) of one peer's message, from its ops and their change counts."""
    nv = ni = 0
    for op, count in ops_counts:
        v, i = payload_elems(count, op.nbytes // elem, elem)
        nv, ni = nv + v, ni + i
    return nv, ni


def _diff(send_ops, piece_of, state: DeltaState, elem: int, device: torch.device):
    """Sender side: per destination, [(op, current piece, change mask or None for a full send, count)] and the
    int64 counts tensor that tells the receiver every op's kind and size."""
    diffs: dict[int, list] = {}
    counts: dict[int, torch.Tensor] = {}
    for dst, ops in send_ops.items():
        if not state.pair_ready.get(dst, False):
            diffs[dst] = [(op, piece_of(op), None, op.nbytes // elem) for op in ops]
            counts[dst] = torch.tensor([d[3] for d in diffs[dst]], dtype=torch.int64, device=device)
            continue
        masks = [(op, cur, changed_mask(cur, state.snapshots[op])) for op in ops for cur in [piece_of(op)]]
        counts[dst] = torch.stack([m.sum() for _, _, m in masks]).to(torch.int64)  # no host sync per op
        diffs[dst] = [(op, cur, m, c) for (op, cur, m), c in zip(masks, counts[dst].tolist())]
    return diffs, counts


def exchange_bucket(
    send_ops: dict[int, list[TransferOp]],
    recv_ops: dict[int, list[TransferOp]],
    piece_of: Callable[[TransferOp], torch.Tensor],
    target_of: Callable[[TransferOp], torch.Tensor],
    written: Callable[[TransferOp], None],
    state: DeltaState,
    workspace: torch.Tensor,
    transport: Transport,
    tally: BucketDelta,
) -> None:
    """Delta exchange of one bucket's remote ops (point-to-point with the peers of this rank in the bucket).

    Ops to a peer that is not `state.pair_ready` are sent whole (count = numel, hence dense) and snapshotted.

    send_ops / recv_ops: this rank's remote ops by peer, peers sorted (the order messages are posted in).
    piece_of(op): this rank's current source view of a send op; target_of(op): the destination view of a receive
    op (holding the previous sync's values); written(op): called once each receive op is applied.
    `workspace`: the executor's flat buffer in the weights' dtype, large enough for the bucket's dense traffic.
    """
    device, elem = workspace.device, workspace.element_size()
    # Round 1: change counts per op.
    diffs, send_counts = _diff(send_ops, piece_of, state, elem, device)
    recv_counts = {src: torch.empty(len(ops), dtype=torch.int64, device=device) for src, ops in recv_ops.items()}
    exchange(transport, [Message(d, c) for d, c in send_counts.items()],
             [Message(s, c) for s, c in recv_counts.items()])
    tally.control += sum(c.numel() * 8 for c in recv_counts.values())

    # Round 2: payloads, sized from the counts on both sides.
    recv_list = {src: list(zip(ops, recv_counts[src].tolist())) for src, ops in recv_ops.items()}
    send_sizes = {dst: _message_sizes([(d[0], d[3]) for d in ds], elem) for dst, ds in diffs.items()}
    recv_sizes = {src: _message_sizes(oc, elem) for src, oc in recv_list.items()}
    index_buf = state.index_buffer(sum(s[1] for s in (*send_sizes.values(), *recv_sizes.values())), device)
    sends, recvs, vcur, icur = [], [], 0, 0
    for dst, ds in diffs.items():
        vbeg, ibeg = vcur, icur
        for op, cur, mask, count in ds:
            kind = wire_kind(count, cur.numel(), elem)
            v, i = payload_elems(count, cur.numel(), elem)
            pack(cur, mask, kind, workspace[vcur : vcur + v], index_buf[icur : icur + i])
            if mask is None:
                state.remember(op, cur)
            else:
                update_snapshot(state.snapshots[op], cur, mask, kind)
            vcur, icur = vcur + v, icur + i
        sends += [Message(dst, workspace[vbeg:vcur], tag=0)] if vcur > vbeg else []
        sends += [Message(dst, index_buf[ibeg:icur], tag=1)] if icur > ibeg else []
        tally.sent += (vcur - vbeg) * elem + (icur - ibeg) * INDEX_BYTES
    recv_bufs = {}
    for src, (nv, ni) in recv_sizes.items():
        recv_bufs[src] = (workspace[vcur : vcur + nv], index_buf[icur : icur + ni])
        recvs += [Message(src, recv_bufs[src][0], tag=0)] if nv else []
        recvs += [Message(src, recv_bufs[src][1], tag=1)] if ni else []
        vcur, icur = vcur + nv, icur + ni
        tally.received += nv * elem + ni * INDEX_BYTES
    mask_bytes = sum(m.numel() for ds in diffs.values() for _, _, m, _ in ds if m is not None)  # bool: 1 B each
    tally.peak = max(tally.peak, vcur * elem + icur * INDEX_BYTES + mask_bytes
                     + 8 * sum(c.numel() for c in (*send_counts.values(), *recv_counts.values())))
    exchange(transport, sends, recvs)

    for src, oc in recv_list.items():
        vals, idx = recv_bufs[src]
        vo = io = 0
        for op, count in oc:
            numel = op.nbytes // elem
            kind = wire_kind(count, numel, elem)
            v, i = payload_elems(count, numel, elem)
            unpack(target_of(op), kind, vals[vo : vo + v], idx[io : io + i])
            vo, io = vo + v, io + i
            tally.considered += numel
            tally.changed += count
            tally.sparse_ops += kind == SPARSE
            tally.dense_ops += kind == DENSE
            written(op)
