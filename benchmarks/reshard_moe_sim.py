"""Reshard planner simulation for mixture-of-experts models at cluster scale, beside NeMo-RL's published refit times.

    python benchmarks/reshard_moe_sim.py                      # every case -> results/reshard_moe_sim.{md,json}
    python benchmarks/reshard_moe_sim.py --case qwen3-30b-a3b  # one case, printed only

Only the planner runs (pure Python, no ranks): for each case it plans the Megatron -> vLLM reshard (bf16) and reports,
per rank, bytes received under the plan (max, mean), the lower bound (bytes of the rank's vLLM shard that it does
not hold itself, from the layouts alone: `planner.lower_bound_bytes`), bytes sent, and what gathering the full model
on every rank would receive (naive). Time at `--gbps` GB/s per GPU (default 400, an H100's 8x50 GB/s NVLink /
400 Gb/s-per-GPU IB class figure) is max over ranks of max(received, sent) / bandwidth: what the plan's traffic
implies on an ideal network, not a measured time. Also reported: the planner's own run time on this machine.

Cases (NeMo-RL `docs/design-docs/nccl-reshard-refit.md` / PR #2808 layouts, from /work/shared/PEERS.md; model shapes
from the public HF config.json files):
  qwen3-30b-a3b    Qwen3-30B-A3B, Megatron EP8 x PP2 (tp1, dp8) -> vLLM TP8 x DP2, 16 GPUs
  qwen3-235b-a22b  Qwen3-235B-A22B, Megatron TP4 x PP8 x EP16 (expert TP 1: EP spans the TP ranks, etp*ep = 16 =
                   tp*dp) -> vLLM TP8 x DP16, 128 GPUs; 94 layers over 8 stages: first and last stage 11 layers,
                   the 6 middle stages 12 (an assumption: NeMo-RL does not publish its split)
  deepseek-v3      DeepSeek-V3-sized, Megatron PP16 x EP16 (tp1, dp16) -> vLLM TP32 x DP8, 256 GPUs. hidden 7168,
                   61 layers (first 3 dense, ffn 18432), 256 routed experts of width 2048 + 1 shared expert of width
                   2048, vocab 129280, untied. Approximations (megarl has no DeepSeek model): MLA attention
                   (q_a/q_b/kv_a/kv_b/o, 187.1M parameters per layer) is modelled as multi-head attention with 128
                   heads of dim 56 (= 7168 / 128, as vLLM's Qwen2-MoE requires; 205.5M per layer, +10%, i.e. +0.17%
                   of the model; TP-sharded, whereas vLLM replicates MLA's small q_a/kv_a projections, 15.1M per
                   layer, on every rank); the shared expert carries Qwen2-MoE's [1, hidden] sigmoid gate
                   (DeepSeek has none; 7168 elements per layer); the router's score-correction bias and the MTP
                   layer are left out. 61 layers over 16 stages: first stage 3, last stage 2, middle 4 (assumed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megarl.models.spec import ModelSpec  # noqa: E402
from megarl.parallel.topology import RoleTopology  # noqa: E402
from megarl.reshard.layouts import TrainLayout  # noqa: E402

QWEN3_30B = dict(
    architecture="Qwen3MoeForCausalLM", num_layers=48, hidden_size=2048, num_attention_heads=32, num_query_groups=4,
    head_dim=128, ffn_hidden_size=6144, vocab_size=151936, max_position_embeddings=40960, qk_layernorm=True,
    num_experts=128, moe_topk=8, moe_ffn_hidden_size=768,
)
QWEN3_235B = dict(
    architecture="Qwen3MoeForCausalLM", num_layers=94, hidden_size=4096, num_attention_heads=64, num_query_groups=4,
    head_dim=128, ffn_hidden_size=12288, vocab_size=151936, max_position_embeddings=40960, qk_layernorm=True,
    num_experts=128, moe_topk=8, moe_ffn_hidden_size=1536,
)
DEEPSEEK_V3_LIKE = dict(
    architecture="Qwen2MoeForCausalLM", num_layers=61, hidden_size=7168, num_attention_heads=128,
    num_query_groups=128, head_dim=56, ffn_hidden_size=18432, vocab_size=129280, max_position_embeddings=163840,
    qkv_bias=False, num_experts=256, moe_topk=8, moe_ffn_hidden_size=2048, shared_expert_ffn_hidden_size=2048,
    moe_layers=tuple(i >= 3 for i in range(61)),
)

# name: (spec kwargs, training topology, training layout, infer tp, NeMo-RL published time, its source)
CASES = {
    "qwen3-30b-a3b": (QWEN3_30B, dict(tp=1, pp=2, dp=8, ep=8), TrainLayout(), 8,
                      "0.74-1.00 s", "nccl_reshard, H100, EP8xPP2 -> TP8xDP2 (nccl-reshard-refit.md)"),
    "qwen3-235b-a22b": (QWEN3_235B, dict(tp=4, pp=8, dp=4, ep=1), TrainLayout(first_stage_layers=11,
                        last_stage_layers=11, etp=1, ep=16), 8,
                        "4.56-4.85 s", "earlier NCCL-Xfer impl., TP4xPP8xEP16 -> TP8xDP16 (PR #2808)"),
    "deepseek-v3": (DEEPSEEK_V3_LIKE, dict(tp=1, pp=16, dp=16, ep=16), TrainLayout(first_stage_layers=3,
                    last_stage_layers=2), 32,
                    "2.39-2.83 s", "nccl_reshard, H100, PP16xEP16 -> TP32xDP8 (nccl-reshard-refit.md)"),
}


def describe_train(topo: RoleTopology, layout: TrainLayout) -> str:
    """e.g. 'tp4 pp8 (11 first, 11 last) dp4 ep16 etp1'."""
    pp = f"pp{topo.pp}"
    if layout.first_stage_layers is not None or layout.last_stage_layers is not None:
        pp += f" ({layout.first_stage_layers} first, {layout.last_stage_layers} last layers)"
    if layout.vpp > 1:
        pp += f" vpp{layout.vpp}"
    ep, etp = layout.ep or topo.ep, layout.etp or topo.tp
    return f"tp{topo.tp} {pp} dp{topo.dp} ep{ep} etp{etp}"


def run_case(name: str, gbps: float) -> dict:
    from megarl.reshard.planner import plan_reshard

    kwargs, topo_kw, layout, infer_tp, nemo_time, nemo_src = CASES[name]
    spec = ModelSpec(**kwargs)
    topo = RoleTopology(**topo_kw)
    start = time.perf_counter()
    plan = plan_reshard(spec, topo, infer_tp, dtype_bytes=2, train_layout=layout, keep_ops=False)
    plan_s = time.perf_counter() - start
    recv = [s.bytes_received for s in plan.stats]
    sent = [s.bytes_sent for s in plan.stats]
    bound = [s.bytes_lower_bound for s in plan.stats]
    naive = [s.bytes_naive for s in plan.stats]
    bw = gbps * 1e9
    result = {
        "case": name, "params": spec.num_params, "active_params": spec.num_active_params, "dtype": "bf16",
        "model_bytes": plan.model_bytes, "train": describe_train(topo, layout), "train_layout": repr(layout),
        "infer": f"vLLM tp={infer_tp} x {topo.world_size // infer_tp} replicas", "gpus": topo.world_size,
        "plan_time_s": plan_s,
        "bytes_received_max": max(recv), "bytes_received_mean": statistics.mean(recv),
        "bytes_sent_max": max(sent),
        "bytes_lower_bound_max": max(bound), "bytes_lower_bound_mean": statistics.mean(bound),
        "bytes_naive_max": max(naive), "bytes_naive_mean": statistics.mean(naive),
        "received_equals_lower_bound_on_every_rank": recv == bound,
        "gbps_per_gpu": gbps,
        "time_plan_s": max(max(recv), max(sent)) / bw,
        "time_lower_bound_s": max(bound) / bw,
        "time_naive_s": max(naive) / bw,
        "nemo_rl_time": nemo_time, "nemo_rl_source": nemo_src,
    }
    gib = 2**30
    print(f"{name}: {spec.num_params / 1e9:.1f}B params, train {describe_train(topo, layout)} -> vLLM tp={infer_tp} "
          f"on {topo.world_size} GPUs; plan {plan_s:.1f} s")
    print(f"  received max {max(recv) / gib:.3f} GiB mean {statistics.mean(recv) / gib:.3f} GiB; sent max "
          f"{max(sent) / gib:.3f} GiB; lower bound max {max(bound) / gib:.3f} GiB (equal on every rank: "
          f"{recv == bound}); naive max {max(naive) / gib:.2f} GiB")
    print(f"  at {gbps:g} GB/s per GPU: plan {result['time_plan_s']:.3f} s, naive {result['time_naive_s']:.2f} s; "
          f"NeMo-RL {nemo_time}")
    return result


def markdown(results: list[dict], command: str) -> str:
    gb = 1e9
    lines = [
        "# MoE reshard: planner simulation vs NeMo-RL's published refit times",
        "",
        f"Command: `{command}` (planner only, bf16; times are bytes / {results[0]['gbps_per_gpu']:g} GB/s per GPU, "
        "the slowest rank's max(received, sent): what the planned traffic implies on an ideal network, not a "
        "measured time). NeMo-RL times are measured on H100 (PEERS.md section 2a). Model shapes, layouts and the "
        "DeepSeek-V3 approximations: see the docstring of `benchmarks/reshard_moe_sim.py`.",
        "",
        "| case | GPUs | train -> vLLM | received / rank max (mean) GB | lower bound max (mean) GB | sent max GB | "
        "naive max GB | time plan s | time naive s | NeMo-RL s | planner run s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['case']} ({r['params'] / 1e9:.0f}B) | {r['gpus']} | {r['train']} -> {r['infer']} | "
            f"{r['bytes_received_max'] / gb:.3f} ({r['bytes_received_mean'] / gb:.3f}) | "
            f"{r['bytes_lower_bound_max'] / gb:.3f} ({r['bytes_lower_bound_mean'] / gb:.3f}) | "
            f"{r['bytes_sent_max'] / gb:.3f} | {r['bytes_naive_max'] / gb:.1f} | {r['time_plan_s']:.4f} | "
            f"{r['time_naive_s']:.3f} | {r['nemo_rl_time']} | {r['plan_time_s']:.1f} |"
        )
    lines += ["", "received == lower bound on every rank: " + ", ".join(
        f"{r['case']}: {r['received_equals_lower_bound_on_every_rank']}" for r in results), "",
        "Reading the table: the lower bound is the bytes of each rank's vLLM shard that its own Megatron shards do "
        "not already hold (computed from the layouts, independently of the plan); the plan receives exactly that "
        "on every rank. Naive = every rank gathers the full model (minus what it holds). The implied times are a "
        "network bound for the planned bytes only; NeMo-RL's are end-to-end measurements (packing, NCCL launches, "
        "vLLM weight loading), so the gap between the columns is not a measured speed-up: megarl's reshard has not "
        "been timed on these clusters. The sent column shows the greedy source balancing's spread (the slowest "
        "sender bounds the time).", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", choices=list(CASES), action="append", help="default: every case")
    p.add_argument("--gbps", type=float, default=400.0, help="per-GPU bandwidth for the implied times (GB/s)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "reshard_moe_sim"),
                   help="write OUT.md and OUT.json (only when every case runs)")
    args = p.parse_args(argv)
    results = [run_case(name, args.gbps) for name in (args.case or list(CASES))]
    if not args.case:
        command = "python benchmarks/reshard_moe_sim.py" + (f" --gbps {args.gbps:g}" if args.gbps != 400 else "")
        from megarl.platform.host import host_cpu

        cpu = host_cpu()  # the planner's run time (plan_time_s) was measured on this host
        with open(args.out + ".json", "w") as f:
            json.dump([{**r, "host_cpu": cpu} for r in results], f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(markdown(results, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
