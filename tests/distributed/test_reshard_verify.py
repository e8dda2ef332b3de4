"""Per-sync verification on 2 gloo ranks with real megatron-core (PP2 -> infer TP2: both ranks send and receive).

A clean reshard verifies every piece; a byte flipped by the transport on the way, (delta mode) a receiver shard
changed behind the executor's back, and a local piece overwritten by a later write (a sink whose targets alias) are
all refused with the vLLM parameter, the inference rank and the source rank in the message. The corrupted piece is
chosen by the test, from the plan's order of ops.
"""

from __future__ import annotations

import pytest
import torch

from megarl.platform.spawn import run_ranks
from tests.distributed.harness import tiny_qwen2_dir

ONE_BUCKET = 1 << 40  # every op in one bucket: the first message from a peer starts with its first op in plan order


class FlipFirstPayloadByte:
    """A `Transport` wrapper flipping one bit of the first payload (tag 0) this rank receives from `src`: bit 6 of
    the first element's top byte in fp32 (an exponent bit)."""

    def __init__(self, inner, src: int) -> None:
        self.inner, self.src, self.done = inner, src, False

    def begin(self):
        self.inner.begin()

    def post(self, sends, recvs):
        pending = self.inner.post(sends, recvs)
        target = next((m for m in recvs if m.peer == self.src and m.tag == 0 and m.tensor.numel()), None)
        outer = self

        class _Flip:
            def wait(self):
                pending.wait()
                if target is not None and not outer.done:
                    target.tensor.view(torch.uint8)[3] ^= 0x40
                    outer.done = True

        return _Flip()


def _alias_sink(plan, rank):
    """A `DictSink` whose target for layer 1's o_proj shard (received from the peer) is layer 0's (copied locally on
    this rank): the receive, which comes after the local copies, overwrites the local piece. -> (sink, local param)."""
    from megarl.reshard.executor import DictSink

    local = next(op.dst_param for op in plan.ops
                 if op.src == op.dst == rank and "layers.0." in op.dst_param and "o_proj" in op.dst_param)
    remote = local.replace("layers.0.", "layers.1.")
    assert any(op.dst == rank and op.src != rank and op.dst_param == remote for op in plan.ops)

    class AliasSink(DictSink):
        def target(self, param, shape, dtype):
            if param == remote:
                return self.tensors[local]  # written first (local ops precede the exchange)
            return super().target(param, shape, dtype)

    return AliasSink(), local


def _worker(rank, world_size, hf_dir):
    from megarl.checkpoint.engine_io import load_hf_into_engine
    from megarl.checkpoint.hf_io import HFReader
    from megarl.parallel.groups import build_role_groups
    from megarl.parallel.topology import RoleTopology
    from megarl.reshard.delta import DeltaState
    from megarl.reshard.executor import DictSink, execute_reshard
    from megarl.reshard.planner import plan_reshard
    from megarl.reshard.sources import megatron_sources
    from megarl.reshard.transport import TorchP2PTransport
    from megarl.reshard.verify import ReshardVerificationError

    try:
        from megarl.engine.megatron_engine import MegatronEngine
    except ImportError:  # before the engine package move
        from megarl.engine.megatron_engine import MegatronEngine

    spec = HFReader(hf_dir).spec
    groups = build_role_groups(RoleTopology(pp=2))
    engine = MegatronEngine(spec, groups, optimizer=None)
    load_hf_into_engine(engine, hf_dir)
    sources = megatron_sources(engine)
    plan = plan_reshard(spec, groups.topology, 2, dtype_bytes=4)
    peer = 1 - rank
    first_from_peer = next(op for op in plan.ops if op.src == peer and op.dst == rank)
    out = {"infer_rank": plan.infer_rank_of[rank], "first_from_peer": first_from_peer.dst_param}

    clean = execute_reshard(plan, sources, DictSink(), bucket_bytes=ONE_BUCKET)
    out["clean"] = (clean.verified_pieces, clean.verify_time_s, len([op for op in plan.ops if op.dst == rank]))
    unverified = execute_reshard(plan, sources, DictSink(), bucket_bytes=ONE_BUCKET, verify=False)
    out["unverified"] = unverified.verified_pieces

    # 1. a flipped byte on the way from the peer (rank 1 corrupts what it receives from rank 0)
    transport = FlipFirstPayloadByte(TorchP2PTransport(), src=0) if rank == 1 else TorchP2PTransport()
    sink = DictSink()
    try:
        execute_reshard(plan, sources, sink, bucket_bytes=ONE_BUCKET, transport=transport)
        out["flip_error"] = None
    except ReshardVerificationError as e:
        out["flip_error"] = str(e)
    out["flip_committed"] = len(sink.committed)
    # the same flip without verification goes through silently
    transport = FlipFirstPayloadByte(TorchP2PTransport(), src=0) if rank == 1 else TorchP2PTransport()
    execute_reshard(plan, sources, DictSink(), bucket_bytes=ONE_BUCKET, transport=transport, verify=False)

    # 2. a local piece overwritten after its copy: rank 0's sink aliases a remote shard onto a local one
    sink, out["alias_local"] = _alias_sink(plan, rank) if rank == 0 else (DictSink(), None)
    try:
        execute_reshard(plan, sources, sink, bucket_bytes=ONE_BUCKET)
        out["alias_error"] = None
    except ReshardVerificationError as e:
        out["alias_error"] = str(e)

    # 3. delta mode: the receiver's persistent shard changed behind the executor's back, then a no-change sync
    state, sink = DeltaState(), DictSink(persistent=True)
    execute_reshard(plan, sources, sink, bucket_bytes=ONE_BUCKET, delta=state)
    quiet = execute_reshard(plan, sources, sink, bucket_bytes=ONE_BUCKET, delta=state)
    out["delta_quiet"] = (quiet.delta_sync, quiet.bytes_received, quiet.verified_pieces)
    if rank == 1:
        op = first_from_peer
        view = sink.tensors[op.dst_param].narrow(op.piece.dim, op.dst_offset, op.piece.length)
        view[(0,) * view.dim()] += 1.0
    try:
        execute_reshard(plan, sources, sink, bucket_bytes=ONE_BUCKET, delta=state)
        out["delta_error"] = None
    except ReshardVerificationError as e:
        out["delta_error"] = str(e)
    return out


@pytest.fixture(scope="module")
def verify_runs(tmp_path_factory):
    return run_ranks(2, _worker, tiny_qwen2_dir(tmp_path_factory), timeout_s=600)


@pytest.mark.slow
def test_clean_reshard_verifies_every_piece(verify_runs):
    for r in verify_runs:
        pieces, seconds, ops_into_rank = r["clean"]
        assert pieces == ops_into_rank > 0 and seconds > 0
        assert r["unverified"] == 0
        assert r["delta_quiet"][0] == 1.0 and r["delta_quiet"][1] == 0  # nothing moved ...
        assert r["delta_quiet"][2] == ops_into_rank  # ... and everything was still checked


@pytest.mark.slow
def test_flipped_byte_is_refused_naming_parameter_and_ranks(verify_runs):
    rank0, rank1 = verify_runs
    assert rank0["flip_error"] is None  # rank 0 received intact data
    err = rank1["flip_error"]
    assert err is not None, "a flipped byte went through verification"
    assert f"inference TP rank {rank1['infer_rank']} (global rank 1)" in err
    assert f"vLLM parameter {rank1['first_from_peer']!r}" in err and "from source rank 0" in err
    assert "1 piece(s) differ" in err
    assert rank1["flip_committed"] == 0  # nothing of the bad bucket reached the sink


@pytest.mark.slow
def test_delta_sync_checks_the_whole_receiver_shard(verify_runs):
    rank0, rank1 = verify_runs
    assert rank0["delta_error"] is None
    err = rank1["delta_error"]
    assert err is not None and f"vLLM parameter {rank1['first_from_peer']!r}" in err and "source rank 0" in err


@pytest.mark.slow
def test_a_local_piece_overwritten_after_its_copy_is_refused(verify_runs):
    """Local pieces are checked bit for bit against their source after the whole bucket (not as they are copied):
    a later write into the same memory is caught, naming the local piece (its source rank is this rank)."""
    rank0, rank1 = verify_runs
    assert rank1["alias_error"] is None
    err = rank0["alias_error"]
    assert err is not None, "a local piece overwritten after its copy went through verification"
    assert f"vLLM parameter {rank0['alias_local']!r}" in err and "from source rank 0" in err
    assert f"inference TP rank {rank0['infer_rank']} (global rank 0)" in err
