"""Delta mode of the reshard executor on 4 gloo ranks with real megatron-core.

Per layout: sync once (full, snapshots taken), perturb the Megatron weights (zero ~10% of the elements of every
parameter, and change every element of the `linear_fc2` weights so those ops must fall back to dense), sync again in
delta mode, then once more with no change, then after `reset()`. Checked: the delta-synced vLLM shards equal a full
reshard (and, in fp32, the naive gather-then-slice) of the same weights exactly; the changed elements the receivers
report equal what the senders actually changed in the pieces they send; bytes received are below the dense lower bound;
the no-change sync moves no payload; `reset()` makes the next sync full.

fp32: TP2PP2 -> infer TP2 on 4 ranks; bf16: TP2 -> infer TP1 and PP2 -> infer TP2 side by side (layouts where ranks
exchange weights; DP2 -> infer TP2 keeps everything local).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from megarl.platform.spawn import run_ranks
from tests.distributed.harness import group_by_case, tiny_qwen2_dir

# (name, tp, pp, dp, infer_tp, rank_offset, dtype), grouped in phases that run concurrently
PHASES = [
    [("fp32 tp2pp2->i2", 2, 2, 1, 2, 0, "fp32")],
    [("bf16 tp2->i1", 2, 1, 1, 1, 0, "bf16"), ("bf16 pp2->i2", 1, 2, 1, 2, 2, "bf16")],
]
CASES = [case for phase in PHASES for case in phase]
ZERO_FRACTION = 0.1


def _perturb(engine, sources):
    """Zero ~10% of each parameter (same mask on TP/DP replicas of replicated tensors) and add 1 to fc2 weights."""
    from megarl.checkpoint.name_map import module_param_layout

    tp_rank = engine.groups.coord.tp
    for name, t in sorted(sources.items()):
        replicated = module_param_layout(engine.spec, name).kind == "replicated"
        g = torch.Generator().manual_seed((zlib.crc32(name.encode()) * 31 + (0 if replicated else tp_rank)) % 2**31)
        if name.endswith("linear_fc2.weight"):
            t.add_(1.0)
        else:
            t[torch.rand(t.shape, generator=g) < ZERO_FRACTION] = 0.0


def _bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _worker(rank, world_size, hf_dir):
    from megarl.checkpoint.engine_io import load_hf_into_engine
    from megarl.checkpoint.hf_io import HFReader
    from megarl.engine.megatron_engine import MegatronEngine
    from megarl.parallel.groups import build_role_groups
    from megarl.parallel.topology import RoleTopology
    from megarl.reshard.delta import DeltaState
    from megarl.reshard.executor import DictSink, _slice, execute_reshard
    from megarl.reshard.naive import naive_reshard
    from megarl.reshard.planner import plan_reshard
    from megarl.reshard.sources import megatron_sources

    spec = HFReader(hf_dir).spec
    bucket = 64 << 10
    results = {}
    for phase in PHASES:
        built = [(case, build_role_groups(RoleTopology(tp=case[1], pp=case[2], dp=case[3], rank_offset=case[5])))
                 for case in phase]
        for (name, _tp, _pp, _dp, infer_tp, _off, dtype), groups in built:
            if not groups.is_member:
                continue
            engine = MegatronEngine(spec, groups, dtype=dtype, optimizer=None, init_weights=False)
            load_hf_into_engine(engine, hf_dir)
            sources = megatron_sources(engine)
            plan = plan_reshard(spec, groups.topology, infer_tp, dtype_bytes=2 if dtype == "bf16" else 4)
            state, sink = DeltaState(), DictSink(persistent=True)

            def check_against_full(plan=plan, sources=sources, groups=groups, dtype=dtype, sink=sink):
                full, naive = DictSink(), DictSink()
                execute_reshard(plan, sources, full, bucket_bytes=bucket)
                if dtype == "fp32":  # naive_reshard assumes one dtype; a CPU bf16 engine keeps fp32 norms
                    naive_reshard(plan, groups, sources, naive)
                return ([k for k in full.tensors if not torch.equal(_bits(full.tensors[k]), _bits(sink.tensors[k]))],
                        [k for k in naive.tensors if not torch.equal(_bits(naive.tensors[k]), _bits(sink.tensors[k]))])

            rep1 = execute_reshard(plan, sources, sink, bucket_bytes=bucket, delta=state)
            before = {k: v.clone() for k, v in sources.items()}
            _perturb(engine, sources)
            # What this rank actually changed in the pieces it sends (sender side, independent of the executor).
            sent_changed = sent_elems = 0
            # Remote ops this rank receives, counted from the plan (not from the executor's tallies): the delta
            # protocol sends one int64 change count per remote op, so 8 bytes of control traffic each per sync.
            recv_remote_ops = sum(1 for op in plan.ops if op.dst == rank and op.src != rank)
            for op in plan.ops:
                if op.src == rank and op.dst != rank:
                    cur = _slice(sources[op.src_param], op.piece.dim, op.src_offset, op.piece.length)
                    old = _slice(before[op.src_param], op.piece.dim, op.src_offset, op.piece.length)
                    sent_changed += int((_bits(cur) != _bits(old)).sum())
                    sent_elems += cur.numel()
            rep2 = execute_reshard(plan, sources, sink, bucket_bytes=bucket, delta=state)
            mismatch2 = check_against_full()
            rep3 = execute_reshard(plan, sources, sink, bucket_bytes=bucket, delta=state)
            mismatch3 = check_against_full()
            state.reset()
            rep4 = execute_reshard(plan, sources, sink, bucket_bytes=bucket, delta=state)
            mismatch4 = check_against_full()
            results[name] = {
                "reports": (rep1, rep2, rep3, rep4), "mismatch": (mismatch2, mismatch3, mismatch4),
                "sent_changed": sent_changed, "sent_elems": sent_elems, "snapshot_bytes": state.snapshot_bytes(),
                "recv_remote_ops": recv_remote_ops,
            }
    return results


@pytest.fixture(scope="module")
def delta_runs(tmp_path_factory):
    return group_by_case(run_ranks(4, _worker, tiny_qwen2_dir(tmp_path_factory), timeout_s=600))


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_delta_synced_shards_equal_full_and_naive_reshard(delta_runs, case):
    for r in delta_runs[case]:
        for step, (vs_full, vs_naive) in zip(("delta", "no change", "after reset"), r["mismatch"]):
            assert vs_full == [] and vs_naive == [], (
                f"{case} rank {r['reports'][0].rank} {step}: {vs_full[:3]} {vs_naive[:3]}"
            )


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_first_sync_is_full_and_reset_makes_the_next_full(delta_runs, case):
    for r in delta_runs[case]:
        rep1, rep2, rep3, rep4 = r["reports"]
        assert (rep1.delta_sync, rep2.delta_sync, rep3.delta_sync, rep4.delta_sync) == (0.0, 1.0, 1.0, 0.0)
        assert rep1.bytes_received == rep1.bytes_lower_bound == rep4.bytes_received
        assert rep1.delta_changed_fraction == 1.0


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_changed_fraction_matches_the_perturbation_and_bytes_drop(delta_runs, case):
    runs = delta_runs[case]
    reported_changed = sum(r["reports"][1].delta_changed for r in runs)
    reported_elems = sum(r["reports"][1].delta_elements for r in runs)
    assert reported_changed == sum(r["sent_changed"] for r in runs)
    assert reported_elems == sum(r["sent_elems"] for r in runs) > 0
    # ~10% zeroed everywhere, fc2 fully changed: strictly between the two
    assert ZERO_FRACTION * 0.8 < reported_changed / reported_elems < 0.6
    elem = 4 if case.startswith("fp32") else 2
    for r in runs:
        rep = r["reports"][1]
        # one int64 count per remote op received (delta.py, round 1), whatever kind the op then travels as
        assert rep.bytes_control == 8 * r["recv_remote_ops"], (case, rep.rank, rep.bytes_control, r["recv_remote_ops"])
        if rep.bytes_lower_bound == 0:
            assert rep.bytes_received == 0
            continue
        assert rep.bytes_received < rep.bytes_lower_bound, f"{case} rank {rep.rank}: {rep}"
        assert rep.delta_sparse_ops > 0
        # payload = dense ops' values + sparse ops' changed values and int32 indices: never above dense
        assert rep.bytes_received <= rep.delta_changed * (elem + 4) + rep.bytes_lower_bound
        assert rep.delta_sparse_ops + rep.delta_dense_ops <= r["recv_remote_ops"]
    assert sum(r["reports"][1].delta_dense_ops for r in runs) > 0, "the fully changed fc2 pieces must go dense"


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_no_change_moves_no_payload(delta_runs, case):
    for r in delta_runs[case]:
        rep = r["reports"][2]
        assert rep.bytes_received == 0 and rep.bytes_sent == 0
        assert rep.delta_changed == 0 and rep.delta_changed_fraction == 0.0
        assert rep.bytes_control == 8 * r["recv_remote_ops"]  # only the per-op counts
        assert rep.delta_sparse_ops == rep.delta_dense_ops == 0
