"""Reshard across pools: megarl's shard-to-shard plan vs (a) gather-broadcast and (b) replica-broadcast.

    python benchmarks/reshard.py --disaggregated          # both parts -> results/reshard_disaggregated.{json,md}
    python benchmarks/reshard_disagg.py [--skip-measure] [--repeats 5] [--gbps 400] [--infer-tp 1]

The three fan-out shapes are those of `megarl.reshard.fanout` (its docstring): "direct" = `plan_reshard` into an
`InferLayout` run by `execute_reshard` over a bridge group; (a) "gather_broadcast" = per pipeline stage one training
rank gathers the full tensors (TP all-to-one gather of the Megatron shards, padding included, as slime and verl's
checkpoint engine do), converts them to HF tensors and broadcasts every tensor to every inference rank, which cuts
its vLLM pieces out; (b) "replica_broadcast" = the direct plan into engine 0, then engine 0's TP rank j broadcasts
its shards to TP rank j of the other engines.

(i) Measured: 4 CPU ranks (gloo), 2 actor ranks (`--train-tp/--train-pp/--train-dp`, product 2) holding the tiny
    preset's Megatron shards (deterministic synthetic weights), 2 rollout ranks (`--infer-tp` 1: two engines; 2: one
    engine) receiving into plain tensors. Per strategy: bytes each rank sent and received (payload bytes this code
    handed to torch.distributed; for a broadcast the root counts it once as sent and every receiver once as
    received, whatever gloo's broadcast algorithm does underneath), max/mean sent over the actor ranks, max/mean
    received over the rollout ranks, time (median over `--repeats` of the slowest rank; the machine is shared:
    the 1-minute load average is recorded), and whether (a) and (b) leave bit-identical shards to direct's
    (which is checksum-verified). Beside each, the cost model's per-rank bytes for the same shape.
(ii) Simulated (`plan_reshard(..., keep_ops=False)` and the cost model, no ranks): 7B actor TP4 x DP2 on 8 GPUs ->
    4 engines of TP2 on 8; 70B TP8 x PP4 on 32 -> 4 engines of TP8 on 32; Qwen3-30B-A3B EP8 x PP2 (tp1, dp8) on 16
    -> 2 engines of TP8 on 16. Max bytes sent / received per rank for each shape and the time they imply at
    `--gbps` GB/s per link for the bridge, the rollout pool and the training pool alike; and again with the bridge
    at `--slow-bridge-gbps` (default 50 GB/s, a 400 Gb/s NIC per GPU between pools) and the pools at `--gbps`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megarl.parallel.topology import RoleTopology  # noqa: E402
from megarl.reshard.layouts import InferLayout, TrainLayout  # noqa: E402

STRATEGIES = ("direct", "gather_broadcast", "replica_broadcast")
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# name: (model: a reshard.PRESETS name or reshard_moe_sim spec kwargs, training topology kwargs, infer layout)
CLUSTER = {
    "7b": ("7b", dict(tp=4, dp=2), InferLayout(tp=2, replicas=4, rank_offset=8)),
    "70b": ("70b", dict(tp=8, pp=4), InferLayout(tp=8, replicas=4, rank_offset=32)),
    "qwen3-30b-a3b": ("qwen3-30b-a3b", dict(tp=1, pp=2, dp=8, ep=8), InferLayout(tp=8, replicas=2, rank_offset=16)),
}


def _spec(model: str):
    import reshard
    import reshard_moe_sim

    from megarl.models.spec import ModelSpec

    if model in reshard.PRESETS:
        return reshard.spec_for(model)
    return ModelSpec(**reshard_moe_sim.CASES[model][0])


def _summary(per_rank: dict[int, tuple[int, int]], train_ranks, infer_ranks) -> dict:
    """max/mean sent over the actor ranks, max/mean received over the rollout ranks ({rank: (sent, received)})."""
    sent = [per_rank.get(r, (0, 0))[0] for r in train_ranks]
    recv = [per_rank.get(r, (0, 0))[1] for r in infer_ranks]
    return {"sent_max": max(sent), "sent_mean": statistics.mean(sent), "received_max": max(recv),
            "received_mean": statistics.mean(recv),
            "moved_max": max(max(s, r) for s, r in per_rank.values()) if per_rank else 0}


# ------------------------------------------------------------------------------------------------ (ii) simulated
def simulate_case(name: str, gbps: float, bridge_gbps: float | None = None) -> dict:
    from megarl.reshard.fanout import Links, choose_fanout, fanout_costs
    from megarl.reshard.planner import plan_reshard

    model, topo_kw, infer = CLUSTER[name]
    spec, train = _spec(model), RoleTopology(**topo_kw)
    start = time.perf_counter()
    plan = plan_reshard(spec, train, infer, dtype_bytes=2, train_layout=TrainLayout(), keep_ops=False)
    plan_s = time.perf_counter() - start
    bridge_gbps = gbps if bridge_gbps is None else bridge_gbps
    links = Links(bridge_gbps * 1e9, gbps * 1e9, gbps * 1e9)
    start = time.perf_counter()
    costs = fanout_costs(spec, train, infer, links, dtype_bytes=2)
    cost_s = time.perf_counter() - start
    traffic = plan.traffic()
    result = {
        "case": name, "params": spec.num_params, "model_bytes": plan.model_bytes, "dtype": "bf16",
        "train": train.describe(), "train_gpus": train.world_size, "infer": infer.describe(),
        "infer_gpus": infer.world_size, "gbps_per_link": gbps, "bridge_gbps": bridge_gbps, "plan_time_s": plan_s,
        "cost_model_time_s": cost_s,
        "direct_traffic": {"sent_max": traffic.max_sent, "sent_mean": traffic.mean_sent,
                           "received_max": traffic.max_received, "received_mean": traffic.mean_received,
                           "sent_imbalance": traffic.sent_imbalance},
        "received_equals_lower_bound": all(s.bytes_received == s.bytes_lower_bound for s in plan.stats
                                           if s.infer_tp_rank is not None),
        "strategies": {k: {"max_sent": c.max_sent, "max_received": c.max_received, "time_s": c.time_s,
                           "phases": [{"name": p.name, "link": p.link, "max_sent": p.max_sent,
                                       "max_received": p.max_received, "time_s": p.time_s(links)}
                                      for p in c.phases]}
                       for k, c in costs.items()},
        "auto": choose_fanout(costs).strategy,
    }
    gb = 1e9
    print(f"{name}: {spec.num_params / 1e9:.1f}B, train {train.describe()} on {train.world_size} -> "
          f"{infer.describe()}; plan {plan_s:.1f} s, cost model {cost_s:.1f} s")
    print(f"  direct: sent max {traffic.max_sent / gb:.3f} GB (mean {traffic.mean_sent / gb:.3f}), received max "
          f"{traffic.max_received / gb:.3f} GB (mean {traffic.mean_received / gb:.3f})")
    for k, c in costs.items():
        print(f"  {k:18s} max sent {c.max_sent / gb:8.3f} GB, max received {c.max_received / gb:8.3f} GB, "
              f"{c.time_s * 1e3:8.2f} ms (bridge {bridge_gbps:g} GB/s, pools {gbps:g} GB/s)")
    print(f"  auto: {result['auto']}")
    return result


# ------------------------------------------------------------------------------------------------- (i) measured
def _gather_broadcast(spec, topo, groups, sources, sink, rank, infer, bcast, dtype, elem) -> dict:
    """(a) on this rank; returns {"sent": bytes, "received": bytes}. Collective over the 4 ranks (dense models, even
    pipeline split)."""
    import torch
    import torch.distributed as dist

    from megarl.checkpoint.name_map import hf_shapes, param_layouts, scatter_shard
    from megarl.reshard.layouts import stage_layers, vllm_needs, vllm_param_shapes

    shapes = hf_shapes(spec)
    leaders = {s: topo.rank_of(pp=s) for s in range(topo.pp)}
    sent = received = 0
    coord = topo.coord(rank) if rank in topo.ranks else None
    needs, targets, remaining = {}, {}, {}
    if rank in infer.ranks:
        j = infer.tp_rank(rank)
        vshapes = vllm_param_shapes(spec, infer.tp, j)
        for p in vllm_needs(spec, infer.tp, j):
            needs.setdefault(p.piece.hf_name, []).append(p)
            remaining[p.param] = remaining.get(p.param, 0) + p.piece.length
    for layout in param_layouts(spec):
        owner = (next(s for s in range(topo.pp) if layout.layer in stage_layers(spec, topo, s))
                 if layout.layer is not None else (0 if layout.megatron_name.startswith("embedding.") else topo.pp - 1))
        leader = leaders[owner]
        hf = None
        if coord is not None and coord.pp == owner and coord.dp == 0:
            shard = sources[layout.megatron_name].to(dtype).contiguous()
            parts = [shard]
            if topo.tp > 1 and layout.partition_dim is not None:  # replicated: the leader has it
                parts = [torch.empty_like(shard) for _ in range(topo.tp)] if rank == leader else None
                dist.gather(shard, parts, dst=leader, group=groups.pgs.tp)
                if rank == leader:
                    received += shard.numel() * elem * (topo.tp - 1)
                else:
                    sent += shard.numel() * elem
            if rank == leader:
                hf = {n: torch.empty(shapes[n], dtype=dtype) for n in layout.hf_names}
                for t, part in enumerate(parts if len(parts) == topo.tp else parts * topo.tp):
                    scatter_shard(spec, layout, t, topo.tp, part, hf)
        if rank != leader and rank not in infer.ranks:
            continue
        for name in layout.hf_names:
            full = hf[name] if rank == leader else torch.empty(shapes[name], dtype=dtype)
            dist.broadcast(full, src=leader, group=bcast[owner])
            if rank == leader:
                sent += full.numel() * elem
                continue
            received += full.numel() * elem
            for p in needs.get(name, []):
                if p.param not in targets:
                    targets[p.param] = sink.target(p.param, vshapes[p.param], dtype)
                targets[p.param].narrow(p.piece.dim, p.offset, p.piece.length).copy_(
                    full.narrow(p.piece.dim, p.piece.start, p.piece.length))
                remaining[p.param] -= p.piece.length
                if remaining[p.param] == 0:
                    sink.commit(p.param)
    return {"sent": sent, "received": received}


def _replica_broadcast(plan0, sources, sink, rank, infer, engine_groups, bridge, dtype, elem) -> dict:
    """(b) on this rank: the plan into engine 0, then engine 0 -> the other engines, TP rank by TP rank."""
    import torch.distributed as dist

    from megarl.reshard.executor import execute_reshard
    from megarl.reshard.layouts import vllm_param_shapes

    sent = received = 0
    if rank in plan0.ranks:
        rep = execute_reshard(plan0, sources, sink, group=bridge, dtype=dtype, bucket_bytes=1 << 40)
        sent, received = rep.bytes_sent, rep.bytes_received
    if rank in infer.ranks and infer.replicas > 1:
        j, root = infer.tp_rank(rank), infer.rank_offset + infer.tp_rank(rank)
        for name, shape in sorted(vllm_param_shapes(plan0.spec, infer.tp, j).items()):
            t = sink.tensors[name] if rank == root else sink.target(name, shape, dtype)
            dist.broadcast(t, src=root, group=engine_groups[j])
            if rank == root:
                sent += t.numel() * elem
            else:
                received += t.numel() * elem
                sink.commit(name)
    return {"sent": sent, "received": received}


def _measure_rank(rank, world_size, args_dict):
    import reshard
    import torch
    import torch.distributed as dist

    from megarl.engine.megatron_engine import MegatronEngine
    from megarl.parallel.groups import build_role_groups
    from megarl.reshard.executor import DictSink, execute_reshard
    from megarl.reshard.planner import plan_reshard
    from megarl.reshard.sources import megatron_sources

    args = argparse.Namespace(**args_dict)
    spec = reshard.spec_for(args.model_shape)
    topo = RoleTopology(tp=args.train_tp, pp=args.train_pp, dp=args.train_dp)
    T = topo.world_size
    infer = InferLayout.pool(world_size - T, args.infer_tp, rank_offset=T)
    bridge = dist.new_group(list(range(world_size)), sort_ranks=False)  # actor ranks first: bridge = global here
    groups = build_role_groups(topo)
    bcast = {s: dist.new_group([topo.rank_of(pp=s), *infer.ranks]) for s in range(topo.pp)}
    engine_groups = {j: dist.new_group([infer.rank_offset + k * infer.tp + j for k in range(infer.replicas)])
                     for j in range(infer.tp)}
    elem = 2 if args.dtype == "bf16" else 4
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    sources = {}
    if groups.is_member:
        engine = MegatronEngine(spec, groups, dtype=args.dtype, optimizer=None, init_weights=False)
        reshard._fill_deterministic(engine)
        sources = megatron_sources(engine)
    plan = plan_reshard(spec, topo, infer, dtype_bytes=elem)
    plan0 = plan_reshard(spec, topo, InferLayout(infer.tp, 1, rank_offset=T), dtype_bytes=elem)

    def new_sink():
        return DictSink() if rank in infer.ranks else None

    def direct(sink):
        rep = execute_reshard(plan, sources, sink, group=bridge, dtype=dtype, bucket_bytes=1 << 40)
        return {"sent": rep.bytes_sent, "received": rep.bytes_received}

    run = {
        "direct": direct,
        "gather_broadcast": lambda sink: _gather_broadcast(spec, topo, groups, sources, sink, rank, infer, bcast,
                                                           dtype, elem),
        "replica_broadcast": lambda sink: _replica_broadcast(plan0, sources, sink, rank, infer, engine_groups,
                                                             bridge, dtype, elem),
    }
    out = {"rank": rank, "times": {k: [] for k in STRATEGIES}, "bytes": {}, "exact": {}}
    for _ in range(args.repeats):
        sinks = {}
        for k in STRATEGIES:
            sinks[k] = new_sink()
            out["bytes"][k], t = reshard.timed(lambda k=k, sink=sinks[k]: run[k](sink))
            out["times"][k].append(t)
        for k in STRATEGIES[1:]:
            ok = sinks[k] is None or (set(sinks[k].tensors) == set(sinks["direct"].tensors) and all(
                torch.equal(sinks[k].tensors[n], sinks["direct"].tensors[n]) for n in sinks["direct"].tensors))
            out["exact"][k] = reshard._all_ranks_true(ok)
    return out


def measure(args) -> dict:
    import reshard

    from megarl.platform.spawn import run_ranks
    from megarl.reshard.fanout import Links, fanout_costs

    T = args.train_tp * args.train_pp * args.train_dp
    if T != 2:
        raise SystemExit(f"reshard_disagg.py: the measured part runs 2 actor ranks, got tp*pp*dp={T}")
    per_rank = run_ranks(4, _measure_rank, vars(args), timeout_s=args.timeout_s)
    spec, topo = reshard.spec_for(args.model_shape), RoleTopology(tp=args.train_tp, pp=args.train_pp,
                                                                 dp=args.train_dp)
    infer = InferLayout.pool(2, args.infer_tp, rank_offset=2)
    costs = fanout_costs(spec, topo, infer, Links(1.0, 1.0), dtype_bytes=2 if args.dtype == "bf16" else 4)
    result = {"mode": "measure", "model_shape": args.model_shape, "params": spec.num_params, "dtype": args.dtype,
              "train": topo.describe(), "infer": infer.describe(), "repeats": args.repeats,
              "machine": reshard.machine(), "load_average_1m_at_end": os.getloadavg()[0], "strategies": {}}
    for k in STRATEGIES:
        per = {r["rank"]: (r["bytes"][k]["sent"], r["bytes"][k]["received"]) for r in per_rank}
        model = {}
        for phase in costs[k].phases:
            for r, b in phase.sent.items():
                model[r] = (model.get(r, (0, 0))[0] + b, model.get(r, (0, 0))[1])
            for r, b in phase.received.items():
                model[r] = (model.get(r, (0, 0))[0], model.get(r, (0, 0))[1] + b)
        result["strategies"][k] = {
            "per_rank_sent_received": {str(r): list(v) for r, v in sorted(per.items())},
            **_summary(per, topo.ranks, infer.ranks),
            "time_s": statistics.median(per_rank[0]["times"][k]),
            "times_s": per_rank[0]["times"][k],
            "cost_model_per_rank_sent_received": {str(r): list(v) for r, v in sorted(model.items())},
            "same_shards_as_direct": k == "direct" or all(r["exact"][k] for r in per_rank),
        }
    kib = 1024
    print(f"{args.model_shape} ({spec.num_params / 1e6:.1f}M params, {args.dtype}): actor {topo.describe()} on "
          f"ranks 0-1 -> {infer.describe()}; {reshard.machine()}")
    for k, v in result["strategies"].items():
        print(f"  {k:18s} sent max {v['sent_max'] / kib:8.0f} KiB (mean {v['sent_mean'] / kib:8.0f}), received max "
              f"{v['received_max'] / kib:8.0f} KiB (mean {v['received_mean'] / kib:8.0f}), {v['time_s'] * 1e3:7.1f} "
              f"ms, same shards: {v['same_shards_as_direct']}")
    return result


def markdown(measured: list[dict], simulated: list[dict], command: str, slow_bridge: list[dict] = ()) -> str:
    gb, kib = 1e9, 1024
    lines = ["# Reshard across pools: megarl's plan vs gather-broadcast (a) and replica-broadcast (b)", "",
             f"Command: `{command}`. Shapes: `megarl/reshard/fanout.py`; measured and simulated parts: the docstring "
             "of `benchmarks/reshard_disagg.py`.", ""]
    for m in measured:
        lines += [f"## Measured: {m['model_shape']} ({m['params'] / 1e6:.1f}M params, {m['dtype']}), actor "
                  f"{m['train']} (ranks 0-1) -> {m['infer']}; {m['machine']}, load {m['load_average_1m_at_end']:.1f}",
                  "", "| strategy | sent max (mean) KiB, actor ranks | received max (mean) KiB, rollout ranks | "
                  "max moved by one rank KiB | time ms (median) | same shards as direct |", "|---|---|---|---|---|---|"]
        for k, v in m["strategies"].items():
            lines.append(f"| {k} | {v['sent_max'] / kib:.0f} ({v['sent_mean'] / kib:.0f}) | "
                         f"{v['received_max'] / kib:.0f} ({v['received_mean'] / kib:.0f}) | "
                         f"{v['moved_max'] / kib:.0f} | {v['time_s'] * 1e3:.1f} | {v['same_shards_as_direct']} |")
        lines.append("")
    if measured:
        lines += ["Bytes are payload handed to torch.distributed (a broadcast counts once at its root and once per "
                  "receiver). Direct and (b)'s first phase move only real rows; (a)'s gather moves Megatron's padded "
                  "TP shards and (b)'s broadcast whole vLLM shards with vLLM's vocabulary padding rows. Times are "
                  "wall-clock medians of the slowest rank on a shared 2-core host: read them with the load figure.",
                  ""]
    for runs in (simulated, slow_bridge):
        if not runs:
            continue
        g, b = runs[0]["gbps_per_link"], runs[0]["bridge_gbps"]
        lines += [f"## Simulated at cluster shapes (bf16; time = bytes / bandwidth: bridge {b:g} GB/s, training and "
                  f"rollout pools {g:g} GB/s per link)", "",
                  "| case | actor -> engines | direct: sent max (mean) GB / received max (mean) GB | "
                  "direct max sent, recv GB; ms | (a) gather-broadcast max sent, recv GB; ms | "
                  "(b) replica-broadcast max sent, recv GB; ms | auto |", "|---|---|---|---|---|---|---|"]
        for r in runs:
            d, s = r["direct_traffic"], r["strategies"]
            cells = [f"{s[k]['max_sent'] / gb:.2f}, {s[k]['max_received'] / gb:.2f}; {s[k]['time_s'] * 1e3:.1f}"
                     for k in STRATEGIES]
            lines.append(f"| {r['case']} ({r['params'] / 1e9:.0f}B) | {r['train']} ({r['train_gpus']}) -> "
                         f"{r['infer']} | {d['sent_max'] / gb:.2f} ({d['sent_mean'] / gb:.2f}) / "
                         f"{d['received_max'] / gb:.2f} ({d['received_mean'] / gb:.2f}) | " + " | ".join(cells)
                         + f" | {r['auto']} |")
        lines += ["", "Times are what the bytes imply on ideal full-duplex links (no latency, congestion or "
                  "packing), not measurements. Max sent/received are over every rank and phase (in (a) and (b) "
                  "rollout ranks forward what they receive).", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-shape", default="tiny", help="measured part: a benchmarks/reshard.py preset")
    p.add_argument("--train-tp", type=int, default=2)
    p.add_argument("--train-pp", type=int, default=1)
    p.add_argument("--train-dp", type=int, default=1)
    p.add_argument("--infer-tp", type=int, nargs="+", default=[1, 2],
                   help="measured part: rollout tp over the 2 rollout ranks (1: two engines; 2: one engine)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--gbps", type=float, default=400.0, help="simulated part: GB/s per link")
    p.add_argument("--slow-bridge-gbps", type=float, default=50.0,
                   help="simulated part, second table: the bridge's GB/s (the pools stay at --gbps)")
    p.add_argument("--skip-measure", action="store_true")
    p.add_argument("--skip-simulate", action="store_true")
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--out", default=os.path.join(RESULTS, "reshard_disaggregated"),
                   help="write OUT.json and OUT.md")
    args, _ = p.parse_known_args(argv)
    measured = [] if args.skip_measure else [
        measure(argparse.Namespace(**{**vars(args), "infer_tp": tp})) for tp in args.infer_tp]
    simulated = [] if args.skip_simulate else [simulate_case(name, args.gbps) for name in CLUSTER]
    slow_bridge = [] if args.skip_simulate else [simulate_case(name, args.gbps, args.slow_bridge_gbps)
                                                 for name in CLUSTER]
    from megarl.platform.host import host_cpu

    result = {"command": "python " + " ".join(sys.argv), "host_cpu": host_cpu(), "measured": measured,
              "simulated": simulated, "simulated_slow_bridge": slow_bridge}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(measured, simulated, result["command"], slow_bridge))
    print(f"wrote {args.out}.json and .md")
    exact = all(v["same_shards_as_direct"] for m in measured for v in m["strategies"].values())
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
