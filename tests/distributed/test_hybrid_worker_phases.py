"""The engine phase order of `HybridWorker`'s real path (issue 15, item 6), as the calls the vLLM wrapper records in
`engine.events` (recorded on CPU too, where sleep/wake are no-ops; megarl/rollout/vllm_adapter.py).

One rank builds a `HybridWorker` from the quickstart config (actor TP1, rollout TP1, every actor offload flag on)
and runs the trainer's order: the initial `sync_weights`, then two steps of `generate` -> `update_actor` ->
`sync_weights`, and a last `generate`. The expected sequence is the target order written in the issue: after a
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
        out = worker.generate([[5, 6, 7], [8, 9]], sampling)
        samples = out["samples"]
        batch = response_batch([s.prompt_ids for s in samples], [s.response_ids for s in samples])
        shape = batch.tensors["input_ids"].shape
        batch.tensors["old_log_probs"] = torch.zeros(shape)
        batch.tensors["advantages"] = torch.ones(shape)
        batch.tensors["ref_log_probs"] = torch.zeros(shape)
        batch.tensors["rollout_log_probs"] = torch.zeros(shape)
        worker.update_actor(split_mini_batches(batch, 1, None)[0])  # the controller's cut for one DP rank
        worker.sync_weights()
    worker.generate([[5, 6, 7]], sampling)
    return list(worker.engine.events)


def test_phase_order_over_two_steps(tmp_path):
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
    (events,) = run_ranks(1, _worker, str(tmp_path), timeout_s=600, env=env)
    # consecutive update_weights calls (one per reshard bucket) are one reshard
    phases = []
    for name, *args in events:
        step = ("reshard", None) if name == "update_weights" else (name, *args)
        if not (step[0] == "reshard" and phases and phases[-1][0] == "reshard"):
            phases.append(step)
    sleep, wake_w, reshard, wake_kv = ("sleep", 2), ("wake", ("weights",)), ("reshard", None), ("wake", ("kv_cache",))
    generate = [e for e in events if e[0] == "generate"]
    assert generate == [("generate", 2), ("generate", 2), ("generate", 1)]
    update = [("update", "actor"), ("offload", "actor", ("grads", "optimizer"))]
    params_off = ("offload", "actor", ("params", "grads", "optimizer"))
    first_off = ("offload", "actor", ("params", "grads"))  # before the first optimizer step Adam holds no state
    assert phases == [
        reshard, first_off, ("generate", 2), sleep,                       # initial sync into the new engine; step 1
        *update, wake_w, reshard, params_off, wake_kv, ("generate", 2), sleep,   # step 2
        *update, wake_w, reshard, params_off, wake_kv, ("generate", 1), sleep,   # step 3
    ]
    assert all(args == ["vllm_shard"] for name, *args in events if name == "update_weights")
