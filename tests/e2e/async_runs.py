"""Driver of the `pool_runs` fixture (`tests/e2e/conftest.py`: `tests/e2e/test_rollout_pool.py` and
`tests/e2e/test_async_modes.py`): several training runs of the rollout-pool quickstart (actor TP2 on 2 processes, two
vLLM TP1 engines on 2 more) in ONE `TrainingSession`, so the four workers and their engines start once (~30 s here)
instead of once per run.

Every run starts from the same state: the session's step-0 checkpoint (weights, Adam moments, every RNG, the
loader) is copied into the run's checkpoint directory and resumed with `checkpoint.allow_config_change` (the runs
differ in trainer.mode and its options, nothing else); a run resumed from another run's checkpoint is its
continuation. Each run is `TrainingSession.train_from`: its own `RLLoop` over the session's worker groups and
rollout service.

The driver also runs the colocated quickstart in one_step_off (`COLOCATED`: `megarl train` as a user runs it, the
hybrid engine on 2 processes of its own; `tests/e2e/test_async_modes.py::test_colocated_one_step_off_learns`),
started before the push probe: the probe's engines mostly sleep (PROBE_STEP_DELAY_S per decode step), so its
start-up (~15 s: imports, 2 workers, vLLM) overlaps the probe and this session's close instead of following them (it
takes 2 of the shared cluster's 7 CPU slots, the session 4). The training runs before are not overlapped: the
partial-rollout run needs its engines slower than its trainer, and a busier CPU would slow the trainer.

    python tests/e2e/async_runs.py OUT_DIR   # OUT_DIR/<run>/metrics.jsonl, <run>/ckpt, runs.json, config.json,
                                             # colocated/metrics.jsonl, colocated.log
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
CONFIG = os.path.join(ROOT, "yaml_configs", "cpu_quickstart_rollout_pool.yaml")
TIS = ["algorithm.rollout_correction.tis=token"]

# name -> (overrides, steps, resumed from (run, step) or None, checkpoint every)
# Lengths (tests/e2e/test_async_modes.py's bar: the last 5 steps' reward > the first 5's + 0.2; measured here, first
# 5 steps 0.13 in every run): one_step_off's 18 steps end at 0.56 (20: 0.70), async4's 24 at 0.65 (its rewards rise
# ~5 steps later: 20 steps end at 0.37, too near the bar). A resumed run needs only as many steps as the checks read:
# one_step_off's, 3 to compare bit for bit; async4's, 5 (the up to max_staleness + 1 batches its checkpoint buffers).
# No "async1" (async, max_staleness 1): it trained step for step what one_step_off trains (the same rewards at every
# step of 20: with 'wait' and a bound of 1 the driver runs exactly one batch ahead), and the bound 1 of async mode
# on real engines is checked on the "continue" run (async, max_staleness 1), the schedule's bounds 1 and 3 in
# tests/unit/test_schedule.py.
RUNS = {
    # the synchronous run test_rollout_pool.py checks (bytes, verification, greedy after the step-10 sync: the
    # validation at step 10 and that step's checkpoint)
    "sync": (["trainer.mode=sync", "trainer.val_every=10"], 20, None, 10),
    "one_step_off": (["trainer.mode=one_step_off", *TIS], 18, None, 15),
    "one_step_off_resumed": (["trainer.mode=one_step_off", *TIS], 18, ("one_step_off", 15), 0),
    "async4": (["trainer.mode=async", "trainer.max_staleness=4", *TIS], 24, None, 19),
    "async4_resumed": (["trainer.mode=async", "trainer.max_staleness=4", *TIS], 24, ("async4", 19), 0),
    # full-length responses (ignore_eos) on engines slowed to STEP_DELAY_S per decode step (`SlowEngine`): generating
    # a batch (32 steps, > 4.8 s) takes longer than a training step, so every push lands while the batch's requests
    # are in the engines and responses mix two versions (steps 2 and 3: step 1 trains batch 1, generated on version 0
    # before any push)
    "continue": (["trainer.mode=async", "trainer.max_staleness=1", "rollout.partial=continue",
                  "rollout.ignore_eos=true", *TIS], 3, None, 0),
}


# the colocated quickstart (yaml_configs/cpu_quickstart.yaml) in one_step_off: 18 steps, as the pool's one_step_off
# run (the same rewards step for step over 20 when measured: last 5 of 18 at 0.56, first 5 at 0.13)
COLOCATED = [os.path.join(ROOT, "yaml_configs", "cpu_quickstart.yaml"), "trainer.mode=one_step_off", *TIS,
             "trainer.val_every=0", "logging.plots=false", "trainer.total_steps=18", "checkpoint.dir=null"]
COLOCATED_TIMEOUT_S = 600


def start_colocated(out: str, env: dict) -> subprocess.Popen:
    """`megarl train` of COLOCATED into OUT/colocated (its output in OUT/colocated.log), on the cluster of `env`."""
    with open(os.path.join(out, "colocated.log"), "w") as log:
        return subprocess.Popen([sys.executable, "-m", "megarl", "train", *COLOCATED,
                                 f"logging.dir={os.path.join(out, 'colocated')}"], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT)


# 32 decode steps sleep 4.8 s: 1.5x this run's training step at its slowest measured (3.0-3.2 s beside the decoding
# engines, old + reference log-probs, update and push, on the host's slow hour that took the suite 47 min; 1.4-1.6 s
# in the runs before it). At 0.07 (2.2 s a batch) that hour's batches finished before the push: no step mixed versions.
STEP_DELAY_S = 0.15


class SlowEngine:
    """The session's rollout service, its engine servers sleeping STEP_DELAY_S after each decode step
    (`EngineServer.step_delay_s`): an engine slower than the trainer, as a long generation makes it (the tiny model
    here generates a batch faster than the trainer trains on it). Everything else is the service's."""

    def __init__(self, service) -> None:
        self.service = service

    def __getattr__(self, name):
        return getattr(self.service, name)

    def start_serving(self, **options):
        return self.service.start_serving(**options, step_delay_s=STEP_DELAY_S)


PROBE_STEP_DELAY_S = 0.1  # the probe's engines: 32 decode steps take > 3.2 s
PROBE_ROUND_STEPS = 4  # a push queued on a server lands within this many decode steps
PROBE_WAIT_S = 60.0  # bound on each of the probe's waits for the servers' counters


def _kill(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGKILL `proc` and reap it, waiting at most `timeout_s` (a process stuck in the kernel is reported, not waited
    on forever)."""
    proc.kill()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"[async_runs] pid {proc.pid} still not reaped {timeout_s:g} s after SIGKILL", flush=True)


def push_mid_request_probe(service, prompts: list[list[int]]) -> dict:
    """A weight push landing mid-request on the serving rollout pool (`PoolRollout.push_weights` while serving: the
    server op pause(keep) -> receive -> resume): the same seeded requests (32 tokens, ignore_eos) twice through the
    router, first without a push ("a"), then with a push ("b") sent once the servers report that they took every
    request of b and ran 2 decode steps per replica since (read off the servers' own counters, not timed). Returns
    {"a"|"b": [{"tokens", "versions"}] per request, "pushed": the version pushed, "before": the engines' version
    before, "continued_requests": the push's count of requests in the engines across it}."""
    import asyncio

    from megarl.rollout.engine import GenerationRequest, SamplingSettings

    sampling = SamplingSettings(max_new_tokens=32, ignore_eos=True, seed=2026)
    before = service.weight_version
    client = service.start_serving(step_delay_s=PROBE_STEP_DELAY_S, round_steps=PROBE_ROUND_STEPS)

    def counters() -> tuple[float, float]:
        m = client.metrics()
        return (sum(v for k, v in m.items() if k.startswith("rollout/server/submitted/replica_")),
                m["rollout/server/engine_steps"])

    async def until(ready, what: str) -> tuple[float, float]:
        deadline = time.monotonic() + PROBE_WAIT_S
        while True:
            got = counters()
            if ready(*got):
                return got
            if time.monotonic() > deadline:
                raise TimeoutError(f"push probe: waited {PROBE_WAIT_S} s for {what} (servers' counters {got})")
            await asyncio.sleep(0.02)

    try:
        async def batch(tag: str, push: bool):
            taken = counters()[0]
            tasks = [asyncio.ensure_future(client.generate(GenerationRequest(f"probe-{tag}{i}", p, sampling,
                                                                             seed_index=i), timeout_s=120))
                     for i, p in enumerate(prompts)]
            summary = None
            if push:
                _, steps = await until(lambda n, _: n >= taken + len(prompts),
                                       f"the servers to take the {len(prompts)} requests")
                await until(lambda _, k: k >= steps + 2 * client.replicas, "2 decode steps per replica")
                summary = (await asyncio.to_thread(service.push_weights, before + 1))[0]
            outs = await asyncio.gather(*tasks)
            return [{"tokens": list(o.completions[0].token_ids), "versions": list(o.completions[0].versions)}
                    for o in outs], summary

        a, _ = asyncio.run(batch("a", False))
        b, summary = asyncio.run(batch("b", True))
    finally:
        service.stop_serving()
    return {"a": a, "b": b, "before": before, "pushed": before + 1,
            "continued_requests": summary["reshard/pool/continued_requests"]}


def main(out: str) -> None:
    env = dict(os.environ)  # the colocated run's: this driver's as it started (RAY_ADDRESS: the shared cluster)
    import yaml

    from megarl.config.loader import parse_config
    from megarl.config.validate import validate
    from megarl.trainer import checkpointing
    from megarl.trainer.session import TrainingSession

    data = yaml.safe_load(open(CONFIG))
    for key in ("train_path", "val_path"):
        data["data"][key] = os.path.join(ROOT, data["data"][key])
    data["model"]["tokenizer"] = os.path.join(ROOT, data["model"]["tokenizer"])
    data["logging"].update(dir=os.path.join(out, "session"), plots=False, progress="lines")
    data["trainer"].update(val_every=0)
    base = validate(parse_config(data, ["trainer.mode=one_step_off", *TIS]))
    session = TrainingSession(base)
    report = {}
    colocated = None
    try:
        started = time.monotonic()
        first = session.start()
        start_s = time.monotonic() - started
        step0 = first.save(0, root=os.path.join(out, "step0"))  # the common starting state of every run
        for name, (overrides, steps, resumed_from, save_every) in RUNS.items():
            source = step0 if resumed_from is None else checkpointing.step_dir(
                os.path.join(out, resumed_from[0], "ckpt"), resumed_from[1])
            run_started = time.monotonic()
            session.train_from(source, os.path.join(out, name),
                               [*overrides, f"trainer.total_steps={steps}", f"checkpoint.save_every={save_every}",
                                "checkpoint.keep_last=0"],
                               raw=data, rollout=SlowEngine(first.rollout) if name == "continue" else None)
            seconds = time.monotonic() - run_started
            report[name] = {"seconds": seconds, "steps": steps, "resumed_from": resumed_from}
            print(f"[async_runs] {name}: {seconds:.1f} s", flush=True)
        colocated_started = time.monotonic()
        colocated = start_colocated(out, env)
        probe_started = time.monotonic()
        probe_prompts = [first.encoder.encode(r.prompt) for r in first.val_records[:4]]
        with open(os.path.join(out, "push_probe.json"), "w") as f:
            json.dump(push_mid_request_probe(first.rollout, probe_prompts), f)
        report["_session"] = {"start_s": start_s, "probe_s": time.monotonic() - probe_started}
    except BaseException:
        if colocated is not None:  # its driver ends its workers with it
            _kill(colocated)
        raise
    finally:
        session.close()
    try:
        returncode = colocated.wait(timeout=COLOCATED_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _kill(colocated)
        raise TimeoutError(f"the colocated one_step_off run did not end within {COLOCATED_TIMEOUT_S} s; its output: "
                           f"{os.path.join(out, 'colocated.log')}") from None
    report["_colocated"] = {"returncode": returncode, "seconds": time.monotonic() - colocated_started}
    print(f"[async_runs] colocated: {report['_colocated']['seconds']:.1f} s (from its start, before the probe)",
          flush=True)
    with open(os.path.join(out, "runs.json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(out, "config.json"), "w") as f:  # the config the runs share (before their overrides)
        json.dump(data, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
