"""Reshard executor: runs a `ReshardPlan` on this rank, bucket by bucket, and reports what it moved.

Data path on each rank:
  Megatron parameter tensors (this rank's shards, keyed by canonical Megatron name)
    -> local ops: `narrow` + copy straight into the destination;
    -> remote ops: per (src, dst) pair in a bucket, the pieces are packed into one contiguous send buffer,
       exchanged in one `post`/`wait` of the reshard `Transport` (default: batched isend/irecv over gloo on CPU,
       NCCL on GPU, `megarl.reshard.transport`), and unpacked on the receiving side
  -> the destination tensor of each vLLM parameter, obtained from a `WeightSink`: on GPU the engine's own parameter
     (written in place), on the CPU build a staging tensor the sink hands to vLLM's weight-reload path once complete.

Buckets: (destination rank, vLLM parameter) units in the plan's order (identical on every rank) are grouped while
every rank's send plus receive bytes in the bucket stay within `bucket_bytes`, so a rank's communication buffers
never exceed one bucket (a single parameter shard larger than the bucket travels alone). No rank ever
materialises a full TP-sharded parameter: it only holds its Megatron shards and the vLLM shards it needs.

Ranks: every rank in the plan is a bridge rank (`planner` module docstring): the rank of the process in the
process group passed as `group` (the bridge: a group over the union of the training and the rollout pool, in the
order training ranks first; gloo on CPU, NCCL on GPU), or its global rank when `group` is None. The transport maps
peers to the group's ranks itself (`TorchP2PTransport`), so nothing here takes `dist.get_rank()` for a plan rank.
A rank runs its part only: a training rank outside the inference ranks only sends (no sink), an inference rank
outside the training ranks only receives (no sources; pass `dtype`), a colocated rank does both.

Verification (default, `verify=True`; `rollout.verify_sync`): each bucket's written slices are checked against
checksums the sources computed (`megarl.reshard.verify`) before any parameter of the bucket is committed.

Delta mode (opt-in, `delta=DeltaState()`): after a first full sync, remote ops move only the elements that changed
since the last sync (indices + values, or dense when that is cheaper); see `megarl.reshard.delta`.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from typing import Optional, Protocol

import torch
import torch.distributed as dist

from megarl.config.schema import DEFAULT_RESHARD_BUCKET_MB
from megarl.reshard.delta import BucketDelta, DeltaState, exchange_bucket
from megarl.reshard.layouts import vllm_needs, vllm_param_shapes
from megarl.reshard.planner import ReshardPlan, TransferOp
from megarl.reshard.transport import Message, TorchP2PTransport, Transport, exchange
from megarl.reshard.verify import check_written, local_checksum, post_checksums

# One bucket bound for the trainer (`rollout.reshard_bucket_mb`), the executor and the benchmark: 512 MiB of send +
# receive per rank and bucket, i.e. at most that much extra memory (the workspace) beside the weights.
DEFAULT_BUCKET_BYTES = DEFAULT_RESHARD_BUCKET_MB << 20


class WeightSink(Protocol):
    """Where resharded weights go on an inference rank."""

    def target(self, param: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The tensor to write this rank's shard of vLLM parameter `param` into (shape = the shard's shape)."""

    def commit(self, param: str) -> None:
        """Every piece of `param` has been written to its target."""

    def finish(self) -> None:
        """The reshard is complete (e.g. reset the prefix cache)."""

    # Optional attribute `keeps_targets: bool`: True when `target` returns the tensor holding what was committed for
    # `param` at the previous reshard (required by delta mode, which writes only the changed elements).


class DictSink:
    """A sink that keeps each vLLM shard as a plain tensor (tests, benchmarks, the naive baseline).

    `persistent=True` hands back the same tensors at every reshard (needed by delta mode); otherwise each reshard
    writes into fresh tensors.
    """

    def __init__(self, device: Optional[torch.device] = None, persistent: bool = False) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.committed: list[str] = []
        self.device = device
        self.keeps_targets = persistent

    def target(self, param, shape, dtype):
        old = self.tensors.get(param)
        if not (self.keeps_targets and old is not None and old.shape == tuple(shape) and old.dtype == dtype):
            self.tensors[param] = torch.zeros(shape, dtype=dtype, device=self.device)
        return self.tensors[param]

    def commit(self, param):
        self.committed.append(param)

    def finish(self):
        pass


@dataclasses.dataclass(frozen=True)
class ReshardReport:
    """What one reshard did on this rank (bytes; seconds).

    bytes_received / bytes_local / bytes_lower_bound / bytes_plan_remote / bytes_naive: see `planner.RankStats`
        (`bytes_lower_bound` is computed from the layouts alone: a plan that received more would show here).
    peak_extra_bytes: largest sum of this rank's send and receive bytes in one bucket: the used part of the one
        workspace buffer the executor adds on top of the Megatron shards and the destination tensors (the buffer is
        kept between reshards; `release_workspace()` frees it). In delta mode it includes indices and counts.

    Delta mode (`delta=DeltaState()`; outside it the fields keep their defaults):
    bytes_received / bytes_sent: payload actually moved (int32 indices + values); `bytes_lower_bound` stays the
        dense lower bound, so the saving is `1 - bytes_received / bytes_lower_bound`.
    bytes_control: the per-op int64 change counts this rank received (8 bytes per remote op received).
    delta_elements / delta_changed: elements of the remote ops this rank received / how many had changed.
    delta_changed_fraction: delta_changed / delta_elements (1.0 on a full sync, 0.0 when nothing was received).
    delta_sparse_ops / delta_dense_ops: remote ops received as indices + values / as every value.
    verify_time_s: seconds this rank spent checksumming and comparing (`verify=True`), included in `time_s`.
    verified_pieces: shard pieces this rank checked against their source's checksum (0 with `verify=False`).
    delta_sync: 1.0 when deltas flowed with every peer of this rank, 0.0 when some pair synced in full (first sync,
        after `reset()` on either side); ops of a full pair count as dense ops with every element changed.
    """

    rank: int
    bytes_received: int
    bytes_sent: int
    bytes_local: int
    bytes_lower_bound: int
    bytes_naive: int
    peak_extra_bytes: int
    buckets: int
    time_s: float
    bytes_control: int = 0
    delta_elements: int = 0
    delta_changed: int = 0
    delta_changed_fraction: float = 1.0
    delta_sparse_ops: int = 0
    delta_dense_ops: int = 0
    delta_sync: float = 0.0
    bytes_plan_remote: int = 0
    verify_time_s: float = 0.0
    verified_pieces: int = 0

    def as_metrics(self, prefix: str = "reshard/") -> dict[str, float]:
        return {prefix + k: float(v) for k, v in dataclasses.asdict(self).items() if k != "rank"}


def _buckets(plan: ReshardPlan, bucket_bytes: int) -> list[list[TransferOp]]:
    """Ops grouped into buckets (identical on every rank: computed from the plan alone).

    A unit is one vLLM parameter on one destination rank; units are added to the current bucket while every rank's
    send plus receive bytes in the bucket stay within `bucket_bytes`. A unit larger than that travels alone.
    """
    units: dict[tuple[int, str], list[TransferOp]] = defaultdict(list)
    for op in plan.ops:
        units[(op.dst, op.dst_param)].append(op)
    buckets: list[list[TransferOp]] = []
    current: list[TransferOp] = []
    load: dict[int, int] = defaultdict(int)
    for ops in units.values():
        unit_load: dict[int, int] = defaultdict(int)
        for op in ops:
            if op.src != op.dst:
                unit_load[op.src] += op.nbytes
                unit_load[op.dst] += op.nbytes
        if current and any(load[r] + b > bucket_bytes for r, b in unit_load.items()):
            buckets.append(current)
            current, load = [], defaultdict(int)
        current.extend(ops)
        for r, b in unit_load.items():
            load[r] += b
    if current:
        buckets.append(current)
    return buckets


_WORKSPACES: dict[tuple, torch.Tensor] = {}


def _workspace(buckets: list[list[TransferOp]], rank: int, dtype: torch.dtype, device: torch.device,
               dtype_bytes: int) -> torch.Tensor:
    """One flat buffer holding this rank's largest bucket (sends + receives), kept for the next reshard."""
    need = 0
    for bucket in buckets:
        moved = sum(op.nbytes for op in bucket if op.src != op.dst and rank in (op.src, op.dst))
        need = max(need, moved // dtype_bytes)
    key = (dtype, str(device))
    buf = _WORKSPACES.get(key)
    if buf is None or buf.numel() < need:
        _WORKSPACES.pop(key, None)
        buf = torch.empty(max(need, 1), dtype=dtype, device=device)
        _WORKSPACES[key] = buf
    return buf


def release_workspace() -> None:
    """Free the cached communication buffer (e.g. before training needs the memory)."""
    _WORKSPACES.clear()


def _slice(t: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    return t.narrow(dim, start, length) if t.dim() > dim else t[start : start + length]


class _Destinations:
    """This rank's vLLM shards being written: targets from the sink, commit once every piece of a parameter landed."""

    def __init__(self, plan: ReshardPlan, rank: int, sink: Optional[WeightSink], dtype: torch.dtype) -> None:
        infer_rank = plan.infer_rank_of.get(rank)  # None: this rank only sends
        self.sink, self.dtype, self.rank = sink, dtype, rank
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.remaining: dict[str, int] = defaultdict(int)
        if infer_rank is not None:
            if sink is None:
                raise ValueError(f"rank {rank} is inference TP rank {infer_rank} of the plan but has no sink")
            self.shapes = vllm_param_shapes(plan.spec, plan.infer_tp, infer_rank, plan.infer_ep)
            for p in vllm_needs(plan.spec, plan.infer_tp, infer_rank, plan.infer_ep):
                self.remaining[p.param] += p.piece.length
        self.targets: dict[str, torch.Tensor] = {}
        self._complete: list[str] = []

    def view(self, op: TransferOp) -> torch.Tensor:
        """The slice of the destination shard `op` writes."""
        if op.dst_param not in self.targets:
            self.targets[op.dst_param] = self.sink.target(op.dst_param, self.shapes[op.dst_param], self.dtype)
        return _slice(self.targets[op.dst_param], op.piece.dim, op.dst_offset, op.piece.length)

    def written(self, op: TransferOp) -> None:
        self.remaining[op.dst_param] -= op.piece.length
        if self.remaining[op.dst_param] == 0:
            self._complete.append(op.dst_param)

    def flush(self) -> None:
        """Commit the parameters completed since the last flush (after the bucket was verified)."""
        for param in self._complete:
            self.sink.commit(param)
            self.targets.pop(param, None)
        self._complete.clear()

    def check_complete(self) -> None:
        unfinished = [n for n, left in self.remaining.items() if left]
        if unfinished:
            raise RuntimeError(f"reshard left vLLM parameters incomplete on rank {self.rank}: {unfinished[:5]}")


def _wire_dtype(plan: ReshardPlan, sources: dict[str, torch.Tensor], rank: int,
                dtype: Optional[torch.dtype] = None) -> torch.dtype:
    """The sources' dtype of the plan's element size (or `dtype` where given). A bf16 engine on the CPU keeps its
    norms in fp32 (megatron-core's torch-norm fallback); they are cast on the way, so every rank agrees. A rank
    without sources (it only receives) takes `dtype`, or float32 for a 4-byte plan."""
    if dtype is not None:
        if torch.empty(0, dtype=dtype).element_size() != plan.dtype_bytes:
            raise ValueError(f"dtype={dtype} does not have the plan's {plan.dtype_bytes}-byte elements")
        return dtype
    found = next((t.dtype for t in sources.values() if t.element_size() == plan.dtype_bytes), None)
    if sources and found is None:
        raise ValueError(
            f"plan was built for {plan.dtype_bytes}-byte elements but the Megatron weights are "
            f"{sorted({str(t.dtype) for t in sources.values()})}"
        )
    if found is None and plan.dtype_bytes != 4:
        raise ValueError(f"rank {rank} has no Megatron sources (it only receives): pass the wire dtype of the "
                         f"{plan.dtype_bytes}-byte plan, e.g. execute_reshard(..., dtype=torch.bfloat16)")
    return found or torch.float32


def _split(bucket: list[TransferOp], rank: int):
    """(local ops, remote sends by destination, remote receives by source) of this rank in `bucket`."""
    local: list[TransferOp] = []
    send_ops: dict[int, list[TransferOp]] = defaultdict(list)
    recv_ops: dict[int, list[TransferOp]] = defaultdict(list)
    for op in bucket:
        if op.src == rank and op.dst == rank:
            local.append(op)
        elif op.src == rank:
            send_ops[op.dst].append(op)
        elif op.dst == rank:
            recv_ops[op.src].append(op)
    return local, dict(sorted(send_ops.items())), dict(sorted(recv_ops.items()))


def _exchange_dense(send_ops, recv_ops, piece_of, dest: _Destinations, workspace: torch.Tensor,
                    transport: Transport) -> tuple[int, int, int]:
    """One bucket's remote ops, every value: pack sends and lay out receives back to back in `workspace` (send +
    receive <= one bucket), one message per peer, unpack. Returns (bytes sent, bytes received, workspace bytes)."""
    elem = workspace.element_size()
    sends, recvs, cursor = [], [], 0
    for dst, ops in send_ops.items():
        begin = cursor
        for op in ops:
            src = piece_of(op)
            workspace[cursor : cursor + src.numel()].view(src.shape).copy_(src)
            cursor += src.numel()
        sends.append(Message(dst, workspace[begin:cursor]))
    sent = cursor * elem
    for src_rank, ops in recv_ops.items():
        n = sum(op.nbytes for op in ops) // elem
        recvs.append(Message(src_rank, workspace[cursor : cursor + n]))
        cursor += n
    exchange(transport, sends, recvs)
    received = 0
    for msg in recvs:
        offset = 0
        for op in recv_ops[msg.peer]:
            dst_view = dest.view(op)
            dst_view.copy_(msg.tensor[offset : offset + dst_view.numel()].view(dst_view.shape))
            offset += dst_view.numel()
            received += op.nbytes
            dest.written(op)
    return sent, received, cursor * elem


def bridge_rank(plan: ReshardPlan, group: Optional[dist.ProcessGroup] = None) -> int:
    """This process's rank in the plan: its rank in `group` (the bridge), or its global rank when `group` is None
    (a colocated plan in the default world); the plan's first training rank without torch.distributed."""
    if not dist.is_initialized():
        return plan.train.rank_offset
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"global rank {dist.get_rank()} is not a member of the reshard's bridge group")
    return rank


@torch.no_grad()
def execute_reshard(
    plan: ReshardPlan,
    sources: dict[str, torch.Tensor],
    sink: Optional[WeightSink],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    group: Optional[dist.ProcessGroup] = None,
    device: Optional[torch.device] = None,
    delta: Optional[DeltaState] = None,
    transport: Optional[Transport] = None,
    verify: bool = True,
    rank: Optional[int] = None,
    dtype: Optional[torch.dtype] = None,
) -> ReshardReport:
    """Run `plan` on this rank. Collective over the plan's ranks (every rank of `plan.ranks` calls it with the same
    plan; point-to-point only, so bridge ranks outside the plan need not call it).

    Args:
        plan: from `plan_reshard` (same on every rank).
        sources: this rank's Megatron parameter tensors by canonical Megatron name (`megatron_sources(engine)`);
            {} on a rank that only receives.
        sink: destination of this rank's vLLM shards; None on a rank that only sends.
        bucket_bytes: bound on the bytes one bucket moves between ranks (send + receive per rank);
            default `DEFAULT_BUCKET_BYTES` (= `rollout.reshard_bucket_mb`'s default).
        group: the bridge: a process group over the plan's ranks whose group ranks are the plan's ranks (colocated:
            the actor's group or None = the default world, whose ranks are global ranks). Used for this rank's
            plan rank and to build the default transport.
        device: device of the communication buffers (default: the sources' device).
        delta: opt-in delta mode: the same `DeltaState` at every call; the first call (and any after `reset()`)
            is a full sync that takes snapshots, later ones send only changed elements. Needs a sink whose targets
            persist (`keeps_targets`).
        transport: how buffers travel (default `TorchP2PTransport(group)`).
        verify: check every written piece against its source's checksum (`megarl.reshard.verify`; raises
            `ReshardVerificationError` naming parameter and ranks, before the bucket is committed). Across pools
            the receiving rank checks what it got against the checksums its senders computed.
        rank: this process's plan (bridge) rank; default its rank in `group` (`bridge_rank`).
        dtype: the wire dtype; default the sources' dtype of the plan's element size. Required on a rank without
            sources for a 2-byte plan (bf16 or fp16 cannot be told apart from the plan).
    """
    rank_kind = "global rank" if group is None and rank is None else "bridge rank"  # for verification errors
    rank = bridge_rank(plan, group) if rank is None else rank
    if rank not in plan.ranks:
        raise ValueError(f"rank {rank} is neither a training rank ({plan.train.ranks.start}.."
                         f"{plan.train.ranks.stop - 1}) nor an inference rank ({plan.infer.describe()}) of the plan")
    start_time = time.perf_counter()
    dtype = _wire_dtype(plan, sources, rank, dtype)
    device = device or (next(iter(sources.values())).device if sources else torch.device("cpu"))
    if delta is not None and not getattr(sink, "keeps_targets", False):
        raise ValueError(
            f"delta mode needs a sink whose targets persist between reshards; {type(sink).__name__} does not "
            "(use DictSink(persistent=True) or VllmShardSink(engine, persistent=True))"
        )
    transport = transport or TorchP2PTransport(group)
    transport.begin()
    dest = _Destinations(plan, rank, sink, dtype)

    def piece_of(op: TransferOp) -> torch.Tensor:
        return _slice(sources[op.src_param], op.piece.dim, op.src_offset, op.piece.length)

    received = sent = local = peak = verified = 0
    verify_s = 0.0
    infer_rank = plan.infer_rank_of.get(rank)
    buckets = _buckets(plan, bucket_bytes)
    workspace = _workspace(buckets, rank, dtype, device, plan.dtype_bytes)
    delta_sync = delta.begin(plan, rank, transport, device) if delta is not None else False
    tally = BucketDelta()
    for bucket in buckets:
        local_ops, send_ops, recv_ops = _split(bucket, rank)
        expected, expected_local = {}, {}
        for op in local_ops:
            src = piece_of(op)
            dest.view(op).copy_(src)
            local += op.nbytes
            dest.written(op)
            if verify and (dtype is None or src.dtype == dtype):  # the slice itself (a view, no copy), compared
                expected_local[op] = src  # bit for bit once the bucket is written (`check_written`)
            elif verify:  # a cast: its checksum, not a kept copy (the local ops of a bucket are not bounded)
                t0 = time.perf_counter()
                expected[op] = local_checksum(src, dtype)
                verify_s += time.perf_counter() - t0
        if verify:
            t0 = time.perf_counter()
            sums_pending, remote_sums = post_checksums(send_ops, recv_ops, piece_of, dtype, transport, device)
            verify_s += time.perf_counter() - t0
        if delta is not None:
            exchange_bucket(send_ops, recv_ops, piece_of, dest.view, dest.written, delta, workspace, transport, tally)
        else:
            s, r, used = _exchange_dense(send_ops, recv_ops, piece_of, dest, workspace, transport)
            sent, received, peak = sent + s, received + r, max(peak, used)
        if verify:
            t0 = time.perf_counter()
            sums_pending.wait()
            expected.update(remote_sums)
            check_written(expected, dest.view, rank, infer_rank, rank_kind, local=expected_local)
            verified += len(expected) + len(expected_local)
            verify_s += time.perf_counter() - t0
        dest.flush()
    dest.check_complete()
    if sink is not None:
        sink.finish()
    stats = next(s for s in plan.stats if s.rank == rank)
    report = ReshardReport(
        rank=rank, bytes_received=received, bytes_sent=sent, bytes_local=local,
        bytes_lower_bound=stats.bytes_lower_bound, bytes_naive=stats.bytes_naive,
        peak_extra_bytes=peak, buckets=len(buckets), time_s=time.perf_counter() - start_time,
        bytes_plan_remote=stats.bytes_plan_remote, verify_time_s=verify_s, verified_pieces=verified,
    )
    if delta is None:
        return report
    delta.end()
    return dataclasses.replace(
        report, bytes_received=tally.received, bytes_sent=tally.sent, bytes_control=tally.control,
        peak_extra_bytes=tally.peak, delta_elements=tally.considered, delta_changed=tally.changed,
        delta_changed_fraction=tally.changed / tally.considered if tally.considered else float(not delta_sync),
        delta_sparse_ops=tally.sparse_ops, delta_dense_ops=tally.dense_ops, delta_sync=float(delta_sync),
    )
