"""The hybrid engine on one GPU: Megatron actor (CUDA, NCCL) resharded into a GPU vLLM engine (random "dummy"
weights, so every weight it uses came through the reshard); greedy generations equal transformers', and vLLM's
log-probs equal the actor's within 1e-3 (fp32).

The actor uses megatron-core's LOCAL layer spec here even when Transformer Engine is installed: TE runs fp32 GEMMs
in TF32 (10-bit mantissa, ~5e-4 relative per product) while vLLM computes in full fp32, so a TE actor would differ
from vLLM by TF32 rounding, not by a reshard error; 1e-3 is a bound for fp32-vs-fp32 kernels only."""

import pytest

from megarl.platform.spawn import run_ranks
from tests.distributed.harness import actor_log_prob_gap
from tests.distributed.test_hybrid_reshard_vllm import MAX_NEW, PROMPTS

pytestmark = pytest.mark.gpu


def _gpu_worker(rank, world_size, hf_dir, dtype="fp32"):
    import megarl.models.gpt as gpt

    gpt.transformer_engine_available = lambda: False  # local spec: full fp32 GEMMs, like vLLM (module docstring)
    from megarl.checkpoint.hf_io import HFReader
    from megarl.parallel.groups import build_role_groups
    from megarl.parallel.topology import RoleTopology
    from megarl.reshard.executor import execute_reshard
    from megarl.reshard.planner import plan_reshard
    from megarl.reshard.sources import megatron_sources
    from megarl.reshard.vllm_sink import VllmShardSink
    from megarl.roles.actor import Actor
    from megarl.rollout.engine import SamplingSettings
    from megarl.rollout.vllm_adapter import VllmEngineSettings, VllmRolloutEngine

    spec = HFReader(hf_dir).spec
    groups = build_role_groups(RoleTopology(tp=world_size))
    actor = Actor(spec, groups, hf_dir=hf_dir, dtype=dtype)
    engine = VllmRolloutEngine(VllmEngineSettings(model_path=hf_dir, tp=world_size,
                                                  dtype={"fp32": "float32", "bf16": "bfloat16"}[dtype],
                                                  max_model_len=64, max_prompt_tokens=32, load_format="dummy",
                                                  gpu_memory_utilization=0.3))
    plan = plan_reshard(spec, groups.topology, world_size, dtype_bytes={"fp32": 4, "bf16": 2}[dtype])
    sink = VllmShardSink(engine)
    report = execute_reshard(plan, megatron_sources(actor.engine), sink)
    # On CUDA every dense parameter is written in place into vLLM's own memory: nothing staged or reloaded.
    assert sink.written_in_place == len(engine.param_shards()) and sink.tensors_fed == 0, \
        (sink.written_in_place, sink.tensors_fed)
    samples = engine.generate(PROMPTS, SamplingSettings(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True))
    diff, batch = actor_log_prob_gap(actor, samples)
    out = actor.compute_log_probs(batch, with_entropy=False)
    gaps = [abs(float(a) - b) for i, s in enumerate(samples)
            for a, b in zip(out.tensors["log_probs"][i, len(s.prompt_ids):], s.response_log_probs)]
    return [s.response_ids for s in samples], diff, report.time_s, sum(gaps) / len(gaps)


def test_hybrid_engine_on_gpu(tmp_path):
    from megarl.rollout.testing import build_tiny_llama, hf_greedy

    hf_dir = build_tiny_llama(str(tmp_path / "llama"), seed=3)
    expected = hf_greedy(hf_dir, PROMPTS, MAX_NEW)
    generations, diff, time_s, _ = run_ranks(1, _gpu_worker, hf_dir, timeout_s=900)[0]
    print(f"hybrid parity (fp32, local spec): greedy == transformers: {generations == expected}; "
          f"max |vLLM - actor| log-prob: {diff}; reshard {time_s:.3f} s")
    assert generations == expected
    assert diff is not None and diff < 1e-3


def test_hybrid_engine_on_gpu_bf16(tmp_path):
    """bf16 actor resharded into a bf16 engine: the same weights (the reshard is exact in any dtype), different bf16
    kernels (Megatron's local spec vs vLLM's), so log-probs differ by rounding, not by a layout error. Bounds from
    the CPU quickstart in bf16 (docs/rollout_correction.md: per-step mean |d| 0.9e-3..3.4e-3, max up to 9.4e-2
    nats over 20 steps): mean < 1e-2 and max < 0.25, ~3x the measured worst; a wrong shard gives differences of
    whole nats. Greedy tokens are not compared: bf16 near-ties flip between kernels."""
    from megarl.rollout.testing import build_tiny_llama

    hf_dir = build_tiny_llama(str(tmp_path / "llama"), seed=3)
    _, worst, time_s, mean = run_ranks(1, _gpu_worker, hf_dir, "bf16", timeout_s=900)[0]
    print(f"hybrid parity (bf16, local spec): mean |vLLM - actor| {mean:.2e}, max {worst:.2e}; reshard {time_s:.3f} s")
    assert mean < 1e-2 and worst is not None and worst < 0.25
