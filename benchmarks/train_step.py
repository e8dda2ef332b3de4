"""Actor update throughput: megarl's Megatron actor (PPO loss, DistributedOptimizer) at a chosen model shape and
layout, in tokens/s (real tokens, prompt + response, per optimizer step) and, on GPU, MFU.

On CPU the same run also times a plain transformers + torch.optim.AdamW baseline doing the same update (same
model weights, same batch, same PPO loss and micro-batch size, same grad clipping) in one process with as many
threads as megarl has ranks, and prints megarl / baseline.

    python benchmarks/train_step.py --layers 4 --hidden 256 --heads 8 --kv-heads 4 --ffn 688 --vocab 2048 \
        --tp 2 --batch 8 --prompt-len 64 --response-len 192 --micro-batch-samples 2 --steps 3

Under torchrun the current world is used; otherwise `--world` ranks are spawned (gloo on CPU, NCCL on GPU).
Results go to benchmarks/results/train_step_<tag>.json (tag from --tag or the shape and layout).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import torch

PEAK_TFLOPS = {"bf16": 989.0, "fp32": 67.0}  # H100 SXM dense; override with --peak-tflops


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="llama", choices=["llama", "qwen2", "qwen3", "mistral"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--ffn", type=int, default=688)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--batch", type=int, default=8, help="samples per optimizer step (global)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--response-len", type=int, default=192)
    p.add_argument("--micro-batch-samples", type=int, default=2, help="per DP rank")
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="token budget per DP rank (overrides)")
    p.add_argument("--steps", type=int, default=3, help="timed updates (after one warm-up)")
    p.add_argument("--dtype", default=None, help="fp32 (CPU default) or bf16 (GPU default)")
    p.add_argument("--peak-tflops", type=float, default=None, help="per-device peak for MFU (GPU)")
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--tag", default=None)
    return p.parse_args(argv)


def _batch(args, vocab: int, seed: int = 0):
    from megarl.data.batch import Batch

    g = torch.Generator().manual_seed(seed)
    S = args.prompt_len + args.response_len
    ids = torch.randint(3, vocab, (args.batch, S), generator=g)
    am = torch.ones(args.batch, S, dtype=torch.long)
    rm = torch.zeros(args.batch, S, dtype=torch.long)
    rm[:, args.prompt_len:] = 1
    adv = torch.randn(args.batch, 1, generator=g).expand(-1, S) * rm
    return Batch({"input_ids": ids, "attention_mask": am, "response_mask": rm, "advantages": adv.contiguous()})


def _megarl_worker(rank: int, world: int, args, hf_dir: str):
    from megarl.models.spec import ModelSpec
    from megarl.parallel.groups import build_role_groups
    from megarl.parallel.topology import RoleTopology
    from megarl.platform.device import local_device
    from megarl.roles import Actor, BatchingSettings, OptimizerSettings

    spec = ModelSpec.from_hf_dir(hf_dir)
    groups = build_role_groups(RoleTopology(tp=args.tp, pp=args.pp, dp=args.dp))
    batching = BatchingSettings(
        micro_batch_samples=None if args.micro_batch_tokens else args.micro_batch_samples,
        micro_batch_tokens=args.micro_batch_tokens,
    )
    actor = Actor(spec, groups, optimizer=OptimizerSettings(lr=1e-5, clip_grad=1.0, weight_decay=0.01),
                  batching=batching, dtype=args.dtype, hf_dir=hf_dir)
    batch = _batch(args, spec.vocab_size)
    old = actor.compute_log_probs(batch)
    old_lp = old["log_probs"] if old is not None else torch.zeros(batch["input_ids"].shape)
    if groups.topology.pp > 1:  # old log-probs live on the last stage; every stage takes the same batch
        # on the platform's device (as benchmarks/reshard.py's collective_device): an NCCL world has no CPU backend
        old_lp = old_lp.to(local_device())
        torch.distributed.broadcast(old_lp, src=groups.pp_ranks[-1], group=groups.pgs.pp)
        old_lp = old_lp.cpu()  # the batch stays on the host, where compute_log_probs returns it
    batch = batch.update({"old_log_probs": old_lp})
    runs = []
    for i in range(args.steps + 1):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        m = actor.update(batch)
        if i > 0:
            runs.append(m)
    return {"tokens_per_s": [m["tokens_per_s"] for m in runs], "time_s": [m["time_s"] for m in runs],
            "tokens": runs[0]["tokens"], "loss": runs[-1]["loss"]}


def _baseline(args, hf_dir: str, threads: int):
    """transformers + torch AdamW, one process: the same PPO update over the same micro-batches."""
    from transformers import AutoModelForCausalLM

    from megarl.algorithms import policy_loss

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)
    batch = _batch(args, model.config.vocab_size)
    with torch.no_grad():
        logits = model(batch["input_ids"]).logits
    old = torch.zeros(batch["input_ids"].shape)
    old[:, 1:] = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    batch = batch.update({"old_log_probs": old * batch["response_mask"]})
    mb = args.micro_batch_samples
    n_tokens = batch["response_mask"].sum()
    times = []
    for i in range(args.steps + 1):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for part in batch.split(mb):
            ids, mask = part["input_ids"], part["response_mask"]
            logits = model(ids).logits
            lp = torch.zeros(ids.shape)
            lp[:, 1:] = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
            loss, _ = policy_loss(lp * mask, part["old_log_probs"], part["advantages"], mask,
                                  global_normalizer=n_tokens)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if i > 0:
            times.append(time.perf_counter() - start)
    tokens = float(batch["attention_mask"].sum())
    return {"tokens_per_s": [tokens / t for t in times], "time_s": times, "tokens": tokens}


def main(argv=None):
    args = _args(argv)
    on_gpu = torch.cuda.is_available()
    args.dtype = args.dtype or ("bf16" if on_gpu else "fp32")
    world = args.tp * args.pp * args.dp
    from megarl.checkpoint.tiny import make_hf_model
    from megarl.models.spec import ModelSpec
    from megarl.platform.spawn import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = make_hf_model(
            args.arch, os.path.join(tmp, "hf"), num_hidden_layers=args.layers, hidden_size=args.hidden,
            num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
            intermediate_size=args.ffn, vocab_size=args.vocab,
            max_position_embeddings=max(128, args.prompt_len + args.response_len),
        )
        spec = ModelSpec.from_hf_dir(hf_dir)
        per_rank = run_ranks(world, _megarl_worker, args, hf_dir, timeout_s=3600)
        ours = per_rank[-1]  # every rank reports the same metrics; take the last stage's
        base = None
        if not on_gpu and not args.no_baseline:
            base = _baseline(args, hf_dir, threads=world)
    tps = statistics.median(ours["tokens_per_s"])
    from megarl.platform.host import host_cpu

    result = {
        "host_cpu": host_cpu(),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "gpu": torch.cuda.get_device_name() if on_gpu else None, "torch": torch.__version__,
                    "load_avg_1m_at_end": os.getloadavg()[0]},  # shared machines: other jobs skew timings
        "model": {"arch": args.arch, "params": spec.num_params, "layers": args.layers, "hidden": args.hidden,
                  "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "ffn": args.ffn,
                  "vocab": args.vocab},
        "layout": {"tp": args.tp, "pp": args.pp, "dp": args.dp, "world": world, "dtype": args.dtype},
        "batch": {"samples": args.batch, "prompt_len": args.prompt_len, "response_len": args.response_len,
                  "micro_batch_samples": args.micro_batch_samples, "micro_batch_tokens": args.micro_batch_tokens},
        "megarl": {"tokens_per_s_median": tps, **ours},
    }
    if on_gpu:
        # 6 N flops per token for forward + backward (attention's s^2 term ignored at these lengths)
        peak = (args.peak_tflops or PEAK_TFLOPS.get(args.dtype, PEAK_TFLOPS["bf16"])) * 1e12
        result["megarl"]["mfu"] = 6 * spec.num_params * tps / (peak * world)
    if base is not None:
        btps = statistics.median(base["tokens_per_s"])
        result["baseline_transformers_adamw"] = {"tokens_per_s_median": btps, "threads": world, **base}
        result["ratio_megarl_over_baseline"] = tps / btps
    tag = args.tag or f"{args.arch}_l{args.layers}h{args.hidden}_tp{args.tp}pp{args.pp}dp{args.dp}_{args.dtype}"
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"train_step_{tag}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    line = (
        f"megarl actor update: {tps:,.0f} tokens/s ({spec.num_params / 1e6:.2f}M params, "
        f"tp{args.tp} pp{args.pp} dp{args.dp}, {args.dtype})"
    )
    if "mfu" in result["megarl"]:
        line += f", MFU {result['megarl']['mfu']:.1%}"
    print(line)
    if base is not None:
        base_tps = result["baseline_transformers_adamw"]["tokens_per_s_median"]
        print(f"transformers + AdamW baseline ({world} threads): {base_tps:,.0f} tokens/s; "
              f"ratio megarl/baseline = {result['ratio_megarl_over_baseline']:.2f}")
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
