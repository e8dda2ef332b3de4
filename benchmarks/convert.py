#!/usr/bin/env python
"""Benchmark: wall time and peak RSS of HF -> Megatron -> HF for a ~1B-parameter-shaped random model on CPU.

The model has Llama-3.2-1B's shape (16 layers, hidden 2048, 32 heads / 8 KV heads, head_dim 64, ffn 8192,
vocab 128256, tied embeddings, llama3 rope scaling), random bf16 weights written straight to safetensors (no
hub download). Each conversion runs in its own process (the real tool, world of one) and reports its own peak
RSS, so the numbers are what a user sees. Results go to benchmarks/results/convert-<host>.json.

  python benchmarks/convert.py [--dtype bf16] [--layers 16] [--workdir /tmp/megarl-convert-bench]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHAPE = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048, intermediate_size=8192,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True, hidden_act="silu",
    rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
)

_RUN = (
    "import resource, runpy, sys, json\n"
    "sys.argv = json.loads(sys.argv[1])\n"
    "code = 0\n"
    "try:\n"
    "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
    "except SystemExit as e:\n"
    "    code = e.code or 0\n"
    "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)\n"
    "sys.exit(code)\n"
)


def write_random_model(out: str, layers: int, dtype: str) -> int:
    """Random weights with the HF names and shapes, written shard by shard; returns the parameter count."""
    import torch
    from safetensors.torch import save_file

    from megarl.checkpoint.name_map import hf_shapes
    from megarl.models.spec import ModelSpec

    os.makedirs(out, exist_ok=True)
    cfg = dict(SHAPE, num_hidden_layers=layers, torch_dtype={"bf16": "bfloat16", "fp32": "float32"}[dtype])
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 128000, "eos_token_id": 128001}, f)
    shapes = hf_shapes(ModelSpec.from_hf_config(cfg))
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    g = torch.Generator().manual_seed(0)
    weight_map, shard, shard_bytes, n_params, index = {}, {}, 0, 0, 0

    def flush():
        nonlocal shard, shard_bytes, index
        index += 1
        name = f"model-{index:05d}.safetensors"
        save_file(shard, os.path.join(out, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        shard, shard_bytes = {}, 0

    for name, shape in shapes.items():
        t = (torch.randn(shape, generator=g) * 0.02).to(torch_dtype)
        shard[name] = t
        shard_bytes += t.numel() * t.element_size()
        n_params += t.numel()
        if shard_bytes > 1 << 30:
            flush()
    if shard:
        flush()
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return n_params


def run_tool(tool: str, args: list[str]) -> dict:
    argv = [os.path.join(REPO, "checkpoint_tools", tool), *args]
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _RUN, json.dumps(argv)], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{tool} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    peak_kb = next(int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("PEAK_RSS_KB"))
    return {"seconds": round(seconds, 2), "peak_rss_gib": round(peak_kb / 1024**2, 3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--workdir", default="/tmp/megarl-convert-bench")
    p.add_argument("--out", default=None, help="result JSON (default benchmarks/results/convert-<host>.json)")
    args = p.parse_args(argv)

    import torch
    from safetensors import safe_open

    shutil.rmtree(args.workdir, ignore_errors=True)
    hf, mdir, hf2 = (os.path.join(args.workdir, n) for n in ("hf", "megatron", "hf2"))
    t0 = time.perf_counter()
    n_params = write_random_model(hf, args.layers, args.dtype)
    gen_s = time.perf_counter() - t0
    model_gib = n_params * (2 if args.dtype == "bf16" else 4) / 1024**3
    to_m = run_tool("hf_to_megatron.py", ["--hf-dir", hf, "--out", mdir])
    to_hf = run_tool("megatron_to_hf.py", ["--megatron-dir", mdir, "--out", hf2])

    # bit-exactness of the round trip, tensor by tensor
    def tensors(d):
        with open(os.path.join(d, "model.safetensors.index.json")) as f:
            return json.load(f)["weight_map"]

    a, b = tensors(hf), tensors(hf2)
    exact = sorted(a) == sorted(b)
    for name in a if exact else []:
        with safe_open(os.path.join(hf, a[name]), "pt") as fa, safe_open(os.path.join(hf2, b[name]), "pt") as fb:
            if not torch.equal(fa.get_tensor(name), fb.get_tensor(name)):
                exact = False
                break
    from megarl.platform.host import host_cpu

    result = {
        "benchmark": "convert", "host_cpu": host_cpu(), "model": f"llama-1B-shaped ({args.layers} layers)",
        "params": n_params,
        "dtype": args.dtype, "model_gib": round(model_gib, 3), "generate_seconds": round(gen_s, 1),
        "hf_to_megatron": to_m, "megatron_to_hf": to_hf, "round_trip_bit_exact": exact,
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "platform": platform.platform()},
    }
    text = json.dumps(result, indent=2)
    print(text)
    out = args.out or os.path.join(REPO, "benchmarks", "results", f"convert-{platform.node()}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        f.write(text + "\n")
    shutil.rmtree(args.workdir, ignore_errors=True)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
