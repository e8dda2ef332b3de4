"""LoRA (rank 8, rank 32) vs full fine-tuning on the quickstart's addition task: held-out greedy accuracy per RL
step, step time, optimizer-state bytes and weight-sync bytes per step.

    python benchmarks/lora.py --steps 20 --val-every 5 \
        --json benchmarks/results/lora_addition_cpu.json --md benchmarks/results/lora_addition_cpu.md

Every arm runs the quickstart's recipe (`megarl.trainer.quickstart`, as `benchmarks/distill.py` does): the same
random Llama, the same seeded SFT batches and number of SFT steps, then the same number of GRPO steps (32 prompts x
8 samples, exact-match reward) with `TrainingSession.fit`, in its own process. The arms differ only in what trains:
  full     every weight (the quickstart: SFT lr 2e-3, GRPO lr 3e-4);
  lora8    `actor.lora` rank 8, alpha 16 on qkv, proj, fc1, fc2; the base frozen; both lrs x --lora-lr-mult
           (default 10: LoRA wants ~10x full fine-tuning's lr, "LoRA Without Regret", Thinking Machines 2025);
  lora32   the same at rank 32 (alpha 64: the same alpha / rank scaling).
Weight sync: merged (base + (alpha / rank) B·A through the reshard; `megarl.reshard.lora_sync.actor_sync_sources`),
so every sync writes the full model into vLLM in every arm (colocated TP2 -> TP2: every piece is local, so the
measured `reshard/bytes_received` is 0); the bytes a delta sync would move (the adapted linears only, with LoRA)
and the adapter-only sync's bytes are computed beside them (`megarl.reshard.lora_sync.sync_bytes`).
Optimizer state: Adam's two fp32 moments per trainable parameter (fp32 model: no master copy), 8 bytes each.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = {"full": None, "lora8": 8, "lora32": 32}
ALPHA_PER_RANK = 2.0  # alpha = 2 x rank: PEFT's common 16 at rank 8, the same scaling at every rank


def arm_config(base: dict, rank, lr_mult: float) -> dict:
    cfg = json.loads(json.dumps(base))
    cfg["checkpoint"] = {"dir": None}
    if rank is not None:
        cfg["actor"]["lora"] = {"rank": rank, "alpha": ALPHA_PER_RANK * rank}
        cfg["actor"]["optimizer"]["lr"] *= lr_mult
    return cfg


def run_arm(arm: str, out: str, steps: int, val_every: int, seed: int, lr_mult: float, base=None,
            export_sft=None) -> dict:
    """One arm in this process: data, session (sft=True), the quickstart's SFT, then `steps` GRPO steps.
    base: start from this HF model (the full arm's SFT export) and skip the SFT; export_sft: write the model after
    SFT there (`TrainingSession.export_hf`)."""
    from megarl.platform.vendor_logs import quiet_vendors

    quiet_vendors("error")
    from megarl.checkpoint.hf_io import HFReader
    from megarl.config.loader import parse_config
    from megarl.config.memory import lora_num_params
    from megarl.config.validate import validate
    from megarl.data.arithmetic import build_arithmetic
    from megarl.data.dataset import PromptDataset
    from megarl.engine.lora import TARGETS
    from megarl.reshard.lora_sync import sync_bytes
    from megarl.trainer.quickstart import QuickstartSettings, accuracy, greedy_answers, job_config
    from megarl.trainer.session import TrainingSession
    from megarl.trainer.sft import sft_batch

    rank = ARMS[arm]
    s = QuickstartSettings(out=out, grpo_steps=steps, val_every=val_every, seed=seed)
    data = build_arithmetic(os.path.join(out, "data"), n_val=s.n_val, seed=s.seed)
    job = job_config(s, data)
    if base:
        job["model"]["path"] = base
    cfg = validate(parse_config(arm_config(job, rank, lr_mult)))
    sft_lr = s.sft_lr * (lr_mult if rank is not None else 1.0)
    train = list(PromptDataset.from_config(cfg.data, split="train"))
    val = list(PromptDataset.from_config(cfg.data, split="val"))
    session = TrainingSession(cfg, sft=True)
    t0 = time.perf_counter()
    try:
        workers = session.start_workers()
        rng = random.Random(s.seed + 2)
        for _ in range(0 if base else s.sft_steps):
            session.sft_step(sft_batch(session.encoder, rng.sample(train, s.sft_batch)), sft_lr)
        if export_sft:
            session.export_hf(export_sft)
        workers.sync_weights()
        after_sft = accuracy(greedy_answers(workers, session.encoder, val), val)
        sft_s = time.perf_counter() - t0
        t = time.perf_counter()
        results = session.fit()
        rl_s = time.perf_counter() - t
    finally:
        session.close()
    spec = HFReader(data["model"]).spec
    targets = TARGETS if rank is None else cfg.actor.lora.targets
    trainable = spec.num_params if rank is None else lora_num_params(spec, rank, targets)
    linears = []  # (in, out) of every adapted linear as HF lists them (q, k, v, gate, up separate)
    q, kv = spec.num_attention_heads * spec.head_dim, spec.num_query_groups * spec.head_dim
    per_layer = {"qkv": [(spec.hidden_size, q), (spec.hidden_size, kv), (spec.hidden_size, kv)],
                 "proj": [(q, spec.hidden_size)],
                 "fc1": [(spec.hidden_size, spec.ffn_hidden_size)] * 2,
                 "fc2": [(spec.ffn_hidden_size, spec.hidden_size)]}
    for _ in range(spec.num_layers):
        for tgt in targets:
            linears += per_layer[tgt]
    computed = sync_bytes(linears, rank or 8, 4, infer_tp=2, replicas=1)
    adapter_sync = computed["adapter"] if rank else None
    full_bytes = 4 * spec.num_params  # what the hybrid sync writes into the engine at every step (every weight)
    curve = {"0": after_sft}
    curve.update({str(r.step): r.metrics["val/reward_mean"] for r in results if "val/reward_mean" in r.metrics})
    per_step = [{k: v for k, v in r.metrics.items() if k.startswith(("reward/mean", "time/step_s"))
                 or ("reshard" in k and "bytes" in k)} for r in results]
    step_times = [p["time/step_s"] for p in per_step if "time/step_s" in p]
    sync = sorted({k for p in per_step for k in p if "bytes" in k})
    return {"arm": arm, "rank": rank, "lr": cfg.actor.optimizer.lr, "sft_lr": None if base else sft_lr,
            "start": "the full arm's SFT model" if base else "own SFT from the random model",
            "accuracy_by_step": curve, "per_step": per_step, "sft_s": round(sft_s, 1), "rl_s": round(rl_s, 1),
            "step_s_mean": round(sum(step_times) / max(len(step_times), 1), 3),
            "trainable_params": trainable, "optimizer_state_bytes": 8 * trainable,
            "sync_bytes_per_step": {k: per_step[-1].get(k) for k in sync} if per_step else {},
            "adapter_sync_bytes_per_step": adapter_sync, "written_bytes_per_step": full_bytes,
            "changed_bytes_per_step": full_bytes if rank is None else computed["merged"]}


def markdown(result: dict) -> str:
    arms = result["arms"]
    steps = sorted({int(k) for a in arms.values() for k in a["accuracy_by_step"]})
    cpu = result["host_cpu"]
    lines = [f"# LoRA vs full fine-tuning, addition task ({result['date']})", "",
             f"Machine: {cpu.get('model')} ({cpu.get('vendor')}, {cpu.get('logical_cpus')} logical CPUs).", "",
             f"Command: `{result['command']}`", "", result["setup"], "",
             "Held-out greedy accuracy (200 problems) after SFT (step 0) and against GRPO steps:", "",
             "| step | " + " | ".join(arms) + " |", "|---|" + "---|" * len(arms)]
    for k in steps:
        cells = [a["accuracy_by_step"].get(str(k)) for a in arms.values()]
        lines.append(f"| {k} | " + " | ".join("-" if c is None else f"{c:.3f}" for c in cells) + " |")
    lines += ["", "| arm | lr (GRPO / SFT) | trainable params | optimizer state | step time (mean) | written into "
              "vLLM per sync | of which changed (delta sync) | adapter-only sync (to 2 ranks) | measured reshard "
              "metrics |", "|---|---|---|---|---|---|---|---|---|"]
    for name, a in arms.items():
        adapter = a["adapter_sync_bytes_per_step"]
        sft_lr = "-" if a.get("sft_lr") is None else format(a["sft_lr"], ".1e")
        lines.append(f"| {name} | {a['lr']:.1e} / {sft_lr} | {a['trainable_params']:,} | "
                     f"{a['optimizer_state_bytes']:,} B | {a['step_s_mean']:.2f} s | "
                     f"{a['written_bytes_per_step']:,} B | {a['changed_bytes_per_step']:,} B | "
                     f"{'-' if adapter is None else format(adapter, ',')} B"
                     f" | {json.dumps(a['sync_bytes_per_step'])} |")
    lines += ["", f"Finding: {result.get('finding', '')}", ""]
    return "\n".join(lines)


def finding(result: dict) -> str:
    arms = result["arms"]
    last = {n: a["accuracy_by_step"][max(a["accuracy_by_step"], key=int)] for n, a in arms.items()}
    sft = {n: a["accuracy_by_step"]["0"] for n, a in arms.items()}
    return ("; ".join(f"{n}: {sft[n]:.3f} after SFT -> {last[n]:.3f} after {result['steps']} GRPO steps" for n in arms)
            + ". One seed on one machine: differences of a few points are within run-to-run noise of the sampling.")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--val-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lora-lr-mult", type=float, default=10.0)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--json", default=None)
    p.add_argument("--md", default=None)
    p.add_argument("--shared-sft", action="store_true",
                   help="LoRA arms start from the full arm's SFT model (no SFT of their own); runs full first")
    p.add_argument("--base", default=None, help=argparse.SUPPRESS)
    p.add_argument("--export-sft", default=None, help=argparse.SUPPRESS)
    p.add_argument("--render", default=None, help="rewrite --md from this result JSON (no run)")
    p.add_argument("--arm", choices=list(ARMS), help=argparse.SUPPRESS)  # internal: one arm in this process
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            result = json.load(f)
        with open(args.md, "w") as f:
            f.write(markdown(result))
        return 0
    if args.arm:
        result = run_arm(args.arm, args.out, args.steps, args.val_every, args.seed, args.lora_lr_mult, args.base,
                         args.export_sft)
        with open(os.path.join(args.out, "arm.json"), "w") as f:
            json.dump(result, f)
        return 0
    from megarl.platform.host import host_cpu

    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "RAY_"))}
    arms = {}
    with tempfile.TemporaryDirectory(prefix="megarl-lora-") as tmp:
        for arm in args.arms.split(","):
            out = os.path.join(tmp, arm)
            sft_model = os.path.join(tmp, "sft_model")
            extra = []
            if args.shared_sft:
                extra = ["--export-sft", sft_model] if ARMS[arm] is None else ["--base", sft_model]
            subprocess.run([sys.executable, os.path.abspath(__file__), "--arm", arm, "--out", out, "--steps",
                            str(args.steps), "--val-every", str(args.val_every), "--seed", str(args.seed),
                            "--lora-lr-mult", str(args.lora_lr_mult), *extra], cwd=ROOT, env=env, check=True,
                           timeout=3600)
            with open(os.path.join(out, "arm.json")) as f:
                arms[arm] = json.load(f)
            print(arm, json.dumps(arms[arm]["accuracy_by_step"]), arms[arm]["step_s_mean"], flush=True)
    result = {
        "what": "LoRA rank 8 and 32 vs full fine-tuning, quickstart SFT then GRPO, same steps",
        "command": "python benchmarks/lora.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.date.today().isoformat(), "host_cpu": host_cpu(),
        "shared_sft": args.shared_sft,
        "setup": (("LoRA arms start from the full arm's SFT model (shared warm-up). " if args.shared_sft else "")
                  + "Every arm: the quickstart's random Llama, its 300 seeded SFT steps, then "
                  f"{args.steps} GRPO steps of 32 prompts x 8 samples, actor TP2 + vLLM TP2 on 2 CPU processes; "
                  f"LoRA arms: lr x {args.lora_lr_mult:g} (SFT and GRPO), alpha = 2 x rank, targets qkv, proj, "
                  "fc1, fc2, merged sync."),
        "steps": args.steps, "val_every": args.val_every, "seed": args.seed, "lora_lr_mult": args.lora_lr_mult,
        "arms": arms,
    }
    result["finding"] = finding(result)
    print(result["finding"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.md:
        with open(args.md, "w") as f:
            f.write(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
