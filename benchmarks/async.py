"""The same RL job in each `trainer.mode`, on the same total cores: step time, generated tokens/s, time split,
each pool's busy fraction and the staleness figures (docs/async.md).

    python benchmarks/async.py [--steps 16] [--skip 4] [--layouts 1+1,2+2,colocated] [--json results/async.json]

Layouts (the quickstart task and model of `yaml_configs/cpu_quickstart_rollout_pool.yaml`; on this 2-core machine
each worker process gets one core, `resources.threads_per_worker=1`):
- colocated: sync on 2 processes (actor TP2, the engines in the actor's processes, two TP1 engines) -- the hybrid
  engine, the default;
- 1+1: actor TP1 on 1 process + one TP1 engine on a rollout pool of 1 process: sync, one_step_off, async
  (max_staleness 1 and 4) and async with partial rollouts (continue);
- 2+2: actor TP2 on 2 processes + two TP1 engines on 2 (4 processes on 2 cores): sync, one_step_off, async s1.

The runs of a layout share one `TrainingSession` (its workers start once) and each starts from the session's step-0
checkpoint (`TrainingSession.train_from`, as `tests/e2e/async_runs.py` does). Per run: the mean over steps
skip+1..steps of the step time, generated (sampled) tokens per second, the split (rollout wait, log-probs, update,
sync), the busy fractions and the staleness. The one-machine goal: an async step takes at most max(rollout, train) +
sync, where rollout, train and sync are the same layout's sync-mode figures (rollout = time/rollout_s, sync =
time/sync_weights_s, train = the rest of the step); the table gives that bound beside each mode.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
CONFIG = os.path.join(ROOT, "yaml_configs", "cpu_quickstart_rollout_pool.yaml")
TIS = "algorithm.rollout_correction.tis=token"

LAYOUTS = {
    "colocated": (["rollout.pool=null", "actor.pool=train", "resources.pools.rollout=null"],
                  {"sync": []}),
    "1+1": (["resources.pools.train.devices_per_node=1", "resources.pools.rollout.devices_per_node=1",
             "actor.parallel.tp=1", "reference.parallel.tp=1"],
            {"sync": [], "one_step_off": ["trainer.mode=one_step_off", TIS],
             "async_s1": ["trainer.mode=async", TIS],
             "async_s4": ["trainer.mode=async", "trainer.max_staleness=4", TIS],
             "async_s1_continue": ["trainer.mode=async", "rollout.partial=continue", TIS]}),
    "2+2": ([], {"sync": [], "one_step_off": ["trainer.mode=one_step_off", TIS],
                 "async_s1": ["trainer.mode=async", TIS]}),
}
PHASES = ("rollout", "rollout_wait", "reward", "old_log_probs", "ref_log_probs", "advantages", "update_actor",
          "sync_weights")


def _data(layout_overrides: list[str]):
    import yaml

    from megarl.config.loader import apply_overrides

    data = yaml.safe_load(open(CONFIG))
    for key in ("train_path", "val_path"):
        data["data"][key] = os.path.join(ROOT, data["data"][key])
    data["model"]["tokenizer"] = os.path.join(ROOT, data["model"]["tokenizer"])
    data["logging"].update(plots=False, progress="lines")
    data["trainer"].update(val_every=0)
    data["resources"]["threads_per_worker"] = 1
    data = apply_overrides(data, layout_overrides)
    if data["resources"]["pools"].get("rollout") is None:
        data["resources"]["pools"].pop("rollout", None)
    return data


def run_layout(name: str, steps: int, skip: int, out: str) -> dict:
    """Every mode of layout `name` in one session; {mode: figures}."""
    from megarl.config.loader import parse_config
    from megarl.config.validate import validate
    from megarl.trainer.session import TrainingSession

    layout_overrides, modes = LAYOUTS[name]
    data = _data(layout_overrides)
    base = validate(parse_config(data, [f"logging.dir={os.path.join(out, 'session')}"]))
    session = TrainingSession(base)
    results = {}
    try:
        first = session.start()
        step0 = first.save(0, root=os.path.join(out, "step0"))
        for mode, overrides in modes.items():
            run_dir = os.path.join(out, mode)
            session.train_from(step0, run_dir, [*overrides, f"trainer.total_steps={steps}", "checkpoint.save_every=0"],
                               raw=data)
            rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))][skip:]
            results[mode] = summarize(rows)
            print(f"[async bench] {name} {mode}: {results[mode]['step_s']:.3f} s/step", flush=True)
    finally:
        session.close()
    return results


def summarize(rows: list[dict]) -> dict:
    """Means over the measured steps of what the table shows."""
    def mean(key: str) -> float:
        return statistics.fmean(r.get(key, 0.0) for r in rows)

    step = mean("time/step_s")
    sampled = statistics.fmean(r["response_length/mean"] * r["samples"] for r in rows)
    out = {"steps_measured": len(rows), "step_s": step,
           "step_s_median": statistics.median(r["time/step_s"] for r in rows),
           "generated_tokens_per_s": sampled / step, "reward_last": rows[-1]["reward/mean"],
           "split_s": {p: mean(f"time/{p}_s") for p in PHASES if any(f"time/{p}_s" in r for r in rows)}}
    out["train_s"] = step - sum(out["split_s"].get(p, 0.0) for p in ("rollout", "rollout_wait", "reward",
                                                                     "sync_weights"))
    for key in ("async/staleness_mean", "async/staleness_max", "async/rollout_busy_frac", "async/train_busy_frac",
                "async/dropped_batches", "async/buffer_batches", "async/continued_requests"):
        if key in rows[-1]:
            out[key.split("/", 1)[1]] = mean(key) if "frac" in key or "mean" in key else rows[-1][key]
    return out


def report(results: dict, args, seconds: float) -> dict:
    """Add the one-machine bound of each layout (from its sync run) and each mode's ratio to it."""
    for modes in results.values():
        sync = modes.get("sync")
        if sync is None:
            continue
        rollout, sync_s = sync["split_s"].get("rollout", 0.0), sync["split_s"].get("sync_weights", 0.0)
        bound = max(rollout, sync["train_s"]) + sync_s
        for figures in modes.values():
            figures["bound_s"] = bound
            figures["vs_bound"] = figures["step_s"] / bound
            figures["speedup_vs_sync"] = sync["step_s"] / figures["step_s"]
            if "colocated" in results:
                figures["speedup_vs_colocated_sync"] = results["colocated"]["sync"]["step_s"] / figures["step_s"]
    return {"benchmark": "async", "command": "python benchmarks/async.py " + " ".join(sys.argv[1:]),
            "machine": {"cpu": _cpu(), "cores": os.cpu_count(), "python": platform.python_version(),
                        "load_avg_1m_end": os.getloadavg()[0]},
            "steps": args.steps, "skip": args.skip, "seconds": seconds, "results": results}


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=16, help="steps per run")
    p.add_argument("--skip", type=int, default=4, help="first steps left out of the means (warm-up, the pipeline "
                   "filling)")
    p.add_argument("--layouts", default="colocated,1+1,2+2", help="comma-separated subset of " + ",".join(LAYOUTS))
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    started = time.monotonic()
    results = {}
    for layout in args.layouts.split(","):
        with tempfile.TemporaryDirectory(prefix=f"megarl_async_{layout}_") as out:
            results[layout] = run_layout(layout, args.steps, args.skip, out)
    doc = report(results, args, time.monotonic() - started)
    text = json.dumps(doc, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
