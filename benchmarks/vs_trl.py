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
`megarl train` (local Ray cluster, `--devices` worker processes: Megatron actor TP=devices + reference, vLLM TP=devices,
reshard), the run's `metrics.jsonl`. Each framework runs in its own subprocess, one after the other (never both at
once: they would share the cores). Reported per framework: the median step time over the steps after the first
(warm-up: compilation, allocator, first sync), and each one's split (megarl: its `time/*_s` metrics; TRL: its own
profiling contexts, captured from `trl.extras.profiling`), and megarl / TRL.

    pip install -e .[bench]         # TRL 1.16 (never a core dependency)
    python benchmarks/vs_trl.py --shape 0.6m --steps 6 --json benchmarks/results/vs_trl_0.6m_cpu.json
    python benchmarks/vs_trl.py --shape 24m --steps 4 --new-tokens 64 --json benchmarks/results/vs_trl_24m_cpu.json
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
def megarl_config(inputs: dict, steps: int, new_tokens: int, devices: int, run_dir: str, extra: list[str]) -> list:
    """`megarl train` overrides on top of yaml_configs/cpu_quickstart.yaml for the same work as TRL's run."""
    return [
        f"model.path={inputs['model']}", "model.tokenizer=null", "model.arch=null", "model.dtype=fp32",
        f"resources.pools.default.devices_per_node={devices}",
        f"actor.parallel.tp={devices}", f"reference.parallel.tp={devices}", f"rollout.tp={devices}",
        f"actor.optimizer.lr={LR}", f"actor.mini_batch_prompts={PROMPTS_PER_STEP}",
        "actor.micro_batch_samples=null", "actor.micro_batch_tokens=8192",
        "reference.micro_batch_samples=null", "reference.micro_batch_tokens=8192",
        f"rollout.samples_per_prompt={SAMPLES}", f"rollout.max_new_tokens={new_tokens}", "rollout.ignore_eos=true",
        "rollout.temperature=1.0", f"algorithm.kl.coef={KL_COEF}", "algorithm.kl.kind=low_var_kl",
        "algorithm.kl.placement=loss", f"data.train_path={inputs['train']}", "data.val_path=null",
        f"data.prompts_per_step={PROMPTS_PER_STEP}", f"trainer.total_steps={steps}", "trainer.val_every=0",
        f"logging.dir={run_dir}", *extra,
    ]


def run_megarl(inputs: dict, steps: int, new_tokens: int, devices: int, run_dir: str, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "megarl", "train", os.path.join(ROOT, "yaml_configs", "cpu_quickstart.yaml"),
           *megarl_config(inputs, steps, new_tokens, devices, run_dir, extra)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"megarl train failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return {"step_s": [r["time/step_s"] for r in rows],
            "phases": [{k[5:-2]: v for k, v in r.items() if k.startswith("time/") and k != "time/step_s"}
                       for r in rows],
            "old_log_probs_path": rows[-1].get("actor/old_log_probs_fused"),
            "tokens": [r["tokens"] for r in rows], "command": " ".join(cmd[1:])}


# ------------------------------------------------------------------------------------------------------------ main
def _summary(run: dict) -> dict:
    """Median step time and median phase split over the steps after the first (the first is a warm-up)."""
    steady = run["step_s"][1:] or run["step_s"]
    later = run["phases"][1:] or run["phases"]
    names = sorted({k for p in later for k in p})
    return {"median_step_s": statistics.median(steady),
            "split_s": {n: round(statistics.median(p.get(n, 0.0) for p in later), 4) for n in names}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.6m")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps per framework (the first is a warm-up)")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--devices", type=int, default=2, help="megarl worker processes (actor and rollout TP)")
    p.add_argument("--only", choices=["trl", "megarl"], help="run one framework (the other's figures stay empty)")
    p.add_argument("--megarl-override", action="append", default=[], help="extra `megarl train` override")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--_trl-child", dest="trl_child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.trl_child:  # TRL in its own process (its threads and allocator untouched by megarl's)
        inputs, out = json.loads(a.trl_child)
        res = run_trl(inputs, a.steps, a.new_tokens, out)
        print("TRL_RESULT " + json.dumps(res))
        return 0

    with tempfile.TemporaryDirectory() as work:
        inputs = build_inputs(work, a.shape)
        result = {"benchmark": "vs_trl", "shape": a.shape, **SHAPES[a.shape], "vocab_size": VOCAB,
                  "prompts_per_step": PROMPTS_PER_STEP, "samples_per_prompt": SAMPLES, "new_tokens": a.new_tokens,
                  "kl_coef": KL_COEF, "steps": a.steps, "devices": a.devices, "machine": _machine(),
                  "host_cpu": host_cpu()}
        if a.only in (None, "trl"):
            child = json.dumps([inputs, os.path.join(work, "trl_out")])
            cmd = [sys.executable, os.path.abspath(__file__), f"--steps={a.steps}", f"--new-tokens={a.new_tokens}",
                   f"--_trl-child={child}"]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env={**os.environ})
            lines = [x for x in proc.stdout.splitlines() if x.startswith("TRL_RESULT ")]
            if proc.returncode != 0 or not lines:
                raise RuntimeError(f"TRL run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
            result["trl"] = {**json.loads(lines[-1][len("TRL_RESULT "):])}
            result["trl"].update(_summary(result["trl"]))
        if a.only in (None, "megarl"):
            result["megarl"] = run_megarl(inputs, a.steps, a.new_tokens, a.devices, os.path.join(work, "megarl_run"),
                                          a.megarl_override)
            result["megarl"].update(_summary(result["megarl"]))
        if "trl" in result and "megarl" in result:
            result["megarl_over_trl"] = result["megarl"]["median_step_s"] / result["trl"]["median_step_s"]
        result["machine"]["load_avg_1m_after"] = os.getloadavg()[0]
    for name in ("trl", "megarl"):
        if name in result:
            r = result[name]
            print(f"{name:7s} median step {r['median_step_s']:.3f} s  split {r['split_s']}")
    if "megarl_over_trl" in result:
        print(f"megarl / TRL = {result['megarl_over_trl']:.2f}")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
