"""The reshard executor on 4 gloo ranks with real megatron-core: Megatron shards loaded from one tiny HF model are
resharded into every inference layout; each vLLM shard must equal the HF-layout slice exactly, bytes received must
equal the planner's lower bound, and the naive gather-then-slice baseline must produce the same tensors.

Training layouts TP1PP1, TP2, PP2, DP2, TP2PP2 x inference TP 1 and 2 (every pair that fits in 4 ranks), run side by
side in one world (roles with rank offsets).

Across pools (the same world, afterwards): training ranks that only send and rollout ranks that only receive (no
Megatron weights, a `DictSink`), over a bridge group whose ranks put the training pool first
(`new_group(..., sort_ranks=False)`), so a bridge rank may differ from the global rank; verification on. The
reference is the same HF-slice reference as above. A byte flipped on the way into a rollout rank is refused there
against the checksum its training-side sender computed.
"""

from __future__ import annotations

import pytest
import torch

from megarl.platform.spawn import run_ranks
from tests.distributed.harness import group_by_case, tiny_qwen2_dir

# (name, tp, pp, dp, infer_tp, rank_offset), grouped in phases that run concurrently
PHASES = [
    [("tp2->i2", 2, 1, 1, 2, 0), ("pp2->i2", 1, 2, 1, 2, 2)],
    [("tp2->i1", 2, 1, 1, 1, 0), ("pp2->i1", 1, 2, 1, 1, 2)],
    [("dp2->i2", 1, 1, 2, 2, 0), ("dp2->i1", 1, 1, 2, 1, 2)],
    [("tp2pp2->i2", 2, 2, 1, 2, 0)],
    [("tp2pp2->i1", 2, 2, 1, 1, 0)],
    [("tp1pp1->i1", 1, 1, 1, 1, 0), ("tp1pp1'->i1", 1, 1, 1, 1, 1)],
]
CASES = [case for phase in PHASES for case in phase]

# (name, train tp, train pp, global ranks of the training pool, rollout tp, engines, global ranks of the rollout
# pool); the bridge numbers the training pool 0.. then the rollout pool
DISAGGREGATED = [
    ("x:tp2->2 engines tp1", 2, 1, (0, 1), 1, 2, (2, 3)),
    ("x:tp2->tp2", 2, 1, (0, 1), 2, 1, (2, 3)),
    ("x:pp2 on 2,3->tp2 on 0,1", 1, 2, (2, 3), 2, 1, (0, 1)),  # bridge [2, 3, 0, 1]: bridge rank != global rank
    ("x:tp2 on 1,2->tp1 on 3", 2, 1, (1, 2), 1, 1, (3,)),  # a 3-rank bridge: global 1, 2, 3 are bridge 0, 1, 2
]


def _expected_shards(hf_dir, spec, infer_tp, infer_rank):
    from megarl.checkpoint.hf_io import HFReader
    from megarl.reshard.layouts import vllm_needs, vllm_param_shapes

    reader = HFReader(hf_dir)
    out = {name: torch.zeros(shape) for name, shape in vllm_param_shapes(spec, infer_tp, infer_rank).items()}
    for p in vllm_needs(spec, infer_tp, infer_rank):
        full = reader.read(p.piece.hf_name, None, 0, 0)
        out[p.param].narrow(p.piece.dim, p.offset, p.piece.length).copy_(
            full.narrow(p.piece.dim, p.piece.start, p.piece.length)
        )
    return out


def _worker(rank, world_size, hf_dir):
    from megarl.checkpoint.engine_io import load_hf_into_engine
    from megarl.checkpoint.hf_io import HFReader
    from megarl.engine.megatron_engine import MegatronEngine
    from megarl.parallel.groups import build_role_groups
    from megarl.parallel.topology import RoleTopology
    from megarl.reshard.executor import DictSink, execute_reshard
    from megarl.reshard.naive import naive_reshard
    from megarl.reshard.planner import plan_reshard
    from megarl.reshard.sources import megatron_sources

    spec = HFReader(hf_dir).spec
    results = {}
    for phase in PHASES:
        built = [(case, build_role_groups(RoleTopology(tp=c[1], pp=c[2], dp=c[3], rank_offset=c[5])))
                 for case in phase for c in [case]]
        for (name, _tp, _pp, _dp, infer_tp, _offset), groups in built:
            if not groups.is_member:
                continue
            engine = MegatronEngine(spec, groups, optimizer=None)
            load_hf_into_engine(engine, hf_dir)
            plan = plan_reshard(spec, groups.topology, infer_tp, dtype_bytes=4)
            sources = megatron_sources(engine)
            sink = DictSink()
            report = execute_reshard(plan, sources, sink, bucket_bytes=64 << 10)
            naive_sink = DictSink()
            naive_reshard(plan, groups, sources, naive_sink)
            expected = _expected_shards(hf_dir, spec, infer_tp, plan.infer_rank_of[rank])
            mismatched = [k for k in expected if not torch.equal(expected[k], sink.tensors.get(k, torch.empty(0)))]
            naive_mismatch = [
                k for k in expected if not torch.equal(expected[k], naive_sink.tensors.get(k, torch.empty(0)))
            ]
            results[name] = {
                "report": report, "mismatched": mismatched, "naive_mismatched": naive_mismatch,
                "params": len(expected), "committed": len(set(sink.committed)),
                "bucket_bytes": 64 << 10,
            }
    results.update(_disaggregated(rank, hf_dir, spec))
    return results


def _disaggregated(rank, hf_dir, spec):
    """The cross-pool cases on this rank: {case: what this rank sent / received and whether it matches}."""
    import torch.distributed as dist

    from megarl.checkpoint.engine_io import load_hf_into_engine
    from megarl.engine.megatron_engine import MegatronEngine
    from megarl.parallel.groups import build_role_groups
    from megarl.parallel.topology import RoleTopology
    from megarl.reshard.executor import DictSink, execute_reshard
    from megarl.reshard.layouts import InferLayout
    from megarl.reshard.planner import plan_reshard
    from megarl.reshard.sources import megatron_sources
    from megarl.reshard.transport import TorchP2PTransport
    from megarl.reshard.verify import ReshardVerificationError
    from tests.distributed.test_reshard_verify import FlipFirstPayloadByte

    results = {}
    for name, tp, pp, train_ranks, infer_tp, engines, infer_ranks in DISAGGREGATED:
        bridge_ranks = list(train_ranks) + list(infer_ranks)
        bridge = dist.new_group(bridge_ranks, sort_ranks=False)  # collective over the world, like the role groups
        groups = build_role_groups(RoleTopology(tp=tp, pp=pp, rank_offset=train_ranks[0]))
        if rank not in bridge_ranks:
            continue
        me = bridge_ranks.index(rank)  # this test's own bookkeeping; the executor reads it from the group
        train = RoleTopology(tp=tp, pp=pp)  # bridge numbering: the training pool first
        plan = plan_reshard(spec, train, InferLayout(infer_tp, engines, rank_offset=len(train_ranks)), dtype_bytes=4)
        sources, sink = {}, None
        if groups.is_member:
            engine = MegatronEngine(spec, groups, optimizer=None)
            load_hf_into_engine(engine, hf_dir)
            sources = megatron_sources(engine)
        else:
            sink = DictSink()
        report = execute_reshard(plan, sources, sink, bucket_bytes=64 << 10, group=bridge, dtype=torch.float32)
        out = {"bridge_rank": me, "report": report, "planned": next(s for s in plan.stats if s.rank == me)}
        if sink is not None:
            # vLLM's external launcher: TP rank = position in the engine's block of infer_tp ranks (not the plan's)
            expected = _expected_shards(hf_dir, spec, infer_tp, (me - len(train_ranks)) % infer_tp)
            out["mismatched"] = [k for k in expected
                                 if not torch.equal(expected[k], sink.tensors.get(k, torch.empty(0)))]
            out["params"], out["committed"] = len(expected), len(set(sink.committed))
        if name == "x:tp2->2 engines tp1":
            # a flipped byte from bridge rank 0 into bridge rank 3 (one bucket: every message already in flight)
            transport = TorchP2PTransport(bridge)
            if me == 3:
                transport = FlipFirstPayloadByte(transport, src=0)
            try:
                execute_reshard(plan, sources, DictSink() if sink is not None else None, bucket_bytes=1 << 40,
                                group=bridge, transport=transport, dtype=torch.float32)
                out["flip_error"] = None
            except ReshardVerificationError as e:
                out["flip_error"] = str(e)
        results[name] = out
    return results


@pytest.fixture(scope="module")
def reshard_runs(tmp_path_factory):
    return group_by_case(run_ranks(4, _worker, tiny_qwen2_dir(tmp_path_factory), timeout_s=900))


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_every_vllm_shard_equals_the_hf_slice(reshard_runs, case):
    runs = reshard_runs[case]
    for r in runs:
        assert r["mismatched"] == [], f"{case}: wrong shards on rank {r['report'].rank}: {r['mismatched'][:5]}"
        assert r["committed"] == r["params"], f"{case}: not every vLLM parameter was committed"


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_naive_baseline_agrees(reshard_runs, case):
    for r in reshard_runs[case]:
        assert r["naive_mismatched"] == []


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_bytes_received_equal_lower_bound_within_one_bucket_of_memory(reshard_runs, case):
    for r in reshard_runs[case]:
        rep = r["report"]
        assert rep.bytes_received == rep.bytes_lower_bound
        assert rep.bytes_received <= rep.bytes_naive
        if case.endswith("i2") and rep.bytes_naive:
            assert rep.bytes_received < rep.bytes_naive
        # staging never exceeds one bucket (the largest single shard here, gate_up at infer TP1, is 256 KiB:
        # it may travel alone, received by one rank while that rank sends its own half)
        assert rep.peak_extra_bytes <= max(r["bucket_bytes"], 2 * 256 * 128 * 4)


@pytest.mark.parametrize("case", [c[0] for c in DISAGGREGATED])
def test_across_pools_every_rollout_shard_equals_the_hf_slice(reshard_runs, case):
    _name, _tp, _pp, train_ranks, _infer_tp, _engines, infer_ranks = next(c for c in DISAGGREGATED if c[0] == case)
    runs = reshard_runs[case]
    bridge_ranks = list(train_ranks) + list(infer_ranks)  # runs come in global rank order
    assert [r["bridge_rank"] for r in runs] == [bridge_ranks.index(g) for g in sorted(bridge_ranks)]
    for r in runs:
        rep, planned = r["report"], r["planned"]
        if r["bridge_rank"] < len(train_ranks):  # a training rank: it only sends, what the plan says
            assert rep.bytes_received == rep.bytes_local == 0 and rep.bytes_sent == planned.bytes_sent > 0
            assert "mismatched" not in r
            continue
        assert r["mismatched"] == [], f"{case}: wrong shards on bridge rank {r['bridge_rank']}: {r['mismatched'][:5]}"
        assert r["committed"] == r["params"]
        # it holds nothing: it receives its whole shard, the lower bound, and checks every piece it got
        assert rep.bytes_sent == rep.bytes_local == 0
        assert rep.bytes_received == rep.bytes_lower_bound == planned.bytes_received > 0
        assert rep.verified_pieces > 0
    assert sum(r["report"].bytes_sent for r in runs) == sum(r["report"].bytes_received for r in runs)


def test_across_pools_a_flipped_byte_is_refused_by_the_rollout_rank(reshard_runs):
    by_bridge = {r["bridge_rank"]: r for r in reshard_runs["x:tp2->2 engines tp1"]}
    assert by_bridge[0]["flip_error"] is None and by_bridge[1]["flip_error"] is None  # senders verify nothing
    assert by_bridge[2]["flip_error"] is None
    err = by_bridge[3]["flip_error"]
    assert err is not None, "a flipped byte went through cross-pool verification"
    assert "inference TP rank 0 (bridge rank 3)" in err and "from source rank 0" in err
