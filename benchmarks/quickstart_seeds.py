"""`megarl quickstart` at several seeds, one after the other: what SFT and GRPO each add, seed by seed.

    python benchmarks/quickstart_seeds.py --seeds 0 1 2 --json benchmarks/results/quickstart_seeds_cpu.json

Each seed is one `megarl quickstart --seed S --out DIR` subprocess (defaults otherwise: a fixed 300 SFT steps, 200
GRPO steps), so the seed moves the data split, the random model, the SFT batches and the rollout sampling. Reported
per seed: the held-out greedy accuracy of the random model, after SFT and after GRPO, the GRPO gain (after GRPO -
after SFT) and the stage times; over the seeds: the mean and the worst gain. The host's CPU and ISA flags are
recorded (`megarl.platform.host`): the accuracies move with the host's kernels.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_seed(seed: int, out: str, extra: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "RAY_"))}
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.run([sys.executable, "-m", "megarl", "quickstart", "--seed", str(seed), "--out", out, *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"seed {seed}: megarl quickstart exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "summary.json")) as f:
        s = json.load(f)
    return {"seed": seed, "sft_steps": s["sft_steps"], "grpo_steps": s["grpo_steps"],
            "accuracy_initial": s["accuracy_initial"], "accuracy_after_sft": s["accuracy_after_sft"],
            "accuracy_after_grpo": s["accuracy_after_grpo"],
            "grpo_gain": round(s["accuracy_after_grpo"] - s["accuracy_after_sft"], 6),
            "time_total_s": round(s["time_total_s"], 1), "time_sft_s": round(s["time_sft_s"], 1),
            "time_grpo_s": round(s["time_grpo_s"], 1)}


def main(argv=None) -> int:
    from megarl.platform.host import host_cpu

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("quickstart_args", nargs="*", help="passed to megarl quickstart (after --)")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="megarl-qs-seeds-") as tmp:
        for seed in args.seeds:
            rows.append(run_seed(seed, os.path.join(tmp, f"seed{seed}"), args.quickstart_args))
            print(json.dumps(rows[-1]), flush=True)
    gains = [r["grpo_gain"] for r in rows]
    result = {
        "what": "megarl quickstart (SFT then GRPO, two-digit addition) at several seeds",
        "command": "python benchmarks/quickstart_seeds.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.date.today().isoformat(), "host_cpu": host_cpu(),
        "per_seed": rows, "grpo_gain_mean": round(sum(gains) / len(gains), 4), "grpo_gain_worst": min(gains),
        "accuracy_after_sft_mean": round(sum(r["accuracy_after_sft"] for r in rows) / len(rows), 4),
        "accuracy_after_grpo_mean": round(sum(r["accuracy_after_grpo"] for r in rows) / len(rows), 4),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "per_seed"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
