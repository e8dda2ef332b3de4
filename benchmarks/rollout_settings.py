"""Which vLLM CPU settings generate a GRPO rollout fastest on this machine: engines side by side in one process,
timed call for call.

The settings are `rollout.enforce_eager` (eager, or the model compiled by inductor) and `rollout.cpu_linear` (vLLM's
oneDNN kernel on packed weight copies, or torch's `F.linear` on the weights as loaded); each named `<mode>-<kernel>`:
`eager-vllm` (the CPU default), `eager-torch`, `compiled-vllm`, `compiled-torch`. One engine per setting is built in
this one process (TP1, one thread, the same random HF Llama of `benchmarks/vs_trl.py`'s `--shape`, vs_trl's work of
one engine in its `dp` layout: 4 prompts x 8 samples x `--new-tokens`, EOS ignored, temperature 1), then the engines
take turns: each round calls `generate` once on every engine, the order reversed every other round. A shared 2-core
VM drifts by tens of percent within minutes (benchmarks/results/vs_trl.md), so separate runs a minute apart compare
the host as much as the settings; here each round's calls are seconds apart and the figure reported is the median
over rounds of each setting's time divided by the first setting's in the same round (`paired_ratio`), beside the
plain medians. Also per setting: the time of a weight sync of every parameter (`update_weights` of every shard,
vLLM's loader: what a sync costs when nothing is written in place; with the torch kernel the reshard writes into
`writable_params()` instead, timed as `in_place_s`: one `copy_` per parameter), and the engine's start-up.

    python benchmarks/rollout_settings.py --shape 0.6m [--rounds 40] [--settings eager-vllm,compiled-torch]

Writes JSON (`--json`) with the machine (CPU vendor, model, ISA flags) and the command. CPU only (on GPU the
kernel option does not apply and vLLM captures CUDA graphs by default).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from megarl.platform.host import host_cpu  # noqa: E402

SETTINGS = ("eager-vllm", "eager-torch", "compiled-vllm", "compiled-torch")
NEW_TOKENS = {"0.6m": 16, "24m": 64}  # vs_trl's DEFAULT_RUNS
PROMPTS, SAMPLES, PROMPT_TOKENS = 4, 8, 10


def parse_setting(name: str) -> tuple[bool, str]:
    """`<eager|compiled>-<vllm|torch>` -> (enforce_eager, cpu_linear)."""
    mode, _, kernel = name.partition("-")
    if mode not in ("eager", "compiled") or kernel not in ("vllm", "torch"):
        raise ValueError(f"unknown setting {name!r}; each is <eager|compiled>-<vllm|torch>, e.g. {SETTINGS}")
    return mode == "eager", kernel


def _median_ms(values: list[float]) -> float:
    return round(1e3 * statistics.median(values), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(NEW_TOKENS), default="0.6m")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated, the first is the baseline")
    ap.add_argument("--rounds", type=int, default=40, help="timed rounds (every engine once per round)")
    ap.add_argument("--new-tokens", type=int, help="default: vs_trl's for the shape")
    ap.add_argument("--syncs", type=int, default=20, help="timed weight syncs per engine")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if torch.cuda.is_available():
        raise SystemExit("rollout_settings.py compares vLLM's CPU settings; this machine has a GPU")
    names = [s for s in args.settings.split(",") if s]
    settings = {n: parse_setting(n) for n in names}
    new_tokens = args.new_tokens or NEW_TOKENS[args.shape]
    torch.set_num_threads(1)

    from benchmarks.vs_trl import build_inputs
    from megarl.rollout.engine import SamplingSettings
    from megarl.rollout.vllm_adapter import VllmEngineSettings, VllmRolloutEngine

    work = tempfile.mkdtemp(prefix="megarl_rollout_settings_")
    inputs = build_inputs(work, args.shape)
    engines, started = {}, {}
    for name, (eager, kernel) in settings.items():
        print(f"building engine {name} ...", flush=True)
        t = time.perf_counter()
        engines[name] = VllmRolloutEngine(VllmEngineSettings(
            model_path=inputs["model"], tp=1, dtype="float32", seed=0, max_model_len=PROMPT_TOKENS + new_tokens + 8,
            max_prompt_tokens=PROMPT_TOKENS, enforce_eager=eager, cpu_linear=kernel))
        started[name] = round(time.perf_counter() - t, 1)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(PROMPT_TOKENS)] for _ in range(PROMPTS)]
    sampling = SamplingSettings(temperature=1.0, max_new_tokens=new_tokens, samples_per_prompt=SAMPLES,
                                ignore_eos=True)
    for engine in engines.values():  # warm-up: allocator, first compiled calls
        for _ in range(2):
            engine.generate(prompts, sampling)

    times = {n: [] for n in names}
    for i in range(args.rounds):
        for name in (names if i % 2 == 0 else names[::-1]):
            t = time.perf_counter()
            engines[name].generate(prompts, sampling)
            times[name].append(time.perf_counter() - t)
        if (i + 1) % 10 == 0:
            print(f"round {i + 1}/{args.rounds}: " + ", ".join(f"{n} {_median_ms(v)} ms" for n, v in times.items()),
                  flush=True)

    syncs = {}
    for name, engine in engines.items():
        shards = engine.param_shards()
        items = [(s.name, (torch.randn(tuple(s.shape)) * 0.02).to(s.dtype)) for s in shards]
        staged = []
        for _ in range(args.syncs):
            t = time.perf_counter()
            engine.update_weights(iter(items), layout="vllm_shard")
            staged.append(time.perf_counter() - t)
        live = engine.writable_params()
        in_place = []
        if live:
            by_name = dict(items)
            for _ in range(args.syncs):
                t = time.perf_counter()
                with torch.no_grad():
                    for n, param in live.items():
                        param.copy_(by_name[n])
                in_place.append(time.perf_counter() - t)
        syncs[name] = {"update_weights_ms": _median_ms(staged), "in_place_ms": _median_ms(in_place) if in_place
                       else None, "params": len(items), "writable_params": len(live)}
        engine.close()
    shutil.rmtree(work, ignore_errors=True)

    base = names[0]
    result = {
        "host_cpu": host_cpu(),
        "machine": dict(host=platform.node(), python=platform.python_version(),
                        torch=torch.__version__, cores=len(os.sched_getaffinity(0)), load_avg_1m=os.getloadavg()[0]),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "shape": args.shape, "work": dict(prompts=PROMPTS, samples_per_prompt=SAMPLES, prompt_tokens=PROMPT_TOKENS,
                                           new_tokens=new_tokens),
        "rounds": args.rounds, "baseline": base,
        "settings": {n: dict(enforce_eager=settings[n][0], cpu_linear=settings[n][1], start_s=started[n],
                             generate_ms_median=_median_ms(times[n]), generate_ms_min=round(1e3 * min(times[n]), 2),
                             paired_ratio=round(statistics.median(a / b for a, b in zip(times[n], times[base])), 3),
                             faster_rounds=sum(a < b for a, b in zip(times[n], times[base])), **syncs[n])
                     for n in names},
    }
    print(f"\n{args.shape}, {PROMPTS} prompts x {SAMPLES} samples x {new_tokens} tokens, {args.rounds} rounds, "
          f"baseline {base}")
    print(f"{'setting':16s} {'start s':>8s} {'generate ms':>12s} {'/ baseline':>11s} {'faster':>7s} "
          f"{'sync ms':>8s} {'in place ms':>12s}")
    for n, r in result["settings"].items():
        print(f"{n:16s} {r['start_s']:8.1f} {r['generate_ms_median']:12.1f} {r['paired_ratio']:11.3f} "
              f"{r['faster_rounds']:>4d}/{args.rounds:<2d} {r['update_weights_ms']:8.1f} "
              f"{'-' if r['in_place_ms'] is None else format(r['in_place_ms'], '.1f'):>12s}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print("wrote", args.json)


if __name__ == "__main__":
    main()
