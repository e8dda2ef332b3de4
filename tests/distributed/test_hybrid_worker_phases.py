"""The engine phase order of `HybridWorker`'s real path (issue 15, item 6), as the calls the vLLM wrapper records in
`engine.events` (recorded on CPU too, where sleep/wake are no-ops; megarl/rollout/vllm_adapter.py).

One rank builds a `HybridWorker` from the quickstart config (actor TP1, rollout TP1, every actor offload flag on)
and runs the trainer's order: the initial `sync_weights`, then two steps of a rollout -> `update_actor` ->
`sync_weights`, and a last rollout. A rollout is the trainer's single-turn path: a serving phase (`start_server`,
the prompts through an `InProcessClient` by `run_single_turn`, `stop_server`), whose requests the engine records
as `submit` events. The expected sequence is the target order written in the issue: after a
rollout the engine sleeps at level 2 (weights and KV cache dropped); the update is followed by the offload of the
actor's gradients and optimizer state; the next sync wakes the weights only and reshards into them; then the actor's
parameters go to host memory, and only then is the KV cache woken for the next rollout.
"""

from __future__ import annotations

import os

import pytest

from megarl.platform.spawn import run_ranks

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ONE_RANK = ["resources.pools.default.devices_per_node=1", "actor.parallel.tp=1", "reference.parallel.tp=1",
            "rollout.tp=1", "actor.offload.params=true", "actor.offload.grads=true", "actor.offload.optimizer=true",
            "actor.mini_batch_prompts=null"]  # one mini-batch of whatever the test's two prompts give


def _rollout(worker, prompts, sampling):
    """One serving phase of the worker's engine, as the colocated trainer runs it: every prompt one request."""
    import asyncio

    from megarl.envs.episode import run_single_turn
    from megarl.rollout.engine_server import InProcessClient

    worker.start_server()
    try:
        samples, _ = asyncio.run(run_single_turn(InProcessClient(worker.server, default_timeout_s=120), prompts,
                                                 sampling))
    finally:
        worker.stop_server()
    return samples


def _worker(rank, world_size, run_dir):
    import torch

    from megarl.config import load_config
    from megarl.controller.dispatch import split_mini_batches
    from megarl.rollout.engine import SamplingSettings
    from megarl.trainer.engine_model_dir import engine_model_dir
    from megarl.workers.hybrid import HybridWorker
    from tests.distributed.harness import response_batch

    cfg = load_config(os.path.join(ROOT, "yaml_configs", "cpu_quickstart.yaml"), ONE_RANK)
    worker = HybridWorker(cfg, engine_model_dir(cfg, run_dir))
    sampling = SamplingSettings(max_new_tokens=3, temperature=0.0)
    worker.engine.events.clear()  # only what the steps below do
    worker.sync_weights()  # the trainer's first call: the engine starts with random weights
    for _ in range(2):
        samples = _rollout(worker, [[5, 6, 7], [8, 9]], sampling)
        assert len(samples) == 2
        batch = response_batch([s.prompt_ids for s in samples], [s.response_ids for s in samples])
        shape = batch.tensors["input_ids"].shape
        batch.tensors["old_log_probs"] = torch.zeros(shape)
        batch.tensors["advantages"] = torch.ones(shape)
        batch.tensors["ref_log_probs"] = torch.zeros(shape)
        batch.tensors["rollout_log_probs"] = torch.zeros(shape)
        worker.update_actor(split_mini_batches(batch, 1, None)[0])  # the controller's cut for one DP rank
        worker.sync_weights()
    _rollout(worker, [[5, 6, 7]], sampling)
    return list(worker.engine.events)


def test_phase_order_over_two_steps(tmp_path):
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    (events,) = run_ranks(1, _worker, str(tmp_path), timeout_s=600, env=env)
    # consecutive update_weights calls (one per reshard bucket) are one reshard; consecutive submits (the server
    # takes the requests queued since its last round: one or several rounds) one rollout of their summed prompts
    phases = []
    for name, *args in events:
        step = ("reshard", None) if name == "update_weights" else (name, *args)
        if step[0] == "reshard" and phases and phases[-1][0] == "reshard":
            continue
        if step[0] == "submit" and phases and phases[-1][0] == "submit":
            phases[-1] = ("submit", phases[-1][1] + step[1])
            continue
        phases.append(step)
    sleep, wake_w, reshard, wake_kv = ("sleep", 2), ("wake", ("weights",)), ("reshard", None), ("wake", ("kv_cache",))
    stop = ("abort", 0)  # the server's stop aborts what is still in flight: nothing, every request had finished
    assert not [e for e in events if e[0] == "generate"]  # no batch call: the request path only
    update = [("update", "actor"), ("offload", "actor", ("grads", "optimizer"))]
    params_off = ("offload", "actor", ("params", "grads", "optimizer"))
    first_off = ("offload", "actor", ("params", "grads"))  # before the first optimizer step Adam holds no state
    assert phases == [
        reshard, first_off, ("submit", 2), stop, sleep,                       # initial sync into the new engine; step 1
        *update, wake_w, reshard, params_off, wake_kv, ("submit", 2), stop, sleep,   # step 2
        *update, wake_w, reshard, params_off, wake_kv, ("submit", 1), stop, sleep,   # step 3
    ]
    assert all(args == ["vllm_shard"] for name, *args in events if name == "update_weights")
