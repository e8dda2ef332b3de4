"""Reshard benchmark: megarl's planned, bucketed reshard vs. the naive gather-then-slice, in the same run.

    python benchmarks/reshard.py --model-shape 0.5b --train-tp 2 --train-pp 2 --infer-tp 2 [--json FILE]
    python benchmarks/reshard.py --model-shape 7b --dtype bf16 --into-vllm            # on one GPU: refit time
    python benchmarks/reshard.py --simulate --model-shape 70b --train-tp 8 --train-pp 8 --train-dp 4 --infer-tp 8
    python benchmarks/reshard.py --delta --delta-change-fraction 0.1 --model-shape tiny --train-tp 2 --train-pp 2 \
        --infer-tp 2 --dtype bf16
    python benchmarks/reshard.py --disaggregated    # across pools: benchmarks/reshard_disagg.py (its options)

Measured mode starts train_tp*train_pp*train_dp ranks itself (gloo on CPU, NCCL on GPU) unless it is already under
torchrun, builds the Megatron model at the training layout with deterministic weights, and on every rank runs the
planned reshard and the naive baseline `--repeats` times each into plain tensors, checking both give identical
vLLM shards. Reported (JSON): per rank `bytes_received`, `bytes_local`, `bytes_lower_bound`, `bytes_naive`,
`peak_extra_bytes`; overall `weights_exact`, `time_s` and `naive_time_s` (median over repeats of the slowest
rank), their ratio, and the machine.

Simulation mode (`--simulate`) runs only the planner for cluster shapes and prints bytes per rank against naive.
The mixture-of-experts cluster cases (their EP/PP layouts are fixed by the case, beside NeMo-RL's published refit
times) run through `benchmarks/reshard_moe_sim.py`; `--simulate --model-shape qwen3-30b-a3b` (or qwen3-235b-a22b,
deepseek-v3) runs that case from here:

    python benchmarks/reshard.py --simulate --model-shape qwen3-30b-a3b

Delta mode (`--delta`): one full sync into persistent shards, then per repeat: change `--delta-change-fraction` of
every parameter's elements (+1.0, the same elements on replicas), sync in delta mode, and reshard the same weights
in full into fresh tensors (the dense reference: identical shards required); finally one delta sync with no change.
Reported per rank: payload bytes received (indices + values) against the dense lower bound, the changed fraction
the receivers saw, sparse/dense op counts; overall delta, dense and no-change times (median, slowest rank).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megarl.config.schema import DEFAULT_RESHARD_BUCKET_MB  # noqa: E402
from megarl.models.spec import ModelSpec  # noqa: E402

PRESETS = {
    # name: ModelSpec kwargs (shapes of public models; weights are synthetic)
    "tiny": dict(architecture="LlamaForCausalLM", num_layers=4, hidden_size=256, num_attention_heads=8,
                 num_query_groups=4, head_dim=32, ffn_hidden_size=512, vocab_size=1000, max_position_embeddings=512),
    "0.5b": dict(architecture="Qwen2ForCausalLM", num_layers=24, hidden_size=896, num_attention_heads=14,
                 num_query_groups=2, head_dim=64, ffn_hidden_size=4864, vocab_size=151936,
                 max_position_embeddings=32768, qkv_bias=True, tie_word_embeddings=True),
    "7b": dict(architecture="LlamaForCausalLM", num_layers=32, hidden_size=4096, num_attention_heads=32,
               num_query_groups=32, head_dim=128, ffn_hidden_size=11008, vocab_size=32000,
               max_position_embeddings=4096),
    "13b": dict(architecture="LlamaForCausalLM", num_layers=40, hidden_size=5120, num_attention_heads=40,
                num_query_groups=40, head_dim=128, ffn_hidden_size=13824, vocab_size=32000,
                max_position_embeddings=4096),
    "70b": dict(architecture="LlamaForCausalLM", num_layers=80, hidden_size=8192, num_attention_heads=64,
                num_query_groups=8, head_dim=128, ffn_hidden_size=28672, vocab_size=128256,
                max_position_embeddings=8192),
}


def spec_for(name: str) -> ModelSpec:
    if name not in PRESETS:
        raise SystemExit(f"reshard.py: unknown --model-shape {name!r}; choose from {', '.join(PRESETS)}")
    return ModelSpec(**PRESETS[name])


def machine() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    return f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores, gloo"


def train_topology(args, spec: ModelSpec):
    """The training layout in `--rank-order`'s order (natural, or co-designed with the inference TP blocks)."""
    from megarl.parallel.topology import RoleTopology
    from megarl.reshard.rank_order import resolve_rank_order

    topo = RoleTopology(tp=args.train_tp, pp=args.train_pp, dp=args.train_dp)
    return resolve_rank_order(args.rank_order, spec, topo, args.infer_tp, devices_per_node=args.devices_per_node)


def simulate(args) -> dict:
    from megarl.reshard.planner import plan_reshard

    spec = spec_for(args.model_shape)
    topo = train_topology(args, spec)
    start = time.perf_counter()
    plan = plan_reshard(spec, topo, args.infer_tp, dtype_bytes=2 if args.dtype == "bf16" else 4,
                        search_mapping=args.search_mapping)
    plan_s = time.perf_counter() - start
    recv = [s.bytes_received for s in plan.stats]
    naive = [s.bytes_naive for s in plan.stats]
    totals = plan.totals()
    result = {
        "mode": "simulate", "model_shape": args.model_shape, "params": spec.num_params, "dtype": args.dtype,
        "train": topo.describe(), "rank_order": args.rank_order, "gpus": topo.world_size,
        "infer_tp": args.infer_tp, "plan_time_s": plan_s,
        "bytes_received_per_rank_max": max(recv), "bytes_received_per_rank_mean": statistics.mean(recv),
        "bytes_naive_per_rank_max": max(naive), "bytes_naive_per_rank_mean": statistics.mean(naive),
        "bytes_local_total": totals["bytes_local"], "bytes_received_total": totals["bytes_received"],
        "bytes_naive_total": totals["bytes_naive"],
        # from the layouts alone (independent of the plan) vs the plan's own needed-minus-local figure
        "bytes_lower_bound_total": totals["bytes_lower_bound"], "bytes_plan_remote_total": totals["bytes_plan_remote"],
        "natural_mapping": plan.natural_mapping,
        "received_over_naive": totals["bytes_received"] / max(totals["bytes_naive"], 1),
    }
    gib = 2**30
    print(f"{args.model_shape} ({spec.num_params / 1e9:.1f}B params, {args.dtype}) [{args.rank_order} order] "
          f"train {topo.describe()} "
          f"-> infer tp={args.infer_tp} on {topo.world_size} GPUs (plan {plan_s:.1f}s)")
    print(f"  per rank received: max {max(recv) / gib:.2f} GiB, mean {statistics.mean(recv) / gib:.2f} GiB")
    print(f"  per rank naive:    max {max(naive) / gib:.2f} GiB, mean {statistics.mean(naive) / gib:.2f} GiB")
    print(f"  total received {totals['bytes_received'] / gib:.2f} GiB, lower bound from the layouts "
          f"{totals['bytes_lower_bound'] / gib:.2f} GiB")
    print(f"  total received / naive = {result['received_over_naive']:.3f} "
          f"({1 - result['received_over_naive']:.1%} less traffic)")
    return result


def collective_device():
    """Device of the tensors the benchmark's own collectives use: the platform's (`local_device()`), so an
    NCCL-only world on GPU (which has no CPU backend) can reduce them."""
    from megarl.platform.device import local_device

    return local_device()


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _all_ranks_true(ok: bool) -> bool:
    """True when `ok` on every rank (MIN all-reduce on the collective device)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], device=collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def timed(fn):
    """(fn(), seconds of the slowest rank): every rank starts together and the max over ranks is taken.

    GPU work is synchronised before each clock read, so the time covers the kernels, not their launch."""
    import torch
    import torch.distributed as dist

    device = collective_device()
    _sync(device)
    dist.barrier()
    t = time.perf_counter()
    out = fn()
    _sync(device)
    elapsed = torch.tensor([time.perf_counter() - t], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return out, float(elapsed.item())


def _fill_deterministic(engine) -> None:
    import torch

    # Seeded per (parameter, TP rank) -- per parameter only for TP-replicated norms -- so replicas hold identical
    # values and a tied output layer on the last stage equals the first stage's embedding, as in training.
    from megarl.checkpoint.name_map import module_param_layout
    from megarl.reshard.sources import megatron_sources

    tp_rank = engine.groups.coord.tp
    tied = engine.spec.tie_word_embeddings
    for name, t in sorted(megatron_sources(engine).items()):
        key = "embedding.word_embeddings.weight" if (tied and name == "output_layer.weight") else name
        replicated = module_param_layout(engine.spec, key).kind == "replicated"
        seed = (zlib.crc32(key.encode()) * 31 + (0 if replicated else tp_rank)) % (2**31)
        g = torch.Generator().manual_seed(seed)
        t.copy_(torch.rand(t.shape, generator=g, dtype=torch.float32).to(t.dtype))


def _measure_rank(rank, world_size, args_dict):
    import torch

    from megarl.engine.megatron_engine import MegatronEngine
    from megarl.parallel.groups import build_role_groups
    from megarl.reshard.executor import DictSink, execute_reshard
    from megarl.reshard.naive import naive_reshard
    from megarl.reshard.planner import plan_reshard
    from megarl.reshard.sources import megatron_sources

    args = argparse.Namespace(**args_dict)
    spec = spec_for(args.model_shape)
    groups = build_role_groups(train_topology(args, spec))
    t0 = time.perf_counter()
    engine = MegatronEngine(spec, groups, dtype=args.dtype, optimizer=None, init_weights=False)
    _fill_deterministic(engine)
    build_s = time.perf_counter() - t0
    sources = megatron_sources(engine)
    elem = 2 if args.dtype == "bf16" else 4  # a CPU bf16 engine keeps its norms in fp32: not the first tensor's size
    plan = plan_reshard(spec, groups.topology, args.infer_tp, dtype_bytes=elem)
    bucket = int(args.bucket_mb * 2**20)
    if args.delta:
        return _measure_delta(args, engine, groups, plan, sources, bucket, build_s)

    times, naive_times, unverified_times, verify_s, report, naive_report = [], [], [], [], None, None
    sink = naive_sink = None
    for _ in range(args.repeats):
        sink = DictSink(device=collective_device())
        report, t = timed(lambda: execute_reshard(plan, sources, sink, bucket_bytes=bucket))  # noqa: B023 (called now)
        times.append(t)
        verify_s.append(report.verify_time_s)
        _, t = timed(lambda: execute_reshard(plan, sources, DictSink(device=collective_device()),
                                             bucket_bytes=bucket, verify=False))
        unverified_times.append(t)
        sink_keep = sink
        naive_sink = DictSink(device=collective_device())
        naive_report, t = timed(lambda: naive_reshard(plan, groups, sources, naive_sink))  # noqa: B023 (called now)
        naive_times.append(t)
        sink = sink_keep
    exact = all(torch.equal(sink.tensors[k], naive_sink.tensors[k]) for k in naive_sink.tensors) and \
        set(sink.tensors) == set(naive_sink.tensors)
    exact = _all_ranks_true(exact)
    refit_times = _refit_into_vllm(args, spec, plan, sources, bucket) if args.into_vllm else []
    return {
        "rank": rank, "infer_tp_rank": plan.infer_rank_of[rank], "refit_times": refit_times,
        "bytes_received": report.bytes_received, "bytes_sent": report.bytes_sent, "bytes_local": report.bytes_local,
        "bytes_lower_bound": report.bytes_lower_bound, "bytes_naive": report.bytes_naive,
        "naive_bytes_received": naive_report.bytes_received,
        "peak_extra_bytes": report.peak_extra_bytes, "naive_peak_extra_bytes": naive_report.peak_extra_bytes,
        "buckets": report.buckets, "weights_exact": exact,
        "times": times, "naive_times": naive_times, "build_s": build_s,
        "unverified_times": unverified_times, "verify_times": verify_s, "verified_pieces": report.verified_pieces,
    }


def _perturb(engine, fraction: float, step: int) -> None:
    """+1.0 on `fraction` of each parameter's elements (seeded like `_fill_deterministic`: replicas agree)."""
    import torch

    from megarl.checkpoint.name_map import module_param_layout
    from megarl.reshard.sources import megatron_sources

    tp_rank = engine.groups.coord.tp
    tied = engine.spec.tie_word_embeddings
    for name, t in sorted(megatron_sources(engine).items()):
        key = "embedding.word_embeddings.weight" if (tied and name == "output_layer.weight") else name
        replicated = module_param_layout(engine.spec, key).kind == "replicated"
        seed = (zlib.crc32(key.encode()) * 31 + (0 if replicated else tp_rank) + 7919 * (step + 1)) % (2**31)
        g = torch.Generator().manual_seed(seed)
        t[torch.rand(t.shape, generator=g) < fraction] += 1.0


def _measure_delta(args, engine, groups, plan, sources, bucket, build_s) -> dict:
    import torch
    import torch.distributed as dist

    from megarl.reshard.delta import DeltaState
    from megarl.reshard.executor import DictSink, execute_reshard

    state, sink = DeltaState(), DictSink(device=collective_device(), persistent=True)
    first, first_s = timed(lambda: execute_reshard(plan, sources, sink, bucket_bytes=bucket, delta=state))
    delta_times, full_times, exact = [], [], True
    report = full_report = None
    for step in range(args.repeats):
        _perturb(engine, args.delta_change_fraction, step)
        report, t = timed(lambda: execute_reshard(plan, sources, sink, bucket_bytes=bucket, delta=state))
        delta_times.append(t)
        full = DictSink(device=collective_device())
        full_report, t = timed(lambda: execute_reshard(plan, sources, full, bucket_bytes=bucket))  # noqa: B023 (called now)
        full_times.append(t)
        exact &= set(full.tensors) == set(sink.tensors) and all(
            torch.equal(full.tensors[k], sink.tensors[k]) for k in full.tensors)
    quiet, quiet_s = timed(lambda: execute_reshard(plan, sources, sink, bucket_bytes=bucket, delta=state))
    exact = _all_ranks_true(exact)
    return {
        "rank": dist.get_rank(), "infer_tp_rank": plan.infer_rank_of[dist.get_rank()], "build_s": build_s,
        "weights_exact": exact, "first_sync_s": first_s, "no_change_sync_s": quiet_s,
        "times": delta_times, "naive_times": full_times,  # "naive" slot: the dense reshard of the same weights
        "bytes_received": report.bytes_received, "bytes_sent": report.bytes_sent,
        "bytes_control": report.bytes_control, "bytes_lower_bound": report.bytes_lower_bound,
        "dense_bytes_received": full_report.bytes_received, "first_sync_bytes_received": first.bytes_received,
        "no_change_bytes_received": quiet.bytes_received, "no_change_bytes_control": quiet.bytes_control,
        "delta_elements": report.delta_elements, "delta_changed": report.delta_changed,
        "delta_changed_fraction": report.delta_changed_fraction, "delta_sparse_ops": report.delta_sparse_ops,
        "delta_dense_ops": report.delta_dense_ops, "peak_extra_bytes": report.peak_extra_bytes,
        "dense_peak_extra_bytes": full_report.peak_extra_bytes, "snapshot_bytes": state.snapshot_bytes(),
        "bytes_local": report.bytes_local,
    }


def _delta_summary(args, per_rank) -> dict:
    spec = spec_for(args.model_shape)
    delta_s = statistics.median(per_rank[0]["times"])
    dense_s = statistics.median(per_rank[0]["naive_times"])
    recv = sum(r["bytes_received"] for r in per_rank)
    dense = sum(r["dense_bytes_received"] for r in per_rank)
    changed = sum(r["delta_changed"] for r in per_rank)
    elems = sum(r["delta_elements"] for r in per_rank)
    result = {
        "mode": "delta", "model_shape": args.model_shape, "params": spec.num_params, "dtype": args.dtype,
        "train_tp": args.train_tp, "train_pp": args.train_pp, "train_dp": args.train_dp, "infer_tp": args.infer_tp,
        "rank_order": args.rank_order, "bucket_bytes": int(args.bucket_mb * 2**20), "repeats": args.repeats,
        "delta_change_fraction_requested": args.delta_change_fraction, "machine": machine(),
        "command": "python " + " ".join(sys.argv),
        "load_average_1m_at_end": os.getloadavg()[0],  # the CPU machines are shared: read timings with it
        "weights_exact": all(r["weights_exact"] for r in per_rank),
        "changed_fraction_measured": changed / elems if elems else 0.0,
        "bytes_received_total": recv, "dense_bytes_received_total": dense,
        "received_over_dense": recv / dense if dense else 0.0,
        "no_change_bytes_received_total": sum(r["no_change_bytes_received"] for r in per_rank),
        "no_change_bytes_control_total": sum(r["no_change_bytes_control"] for r in per_rank),
        "delta_time_s": delta_s, "dense_time_s": dense_s, "dense_over_delta_time": dense_s / delta_s,
        "first_sync_s": per_rank[0]["first_sync_s"], "no_change_sync_s": per_rank[0]["no_change_sync_s"],
        "ranks": [{k: v for k, v in r.items() if k not in ("times", "naive_times", "weights_exact")}
                  for r in per_rank],
    }
    mib = 2**20
    print(f"{args.model_shape} ({spec.num_params / 1e6:.0f}M params, {args.dtype}) [{args.rank_order} order] "
          f"train tp={args.train_tp} "
          f"pp={args.train_pp} dp={args.train_dp} -> infer tp={args.infer_tp} on {machine()}, delta mode, "
          f"{args.delta_change_fraction:.0%} of elements changed per step")
    for r in per_rank:
        print(f"  rank {r['rank']}: received {r['bytes_received'] / mib:.2f} MiB payload (dense "
              f"{r['dense_bytes_received'] / mib:.2f}, counts {r['bytes_control'] / 1024:.1f} KiB), changed "
              f"{r['delta_changed_fraction']:.3f}, ops sparse/dense {r['delta_sparse_ops']}/{r['delta_dense_ops']}, "
              f"snapshots {r['snapshot_bytes'] / mib:.2f} MiB")
    print(f"  total received / dense = {result['received_over_dense']:.3f}; no-change sync received "
          f"{result['no_change_bytes_received_total']} B payload")
    print(f"  time: delta {delta_s:.3f}s, dense {dense_s:.3f}s, no change {result['no_change_sync_s']:.3f}s; "
          f"weights exact: {result['weights_exact']}")
    return result


def _refit_into_vllm(args, spec, plan, sources, bucket) -> list[float]:
    """Reshard straight into a vLLM engine built with random weights ("refit"): plan + transfer + weight load."""
    import tempfile

    import torch.distributed as dist

    from megarl.reshard.executor import execute_reshard
    from megarl.reshard.vllm_sink import VllmShardSink
    from megarl.rollout.testing import build_tiny_llama
    from megarl.rollout.vllm_adapter import VllmEngineSettings, VllmRolloutEngine

    if spec.architecture != "LlamaForCausalLM":
        raise SystemExit("reshard.py: --into-vllm supports the Llama-shaped presets (tiny, 7b, 13b, 70b)")
    box = [tempfile.mkdtemp(prefix="megarl-refit-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    model_dir = box[0]
    if dist.get_rank() == 0:  # config + tokenizer only: vLLM draws its own random weights (load_format="dummy")
        build_tiny_llama(
            model_dir, vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
            intermediate_size=spec.ffn_hidden_size, num_layers=spec.num_layers, num_heads=spec.num_attention_heads,
            num_kv_heads=spec.num_query_groups, head_dim=spec.head_dim, weights=False,
            dtype="bfloat16" if args.dtype == "bf16" else "float32",
        )
    dist.barrier()
    engine = VllmRolloutEngine(VllmEngineSettings(
        model_path=model_dir, tp=args.infer_tp, dtype="bfloat16" if args.dtype == "bf16" else "float32",
        max_model_len=256, max_prompt_tokens=128, load_format="dummy", kv_cache_gib=1.0,
        gpu_memory_utilization=0.3,
    ))
    sink = VllmShardSink(engine)
    times = []
    for _ in range(args.repeats):
        _, t = timed(lambda: execute_reshard(plan, sources, sink, bucket_bytes=bucket))
        times.append(t)
    return times


def measure(args) -> dict:
    from megarl.platform.spawn import run_ranks

    world = args.train_tp * args.train_pp * args.train_dp
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        from megarl.platform.distributed import init_distributed

        rank, ws = init_distributed()
        per_rank = [_measure_rank(rank, ws, vars(args))]  # each rank reports its own line under torchrun
    else:
        per_rank = run_ranks(world, _measure_rank, vars(args), timeout_s=args.timeout_s)
    if args.delta:
        return _delta_summary(args, per_rank)
    spec = spec_for(args.model_shape)
    time_s = statistics.median(per_rank[0]["times"])
    naive_s = statistics.median(per_rank[0]["naive_times"])
    result = {
        "mode": "measure", "model_shape": args.model_shape, "params": spec.num_params, "dtype": args.dtype,
        "train_tp": args.train_tp, "train_pp": args.train_pp, "train_dp": args.train_dp, "infer_tp": args.infer_tp,
        "rank_order": args.rank_order,
        "bucket_bytes": int(args.bucket_mb * 2**20), "repeats": args.repeats, "machine": machine(),
        "command": "python " + " ".join(sys.argv),
        "load_average_1m_at_end": os.getloadavg()[0],  # the CPU machines are shared: read timings with it
        "weights_exact": all(r["weights_exact"] for r in per_rank),
        "time_s": time_s, "naive_time_s": naive_s, "naive_over_megarl_time": naive_s / time_s,
        # verification (on by default): the reshard timed with and without it, and the checksum time itself
        "unverified_time_s": statistics.median(per_rank[0]["unverified_times"]),
        "verify_time_s_max_rank": statistics.median(max(r["verify_times"][i] for r in per_rank)
                                                    for i in range(len(per_rank[0]["verify_times"]))),
        "peak_extra_bytes": max(r["peak_extra_bytes"] for r in per_rank),
        "naive_peak_extra_bytes": max(r["naive_peak_extra_bytes"] for r in per_rank),
        "ranks": [{k: v for k, v in r.items() if k not in ("times", "naive_times", "weights_exact", "refit_times",
                                                          "unverified_times", "verify_times")}
                  for r in per_rank],
    }
    result["verify_over_reshard_time"] = result["verify_time_s_max_rank"] / time_s
    if args.into_vllm:
        result["refit_time_s"] = statistics.median(per_rank[0]["refit_times"])
    mib = 2**20
    print(f"{args.model_shape} ({spec.num_params / 1e6:.0f}M params, {args.dtype}) [{args.rank_order} order] "
          f"train tp={args.train_tp} "
          f"pp={args.train_pp} dp={args.train_dp} -> infer tp={args.infer_tp} on {machine()}")
    for r in per_rank:
        print(f"  rank {r['rank']}: received {r['bytes_received'] / mib:.1f} MiB (lower bound "
              f"{r['bytes_lower_bound'] / mib:.1f}, naive {r['naive_bytes_received'] / mib:.1f}), local "
              f"{r['bytes_local'] / mib:.1f} MiB, peak extra {r['peak_extra_bytes'] / mib:.1f} MiB "
              f"(naive {r['naive_peak_extra_bytes'] / mib:.1f})")
    print(f"  verification: {result['verify_time_s_max_rank']:.3f}s of {time_s:.3f}s "
          f"({result['verify_over_reshard_time']:.1%}); unverified reshard {result['unverified_time_s']:.3f}s")
    print(f"  time: megarl {time_s:.3f}s, naive {naive_s:.3f}s -> naive/megarl = {naive_s / time_s:.2f}x; "
          f"weights exact: {result['weights_exact']}")
    if args.into_vllm:
        print(f"  refit into vLLM (reshard + weight load): {result['refit_time_s']:.3f}s")
    return result


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--disaggregated" in argv:  # the reshard across pools has its own options
        import reshard_disagg

        return reshard_disagg.main([a for a in argv if a != "--disaggregated"])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-shape", default="tiny",
                   help=f"one of {', '.join(PRESETS)}; with --simulate also a mixture-of-experts case of "
                        "benchmarks/reshard_moe_sim.py (its layout is the case's: --train-*/--infer-tp are ignored)")
    p.add_argument("--train-tp", type=int, default=1)
    p.add_argument("--train-pp", type=int, default=1)
    p.add_argument("--train-dp", type=int, default=1)
    p.add_argument("--infer-tp", type=int, default=1)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--bucket-mb", type=float, default=float(DEFAULT_RESHARD_BUCKET_MB),
                   help="bound on one bucket's send+receive per rank (default: rollout.reshard_bucket_mb's)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--into-vllm", action="store_true",
                   help="also time the refit into a real vLLM engine (random-weight engine, Llama presets)")
    p.add_argument("--delta", action="store_true",
                   help="delta mode: after a full sync, perturb the weights and sync only what changed")
    p.add_argument("--delta-change-fraction", type=float, default=0.1,
                   help="with --delta: fraction of every parameter's elements changed between syncs")
    p.add_argument("--simulate", action="store_true", help="planner only, for cluster shapes (no ranks started)")
    p.add_argument("--disaggregated", action="store_true",
                   help="the reshard across pools (actor ranks -> rollout ranks): megarl's plan vs gather-broadcast "
                        "and replica-broadcast, measured on 4 CPU ranks and simulated at cluster shapes "
                        "(benchmarks/reshard_disagg.py; its options follow)")
    p.add_argument("--search-mapping", action="store_true",
                   help="with --simulate: search the inference TP rank permutation (vLLM's launcher fixes the natural "
                        "one: what the trainer uses)")
    p.add_argument("--rank-order", choices=["natural", "reshard", "both"], default="natural",
                   help="the training rank order (megarl/reshard/rank_order.py): natural, co-designed with the "
                        "inference TP blocks (actor.parallel.rank_order: reshard), or both, one after the other")
    p.add_argument("--devices-per-node", type=int, default=8,
                   help="with --rank-order reshard: TP groups are kept inside nodes of this many ranks")
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--json", help="write the result here")
    args = p.parse_args(argv)
    if args.simulate and args.model_shape not in PRESETS:
        import reshard_moe_sim

        if args.model_shape not in reshard_moe_sim.CASES:
            raise SystemExit(f"reshard.py: unknown --model-shape {args.model_shape!r}; choose from "
                             f"{', '.join([*PRESETS, *reshard_moe_sim.CASES])}")
        args.rank_order = "natural"  # the MoE cases fix their own layout
        run = lambda a: reshard_moe_sim.run_case(a.model_shape, gbps=400.0)  # noqa: E731
    else:
        run = simulate if args.simulate else measure
    if args.rank_order == "both":
        result = {"rank_order": "both"}
        for order in ("natural", "reshard"):
            result[order] = run(argparse.Namespace(**{**vars(args), "rank_order": order}))
        result["weights_exact"] = all(result[o].get("weights_exact", True) for o in ("natural", "reshard"))
        if args.simulate:
            key = "bytes_received_per_rank_max"
            print(f"co-designed / natural order, max bytes received per rank: "
                  f"{result['reshard'][key] / max(result['natural'][key], 1):.3f}")
        else:
            print(f"time: natural {result['natural']['time_s']:.3f}s, co-designed {result['reshard']['time_s']:.3f}s")
    else:
        result = run(args)
    if not result.get("weights_exact", True):
        print("reshard.py: planned and reference reshard disagree", file=sys.stderr)
    if args.json:
        from megarl.platform.host import host_cpu

        result["host_cpu"] = host_cpu()
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 0 if result.get("weights_exact", True) else 1


if __name__ == "__main__":
    sys.exit(main())
