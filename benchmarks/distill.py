"""On-policy distillation vs GRPO on the quickstart's addition task: held-out greedy accuracy against RL steps.

    python benchmarks/distill.py --teacher RUN/hf --steps 40 --val-every 5 \
        --json benchmarks/results/distill_addition_cpu.json --md benchmarks/results/distill_addition_cpu.md

Teacher: the addition quickstart's trained model (`megarl quickstart --out RUN` writes RUN/hf: SFT then 200 GRPO
steps; without --teacher this script runs that first, ~4 min on 2 cores; its accuracy is read from
RUN/summary.json). Student: the quickstart's own short SFT warm-up of the same random Llama (300 steps of 64
problems at lr 2e-3, the same seeds, so the same weights the quickstart's GRPO stage starts from), rerun in each arm.
Then, from that student, with the same number of steps,
prompts per step (32) and samples per prompt (8), learning rate and seeds:
  grpo     the quickstart's GRPO: exact-match reward, group-normalised advantages;
  distill  on-policy distillation: the student samples, the teacher (Megatron forward-only, colocated) scores every
           sampled token; advantage = teacher log-prob - student log-prob per token (distillation.coef 1,
           task_reward_coef 0: no task reward at all).
Both arms run `TrainingSession.fit` (vLLM rollout at temperature 1, PPO-clipped update on Megatron, reshard into
vLLM). Accuracy: greedy (temperature 0) exact match over the 200 held-out problems (the teacher never trained on them:
the same seeded split), through vLLM, after SFT (step 0) and every --val-every steps. Each arm is its own process.
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
ARMS = ("distill", "grpo")


def arm_config(arm: str, base: dict, teacher: str) -> dict:
    """The arm's `megarl train` config (a dict): the quickstart's GRPO job, with the teacher for `distill`."""
    cfg = json.loads(json.dumps(base))
    cfg["checkpoint"] = {"dir": None}
    if arm == "distill":
        cfg["distillation"] = {"teachers": {"quickstart": {"path": teacher, "parallel": {"tp": 2},
                                                           "micro_batch_samples": 64}},
                               "coef": 1.0, "task_reward_coef": 0.0}
    return cfg


def run_arm(arm: str, teacher: str, out: str, steps: int, val_every: int, seed: int) -> dict:
    """One arm in this process: data, session (sft=True), the quickstart's SFT, then `steps` RL steps."""
    from megarl.platform.vendor_logs import quiet_vendors

    quiet_vendors("error")
    from megarl.config.loader import parse_config
    from megarl.config.validate import validate
    from megarl.data.arithmetic import build_arithmetic
    from megarl.data.dataset import PromptDataset
    from megarl.trainer.quickstart import QuickstartSettings, accuracy, greedy_answers, job_config
    from megarl.trainer.session import TrainingSession
    from megarl.trainer.sft import sft_batch

    s = QuickstartSettings(out=out, grpo_steps=steps, val_every=val_every, seed=seed)
    data = build_arithmetic(os.path.join(out, "data"), n_val=s.n_val, seed=s.seed)
    cfg = validate(parse_config(arm_config(arm, job_config(s, data), teacher)))
    train = list(PromptDataset.from_config(cfg.data, split="train"))
    val = list(PromptDataset.from_config(cfg.data, split="val"))
    session = TrainingSession(cfg, sft=True)
    t0 = time.perf_counter()
    try:
        workers = session.start_workers()
        # the quickstart's SFT warm-up (megarl.trainer.quickstart.run_quickstart): same batches, steps and lr
        rng = random.Random(s.seed + 2)
        for _ in range(s.sft_steps):
            session.sft_step(sft_batch(session.encoder, rng.sample(train, s.sft_batch)), s.sft_lr)
        workers.sync_weights()
        after_sft = accuracy(greedy_answers(workers, session.encoder, val), val)
        sft_s = time.perf_counter() - t0
        t = time.perf_counter()
        results = session.fit()
        rl_s = time.perf_counter() - t
    finally:
        session.close()
    curve = {"0": after_sft}  # step (as a JSON key) -> held-out greedy accuracy
    curve.update({str(r.step): r.metrics["val/reward_mean"] for r in results if "val/reward_mean" in r.metrics})
    per_step = [{k: v for k, v in r.metrics.items() if k.startswith(("distill/", "reward/mean", "time/step_s",
                                                                      "time/teacher"))} for r in results]
    return {"arm": arm, "accuracy_by_step": curve, "per_step": per_step, "sft_s": round(sft_s, 1),
            "rl_s": round(rl_s, 1), "rl_step_s_mean": round(rl_s / max(len(results), 1), 2)}


def first_step_reaching(curve: dict, target: float) -> str:
    """The first measured step whose accuracy is >= target, as text ('never' when none is)."""
    step = next((int(k) for k, v in sorted(curve.items(), key=lambda kv: int(kv[0])) if v >= target - 1e-9), None)
    return "never" if step is None else str(step)


def findings(result: dict) -> list[str]:
    """What the curves say, from the result's numbers alone."""
    arms, steps = result["arms"], result["steps"]
    grpo_final = arms["grpo"]["accuracy_by_step"][str(steps)]
    out = [f"GRPO's accuracy after {steps} steps: {grpo_final:.3f}; first measured step at or above it: "
           + ", ".join(f"{n} {first_step_reaching(a['accuracy_by_step'], grpo_final)}"
                       for n, a in arms.items()) + "."]
    teacher = result.get("teacher_accuracy")
    for target in sorted({0.8, *([teacher] if teacher is not None else [])}):
        what = f"the teacher's {target:.3f}" if target == teacher else f"{target:.2f}"
        out.append(f"First measured step at or above {what}: " + ", ".join(
            f"{n} {first_step_reaching(a['accuracy_by_step'], target)}" for n, a in arms.items()) + ".")
    means = {n: sum(v for k, v in a["accuracy_by_step"].items() if k != "0")
             / max(1, sum(1 for k in a["accuracy_by_step"] if k != "0")) for n, a in arms.items()}
    out.append("Mean held-out accuracy over the measured steps after 0: " + ", ".join(
        f"{n} {m:.3f}" for n, m in means.items()) + " (one seed; 200 problems: a binomial standard error of ~0.03 "
        "per point).")
    kl = [s.get("distill/reverse_kl/quickstart") for s in arms.get("distill", {}).get("per_step", [])]
    kl = [k for k in kl if k is not None]
    if len(kl) >= 10:
        out.append(f"distill/reverse_kl/quickstart (nats per sampled token): {sum(kl[:5]) / 5:.3f} over steps 1-5, "
                   f"{sum(kl[-5:]) / 5:.3f} over the last 5.")
    out.append("Seconds per RL step (the RL stage's wall time / steps, validation included): " + ", ".join(
        f"{n} {a['rl_step_s_mean']}" for n, a in arms.items()) + ".")
    return out


def markdown(result: dict) -> str:
    arms = result["arms"]
    steps = sorted({int(k) for a in arms.values() for k in a["accuracy_by_step"]})
    cpu = result["host_cpu"]
    isa = ", ".join(k for k, v in cpu.get("isa", {}).items() if v)
    teacher = result.get("teacher_accuracy")
    lines = [f"# On-policy distillation vs GRPO, addition task ({result['date']})", "",
             f"Machine: {cpu.get('model')} ({cpu.get('vendor')}, {cpu.get('logical_cpus')} logical CPUs; {isa}).", "",
             f"Command: `{result['command']}`", "", result["setup"], "",
             "Teacher: the addition quickstart's trained model"
             + (f" (held-out greedy accuracy {teacher:.3f} in its own run)." if teacher is not None else "."), "",
             "Held-out greedy accuracy (200 problems) against RL steps:", "",
             "| step | " + " | ".join(arms) + " |", "|---|" + "---|" * len(arms)]
    for k in steps:
        cells = [a["accuracy_by_step"].get(str(k)) for a in arms.values()]
        lines.append(f"| {k} | " + " | ".join("-" if c is None else f"{c:.3f}" for c in cells) + " |")
    lines += [""] + [f"- {line}" for line in findings(result)] + [""]
    return "\n".join(lines)


def teacher_accuracy(teacher: str):
    """The teacher's held-out accuracy from its quickstart run's summary.json (beside its hf/), else None."""
    path = os.path.join(os.path.dirname(os.path.abspath(teacher)), "summary.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f).get("accuracy_after_grpo")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--teacher", default=None, help="the quickstart's HF export (RUN/hf); default: run the quickstart")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--val-every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--md", default=None)
    p.add_argument("--render", default=None, help="rewrite --md from this result JSON (no run)")
    p.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # internal: one arm in this process
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            result = json.load(f)
        result["finding"] = " ".join(findings(result))
        with open(args.render, "w") as f:
            json.dump(result, f, indent=1)
        with open(args.md, "w") as f:
            f.write(markdown(result))
        return 0
    if args.arm:
        result = run_arm(args.arm, args.teacher, args.out, args.steps, args.val_every, args.seed)
        with open(os.path.join(args.out, "arm.json"), "w") as f:
            json.dump(result, f)
        return 0
    from megarl.platform.host import host_cpu

    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "RAY_"))}
    with tempfile.TemporaryDirectory(prefix="megarl-distill-") as tmp:
        teacher = args.teacher
        if teacher is None:
            subprocess.run([sys.executable, "-m", "megarl", "quickstart", "--seed", str(args.seed), "--out",
                            os.path.join(tmp, "teacher")], cwd=ROOT, env=env, check=True, timeout=3600)
            teacher = os.path.join(tmp, "teacher", "hf")
        arms = {}
        for arm in ARMS:
            out = os.path.join(tmp, arm)
            subprocess.run([sys.executable, os.path.abspath(__file__), "--arm", arm, "--teacher", teacher, "--out",
                            out, "--steps", str(args.steps), "--val-every", str(args.val_every), "--seed",
                            str(args.seed)], cwd=ROOT, env=env, check=True, timeout=3600)
            with open(os.path.join(out, "arm.json")) as f:
                arms[arm] = json.load(f)
            print(arm, json.dumps(arms[arm]["accuracy_by_step"]), flush=True)
    result = {
        "what": "on-policy distillation (teacher = the addition quickstart's trained model) vs GRPO with the "
                "exact-match reward, from the quickstart's SFT student",
        "command": "python benchmarks/distill.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.date.today().isoformat(), "host_cpu": host_cpu(),
        "setup": (f"Both arms: the quickstart's SFT student (300 steps), then {args.steps} RL steps of 32 prompts x "
                  "8 samples, lr 3e-4, PPO clip 0.2/0.28, rollout temperature 1, actor TP2 + vLLM TP2 on 2 CPU "
                  "processes. distill: advantage = teacher - student log-prob per sampled token (coef 1, no task "
                  "reward); grpo: exact-match reward, group-normalised."),
        "steps": args.steps, "val_every": args.val_every, "seed": args.seed, "arms": arms,
        "teacher_accuracy": teacher_accuracy(teacher),
    }
    result["finding"] = " ".join(findings(result))
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
