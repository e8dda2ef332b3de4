"""Which distillation teacher backend scores a step's samples faster: a Megatron forward-only role
(`backend: megatron`, `megarl.roles.teacher`) or a vLLM engine's prompt log-probs (`backend: vllm`,
`megarl.rollout.teacher_engine.EngineTeacher` over the engine's request server).

    python benchmarks/teacher_backends.py [--sizes quickstart,larger] [--reps 3]
        [--json benchmarks/results/teacher_backends_cpu.json]

For each size, one random Llama teacher (HF directory, fp32) and one step's samples of random ids, laid out as the
trainer's batch is: `prompts` prompts x `samples` samples each (a prompt's samples share its prompt ids, as GRPO's
groups do), right-padded [B, S], the response tokens on the loss mask. Timed, each on its own, one TP1 process:
- megatron: `build_teacher` (TP1, one rank over gloo, micro_batch_samples as the quickstart's reference) then
  `compute_log_probs` of the batch (the teacher role's whole forward: micro-batches, log-softmax of the sampled ids);
- vllm: a `VllmRolloutEngine` of the same directory (fp32, enforce_eager on CPU) behind an `EngineServer`, then
  `EngineTeacher.log_probs` of the batch (one prompt log-probs request per row, up to 64 in flight).
Each rep scores a new batch (fresh ids: vLLM's prefix cache holds no earlier rep's rows; within a batch, a prompt's
samples share its prefix, which vLLM may reuse, as it would in a run). The first batch is a warm-up, not counted;
the median of `--reps` is reported, with the build time and the largest |megatron - vllm| log-prob difference over
the loss mask (both against the same ids: a check that both computed the same thing).

Sizes:
- quickstart: the quickstart's model shape (2 layers, hidden 128, vocab 512) and step (8 prompts x 4 samples, prompts
  of 8-16 tokens, responses of 8-32);
- larger: a larger tiny model (8 layers, hidden 512, ffn 1408, vocab 8192) and step (16 prompts x 4 samples, prompts
  of 64-128 tokens, responses of 128-256).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megarl.platform.host import describe_host, host_cpu  # noqa: E402

SIZES = {
    "quickstart": {"model": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                                 num_kv_heads=2, head_dim=32),
                   "prompts": 8, "samples": 4, "prompt_len": (8, 16), "response_len": (8, 32), "micro_batch": 8},
    "larger": {"model": dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_layers=8, num_heads=8,
                             num_kv_heads=4, head_dim=64),
               "prompts": 16, "samples": 4, "prompt_len": (64, 128), "response_len": (128, 256), "micro_batch": 8},
}


def make_batches(size: dict, n: int, seed: int) -> list[dict]:
    """`n` step batches {"input_ids", "attention_mask", "response_mask"} [B, S] (long), right-padded, each from its own
    seed: a prompt's `samples` rows share its prompt ids."""
    import torch

    vocab = size["model"]["vocab_size"]
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(seed + i)
        rows = []
        for _ in range(size["prompts"]):
            plen = int(torch.randint(size["prompt_len"][0], size["prompt_len"][1] + 1, (1,), generator=g))
            prompt = torch.randint(3, vocab, (plen,), generator=g)
            for _ in range(size["samples"]):
                rlen = int(torch.randint(size["response_len"][0], size["response_len"][1] + 1, (1,), generator=g))
                rows.append((prompt, torch.randint(3, vocab, (rlen,), generator=g)))
        seq = max(len(p) + len(r) for p, r in rows)
        ids = torch.zeros(len(rows), seq, dtype=torch.long)
        attention, response = torch.zeros_like(ids), torch.zeros_like(ids)
        for b, (p, r) in enumerate(rows):
            ids[b, :len(p) + len(r)] = torch.cat([p, r])
            attention[b, :len(p) + len(r)] = 1
            response[b, len(p):len(p) + len(r)] = 1
        out.append({"input_ids": ids, "attention_mask": attention, "response_mask": response})
    return out


def _megatron_rank(rank: int, world: int, model_dir: str, batches: list, micro_batch: int) -> dict:
    """One TP1 rank: build the teacher, score every batch; (build seconds, seconds per batch, log-probs of each)."""
    import torch

    from megarl.config.schema import ParallelConfig, TeacherConfig
    from megarl.data.batch import Batch
    from megarl.roles.teacher import build_teacher

    started = time.perf_counter()
    t = TeacherConfig(path=model_dir, parallel=ParallelConfig(tp=1, dp=1), micro_batch_samples=micro_batch)
    role = build_teacher(t, dtype="fp32", seed=1, samples_per_prompt=1)
    build_s = time.perf_counter() - started
    seconds, log_probs = [], []
    for b in batches:
        started = time.perf_counter()
        with torch.no_grad():
            out = role.compute_log_probs(Batch(dict(b)), with_entropy=False)
        seconds.append(time.perf_counter() - started)
        log_probs.append(out["log_probs"].clone())
    return {"build_s": build_s, "seconds": seconds, "log_probs": log_probs}


def run_megatron(model_dir: str, batches: list, micro_batch: int) -> dict:
    from megarl.platform.spawn import run_ranks

    return run_ranks(1, _megatron_rank, model_dir, batches, micro_batch, timeout_s=1800)[0]


def run_vllm(model_dir: str, batches: list) -> dict:
    """In this process: the engine, its request server, an `EngineTeacher` over an `InProcessClient`."""
    from megarl.rollout.engine_server import EngineServer, InProcessClient
    from megarl.rollout.teacher_engine import EngineTeacher
    from megarl.rollout.vllm_adapter import VllmEngineSettings, VllmRolloutEngine

    longest = max(b["input_ids"].shape[1] for b in batches)
    started = time.perf_counter()
    engine = VllmRolloutEngine(VllmEngineSettings(model_path=model_dir, tp=1, dtype="float32", seed=0,
                                                  max_model_len=longest + 1, max_prompt_tokens=longest,
                                                  overlong_prompt="error", kv_cache_gib=2, enforce_eager=True))
    server = EngineServer(engine, name="teacher replica 0").start()
    build_s = time.perf_counter() - started
    try:
        teacher = EngineTeacher("bench", InProcessClient(server, default_timeout_s=1800), max_concurrent=64,
                                timeout_s=1800)
        seconds, log_probs = [], []
        for b in batches:
            started = time.perf_counter()
            log_probs.append(teacher.log_probs(b["input_ids"], b["attention_mask"], b["response_mask"]))
            seconds.append(time.perf_counter() - started)
    finally:
        server.stop(timeout_s=60)
        engine.close()
    return {"build_s": build_s, "seconds": seconds, "log_probs": log_probs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="quickstart,larger")
    parser.add_argument("--reps", type=int, default=3, help="timed batches per backend (after one warm-up)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    import torch
    import vllm

    from megarl.checkpoint.tiny import build_tiny_llama

    results = {"command": shlex.join(["python", "benchmarks/teacher_backends.py", *sys.argv[1:]]),
               "machine": describe_host(host_cpu()), "host_cpu": host_cpu(),
               "python": platform.python_version(),
               "torch": torch.__version__, "vllm": vllm.__version__, "date": time.strftime("%Y-%m-%d %H:%M %Z"),
               "load_average_before": os.getloadavg(), "sizes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.sizes.split(","):
            size = SIZES[name]
            model_dir = build_tiny_llama(os.path.join(tmp, name), **size["model"], max_position_embeddings=1024)
            batches = make_batches(size, args.reps + 1, seed=100)
            megatron = run_megatron(model_dir, batches, size["micro_batch"])
            vllm = run_vllm(model_dir, batches)
            diff = max(float(((m - v) * b["response_mask"]).abs().max())
                       for m, v, b in zip(megatron["log_probs"], vllm["log_probs"], batches))
            tokens = [int(b["attention_mask"].sum()) for b in batches[1:]]
            row = {"rows": int(batches[0]["input_ids"].shape[0]), "tokens_per_batch_mean": statistics.mean(tokens),
                   "max_abs_logprob_diff": diff}
            for backend, r in (("megatron", megatron), ("vllm", vllm)):
                timed = r["seconds"][1:]
                row[backend] = {"build_s": round(r["build_s"], 2), "warmup_s": round(r["seconds"][0], 3),
                                "median_s": round(statistics.median(timed), 3),
                                "seconds": [round(s, 3) for s in timed],
                                "tokens_per_s": round(statistics.mean(tokens) / statistics.median(timed), 1)}
            row["vllm_over_megatron"] = round(row["vllm"]["median_s"] / row["megatron"]["median_s"], 2)
            row["load_average_after"] = os.getloadavg()
            results["sizes"][name] = row
            print(name, json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
