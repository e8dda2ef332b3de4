"""`megarl quickstart [--out DIR]`: SFT, then GRPO, teach a small random Llama two-digit addition, end to end.

Stages (times in OUT/summary.json, seconds):
  1. data    the task (`megarl.data.arithmetic`: 8100 problems "a+b=" with 10 <= a, b <= 99, seeded split into
             train and `val` held-out problems), a character-level tokenizer and a random HF Llama -> OUT/data/.
  2. setup   the GRPO job's `TrainingSession` (sft=True): a local Ray cluster and the actor's pool, 2 worker
             processes, each a Megatron actor rank (TP=2) and a vLLM engine rank (TP=2) fed by the reshard
             (`megarl.trainer.sft.SFTWorker`, a `HybridWorker`).
  3. sft     supervised warm-up on the Megatron actor (cross-entropy on the answer tokens, `update_actor_sft`),
             a fixed `sft_steps` steps (the same on every machine for a given seed; the greedy accuracy on a fixed
             monitor set of *training* problems is logged every `sft_eval_every` steps). `sft_target` (off by
             default) stops it earlier once that accuracy reaches the target -- where that happens moves with the
             host's kernels, which is why it is not the default. The held-out problems never decide anything.
  4. grpo    GRPO through the full stack (`TrainingSession.fit`: vLLM rollout at temperature 1, exact-match reward,
             group-normalised advantages, PPO-clipped update on Megatron, reshard into vLLM), on the same workers,
             from the warmed-up weights and optimizer state. Metrics per step in OUT/metrics.jsonl.
  5. export  a checkpoint of the actor (OUT/checkpoint) written as a HuggingFace model (OUT/hf,
             `megarl.checkpoint.export.export_hf`), then loaded back with transformers and its greedy answers
             compared with vLLM's on the sample prompts.
Accuracy everywhere is **greedy** (temperature 0, one response per problem) exact match over all held-out problems
(`accuracy_*` in summary.json), measured through the vLLM rollout engine after a reshard. OUT/samples.md holds a
table of sample answers after SFT, after GRPO and from the HF export; OUT/plots/*.png the GRPO stage's plots
(`megarl.trainer.plots.plot_run`, needs matplotlib: without it a warning and no plots).

Measured (2-core CPU, defaults, benchmarks/results/quickstart_cpu.json): held-out accuracy 0.000 (random) -> 0.370
after SFT (300 steps, 26 s) -> 0.795 after GRPO (200 steps, 90 s); 154 s in all. In a plain-PyTorch
re-implementation used to choose the settings, GRPO at lr 1e-3-2e-3 or from a warm-up below ~0.15 gained little
or collapsed; lr 3e-4 with 32 prompts x 8 samples from ~0.4 gained ~0.3 in 150 steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import sys
import time
from typing import Optional

logger = logging.getLogger("megarl.quickstart")


@dataclasses.dataclass
class QuickstartSettings:
    """What `run_quickstart` does; the defaults are the README's command (measured in
    benchmarks/results/quickstart_cpu.json); tests run a short version."""

    out: str = "runs/quickstart"
    n_val: int = 200  # held-out problems
    n_monitor: int = 200  # training problems the SFT stopping rule looks at
    sft_batch: int = 64
    sft_lr: float = 2e-3
    sft_steps: int = 300  # fixed SFT length (steps of `sft_batch` problems)
    sft_target: Optional[float] = None  # stop SFT earlier once the monitor accuracy reaches it (None: never)
    sft_eval_every: int = 25
    grpo_steps: int = 200
    grpo_lr: float = 3e-4
    prompts_per_step: int = 32
    samples_per_prompt: int = 8
    val_every: int = 25
    n_samples_table: int = 12
    seed: int = 0
    vendor_level: str = "error"  # megarl.platform.vendor_logs: vLLM / Ray / megatron-core messages shown


def job_config(s: QuickstartSettings, data: dict[str, str]) -> dict:
    """The GRPO job (a `megarl train` config as a dict) on the files of `build_arithmetic`."""
    out = os.path.abspath(s.out)
    return {
        "model": {"path": data["model"], "dtype": "fp32"},
        "resources": {"device": "cpu", "pools": {"default": {"nodes": 1, "devices_per_node": 2}}},
        "actor": {
            "pool": "default", "parallel": {"tp": 2, "pp": 1, "cp": 1, "dp": 1},
            "optimizer": {"name": "adamw", "lr": s.grpo_lr, "weight_decay": 0.0, "clip_grad": 1.0,
                          "warmup_steps": 0, "lr_schedule": "constant"},
            "mini_batch_prompts": s.prompts_per_step, "micro_batch_samples": s.sft_batch,
        },
        "reference": {"enabled": False},
        "rollout": {"tp": 2, "samples_per_prompt": s.samples_per_prompt, "temperature": 1.0, "val_temperature": 0.0,
                    "max_prompt_tokens": 16, "max_new_tokens": 4, "kv_cache_gib": 1.0, "seed": s.seed},
        "algorithm": {"name": "grpo", "loss_agg": "token-mean", "clip_low": 0.2, "clip_high": 0.28,
                      "kl": {"coef": 0.0}},
        "data": {"train_path": data["train"], "val_path": data["val"], "prompts_per_step": s.prompts_per_step,
                 "prompt_key": "prompt", "answer_key": "answer", "chat_template": "none", "seed": s.seed},
        "reward": {"function": "exact_match"},
        "trainer": {"total_steps": s.grpo_steps, "seed": 1234, "val_every": s.val_every, "log_every": 1},
        "logging": {"backends": ["console", "jsonl"], "dir": out, "vendor_level": s.vendor_level},
        "checkpoint": {"dir": os.path.join(out, "checkpoint")},
    }


def greedy_answers(workers, encoder, records, seed: int = 0) -> list[str]:
    """Greedy (temperature 0) decoded responses of the rollout engines to `records`' prompts, in order, through the
    engines' request servers (`ColocatedRollout.serving`): one request per prompt, all in flight at once
    (`megarl.envs.episode.run_single_turn`, as the trainer's validation generates)."""
    import asyncio

    from megarl.controller import serving
    from megarl.envs.episode import run_single_turn
    from megarl.rollout.engine import SamplingSettings
    from megarl.rollout.service import ColocatedRollout

    prompts = [encoder.encode(r.prompt) for r in records]
    sampling = SamplingSettings(samples_per_prompt=1, temperature=0.0, max_new_tokens=4, seed=seed)
    texts: list[Optional[str]] = [None] * len(prompts)
    with ColocatedRollout(workers, serving_backend=serving).serving() as client:
        samples, _ = asyncio.run(run_single_turn(client, prompts, sampling, uid_prefix="eval/",
                                                 max_concurrent=max(1, len(prompts)), keep_outputs=False))
    for s in samples:
        texts[s.prompt_index] = encoder.decode(s.response_ids)
    return ["" if t is None else t for t in texts]


def accuracy(answers: list[str], records) -> float:
    """Exact-match accuracy (the `exact_match` reward's rule) of `answers` against `records`' answers."""
    from megarl.rewards.builtin import exact_match

    return sum(exact_match(a, r.answer, {}) for a, r in zip(answers, records)) / max(len(records), 1)


def samples_table(records, before: list[str], after: list[str], hf: Optional[list[str]] = None) -> str:
    """Markdown table of sample problems: the answer, the greedy response after SFT and after GRPO (and the exported
    HF model's), each marked right or wrong."""
    def cell(text: str, want: str) -> str:
        return f"`{text}` {'ok' if text.strip() == want else 'wrong'}"

    head = "| problem | answer | after SFT | after GRPO |" + (" HF export (transformers) |" if hf else "")
    rule = "|---|---|---|---|" + ("---|" if hf else "")
    lines = [head, rule]
    for i, r in enumerate(records):
        row = f"| `{r.prompt}` | {r.answer} | {cell(before[i], r.answer)} | {cell(after[i], r.answer)} |"
        lines.append(row + (f" {cell(hf[i], r.answer)} |" if hf else ""))
    return "\n".join(lines) + "\n"


def hf_greedy_answers(hf_dir: str, prompts: list[str], max_new_tokens: int = 4) -> list[str]:
    """Greedy answers of the exported model loaded by transformers (fp32, CPU)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = tok(p, return_tensors="pt").input_ids
            gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)
            out.append(tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True))
    return out


def run_quickstart(s: QuickstartSettings) -> dict:
    """Run every stage (module docstring); returns the summary written to OUT/summary.json."""
    from megarl.platform.vendor_logs import quiet_vendors  # stdlib only

    # before megatron-core, vLLM and Ray are imported: megatron-core warns about Apex/TE at import time
    quiet_vendors(s.vendor_level)
    from megarl.config.loader import dump_yaml, parse_config
    from megarl.config.validate import validate
    from megarl.data.arithmetic import build_arithmetic
    from megarl.data.dataset import PromptDataset
    from megarl.trainer.session import TrainingSession
    from megarl.trainer.sft import sft_batch

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    out = os.path.abspath(s.out)
    if os.path.exists(os.path.join(out, "summary.json")) or os.path.exists(os.path.join(out, "checkpoint")):
        from megarl.config import ConfigError

        raise ConfigError(f"--out {out} holds an earlier quickstart run; choose another directory or remove it")
    os.makedirs(out, exist_ok=True)
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    data = build_arithmetic(os.path.join(out, "data"), n_val=s.n_val, seed=s.seed)
    cfg = validate(parse_config(job_config(s, data)))
    with open(os.path.join(out, "config.yaml"), "w") as f:
        f.write(dump_yaml(cfg))
    train = list(PromptDataset.from_config(cfg.data, split="train"))
    val = list(PromptDataset.from_config(cfg.data, split="val"))
    monitor = random.Random(s.seed + 1).sample(train, s.n_monitor)
    # the GRPO job's session (its loader, reward, held-out records), its workers able to take SFT steps too
    session = TrainingSession(cfg, sft=True)
    encoder = session.encoder
    times["data_s"] = time.perf_counter() - t0

    t = time.perf_counter()
    summary: dict = {}
    try:
        workers = session.start_workers()
        times["setup_s"] = time.perf_counter() - t

        t = time.perf_counter()
        workers.sync_weights()
        acc_initial = accuracy(greedy_answers(workers, encoder, val), val)
        times["eval_s"] = time.perf_counter() - t
        logger.info("held-out greedy accuracy of the random model: %.3f", acc_initial)

        # ---- SFT warm-up
        t = time.perf_counter()
        rng = random.Random(s.seed + 2)
        sft_curve, step, monitor_acc = [], 0, 0.0
        while step < s.sft_steps:
            step += 1
            m = session.sft_step(sft_batch(encoder, rng.sample(train, s.sft_batch)), s.sft_lr)
            if step % s.sft_eval_every == 0:
                workers.sync_weights()
                monitor_acc = accuracy(greedy_answers(workers, encoder, monitor), monitor)
                sft_curve.append({"step": step, "loss": m["loss"], "monitor_accuracy": monitor_acc})
                logger.info("sft step %d loss %.4f greedy accuracy on %d training problems %.3f", step, m["loss"],
                            len(monitor), monitor_acc)
                if s.sft_target is not None and monitor_acc >= s.sft_target:
                    break
        workers.sync_weights()
        times["sft_s"] = time.perf_counter() - t
        t = time.perf_counter()
        shown = val[: s.n_samples_table]
        after_sft = greedy_answers(workers, encoder, val)
        acc_sft = accuracy(after_sft, val)
        times["eval_s"] += time.perf_counter() - t
        logger.info("after SFT (%d steps): held-out greedy accuracy %.3f", step, acc_sft)

        # ---- GRPO
        t = time.perf_counter()
        results = session.fit()
        times["grpo_s"] = time.perf_counter() - t
        t = time.perf_counter()
        after_grpo = greedy_answers(workers, encoder, val)
        acc_grpo = accuracy(after_grpo, val)
        times["eval_s"] += time.perf_counter() - t
        logger.info("after GRPO (%d steps): held-out greedy accuracy %.3f", len(results), acc_grpo)
        summary = {
            "task": f"two-digit addition a+b=, {len(train)} training / {len(val)} held-out problems",
            "accuracy_kind": "greedy (temperature 0), exact match, every held-out problem, vLLM rollout engine",
            "accuracy_initial": acc_initial, "accuracy_after_sft": acc_sft, "accuracy_after_grpo": acc_grpo,
            "sft_steps": step, "sft_batch": s.sft_batch, "sft_lr": s.sft_lr, "sft_target": s.sft_target,
            "sft_monitor_accuracy": monitor_acc, "sft_curve": sft_curve,
            "grpo_steps": len(results), "grpo_lr": s.grpo_lr, "prompts_per_step": s.prompts_per_step,
            "samples_per_prompt": s.samples_per_prompt,
            "grpo_reward_mean": [r.metrics["reward/mean"] for r in results],
            "grpo_val_accuracy": {str(r.step): r.metrics["val/reward_mean"] for r in results
                                  if "val/reward_mean" in r.metrics},
        }
        checkpoint = os.path.join(cfg.checkpoint.dir, f"step_{len(results):06d}")
    finally:
        session.close()

    # ---- export: Megatron checkpoint -> HF, then read back by transformers
    t = time.perf_counter()
    from megarl.checkpoint.export import export_hf

    export_hf(checkpoint, os.path.join(out, "hf"))
    hf = hf_greedy_answers(os.path.join(out, "hf"), [r.prompt for r in shown])
    times["export_s"] = time.perf_counter() - t
    summary["hf_export"] = os.path.join(out, "hf")
    summary["hf_matches_rollout_on_samples"] = sum(a == b for a, b in zip(hf, after_grpo)) / max(len(shown), 1)
    table = samples_table(shown, after_sft[: len(shown)], after_grpo[: len(shown)], hf)
    with open(os.path.join(out, "samples.md"), "w") as f:
        f.write(f"Greedy answers to the first {len(shown)} held-out problems.\n\n{table}")
    summary["samples"] = [{"prompt": r.prompt, "answer": r.answer, "after_sft": a, "after_grpo": b, "hf": h}
                          for r, a, b, h in zip(shown, after_sft, after_grpo, hf)]
    from megarl.trainer.plots import PlotsUnavailable, plot_run

    try:
        summary["plots"] = plot_run(out)  # OUT/plots/*.png from OUT/metrics.jsonl (the GRPO stage)
    except PlotsUnavailable as e:
        logger.warning("%s", e)
        summary["plots"] = []
    times["total_s"] = time.perf_counter() - t0
    summary.update({f"time_{k}": v for k, v in times.items()})
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(table)
    print(f"held-out greedy accuracy: random {acc_initial:.3f} -> after SFT ({summary['sft_steps']} steps) "
          f"{acc_sft:.3f} -> after GRPO ({summary['grpo_steps']} steps) {acc_grpo:.3f}; "
          f"{times['total_s']:.0f} s in all; summary in {os.path.join(out, 'summary.json')}")
    return summary


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `megarl quickstart` options (defaults: `QuickstartSettings`)."""
    d = QuickstartSettings()
    p.add_argument("--task", choices=("addition", "tools"), default="addition",
                   help="addition (default): two-digit addition, one response per prompt; tools: two-digit "
                   "multiplication answered through the calculator tool in multi-turn episodes "
                   "(megarl/trainer/tool_quickstart.py, yaml_configs/cpu_tools_quickstart.yaml)")
    p.add_argument("--out", default=None, help=f"output directory (default: {d.out}, or runs/tool_quickstart with "
                   "--task tools)")
    p.add_argument("--sft-steps", type=int, default=d.sft_steps,
                   help="SFT warm-up steps (%(default)s; fixed, so the warm-up ends at the same step on any machine)")
    p.add_argument("--sft-eval-every", type=int, default=d.sft_eval_every,
                   help="log the greedy accuracy on %d training problems every N SFT steps (default: %%(default)s)"
                   % d.n_monitor)
    p.add_argument("--sft-target", type=float, default=d.sft_target,
                   help="stop SFT early once that accuracy reaches this (default: off; where it stops then moves "
                   "with the machine's kernels)")
    p.add_argument("--grpo-steps", type=int, default=d.grpo_steps, help="GRPO steps (default: %(default)s)")
    p.add_argument("--val-every", type=int, default=d.val_every,
                   help="held-out validation every N GRPO steps (default: %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="seed of the data split, the random model, the SFT batches and the rollout sampling "
                   "(default: %(default)s)")
    p.add_argument("--verbose", action="store_true", help="show vLLM / Ray / megatron-core messages")


def run_from_args(args: argparse.Namespace) -> dict:
    """`megarl quickstart` with its parsed options: the addition task, or (--task tools) the tool-use one."""
    if getattr(args, "task", "addition") == "tools":
        from megarl.trainer.tool_quickstart import ToolQuickstartSettings, run_tool_quickstart

        d = ToolQuickstartSettings()
        sft = args.sft_steps if args.sft_steps != QuickstartSettings.sft_steps else d.sft_steps
        grpo = args.grpo_steps if args.grpo_steps != QuickstartSettings.grpo_steps else d.grpo_steps
        return run_tool_quickstart(ToolQuickstartSettings(
            out=args.out or d.out, sft_steps=sft, grpo_steps=grpo, seed=args.seed,
            vendor_level="info" if args.verbose else d.vendor_level))
    return run_quickstart(settings_from_args(args))


def settings_from_args(args: argparse.Namespace) -> QuickstartSettings:
    return QuickstartSettings(out=args.out or QuickstartSettings.out, sft_steps=args.sft_steps,
                              sft_eval_every=args.sft_eval_every,
                              sft_target=args.sft_target, grpo_steps=args.grpo_steps, val_every=args.val_every,
                              seed=args.seed,
                              vendor_level="info" if args.verbose else QuickstartSettings.vendor_level)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="megarl quickstart", description=__doc__.splitlines()[0])
    add_arguments(p)
    run_from_args(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
