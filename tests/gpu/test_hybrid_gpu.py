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


def _gpu_worker(rank, world_size, hf_dir):
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
    actor = Actor(spec, groups, hf_dir=hf_dir)
    engine = VllmRolloutEngine(VllmEngineSettings(model_path=hf_dir, tp=world_size, dtype="float32",
                                                  max_model_len=64, max_prompt_tokens=32, load_format="dummy",
                                                  gpu_memory_utilization=0.3))
    plan = plan_reshard(spec, groups.topology, world_size, dtype_bytes=4)
    sink = VllmShardSink(engine)
    report = execute_reshard(plan, megatron_sources(actor.engine), sink)
    # On CUDA every dense parameter is written in place into vLLM's own memory: nothing staged or reloaded.
    assert sink.written_in_place == len(engine.param_shards()) and sink.tensors_fed == 0, \
        (sink.written_in_place, sink.tensors_fed)
    samples = engine.generate(PROMPTS, SamplingSettings(temperature=0.0, max_new_tokens=MAX_NEW, ignore_eos=True))
    diff, _ = actor_log_prob_gap(actor, samples)
    return [s.response_ids for s in samples], diff, report.time_s


def test_hybrid_engine_on_gpu(tmp_path):
    from megarl.rollout.testing import build_tiny_llama, hf_greedy

    hf_dir = build_tiny_llama(str(tmp_path / "llama"), seed=3)
    expected = hf_greedy(hf_dir, PROMPTS, MAX_NEW)
    generations, diff, time_s = run_ranks(1, _gpu_worker, hf_dir, timeout_s=900)[0]
    print(f"hybrid parity (fp32, local spec): greedy == transformers: {generations == expected}; "
          f"max |vLLM - actor| log-prob: {diff}; reshard {time_s:.3f} s")
    assert generations == expected
    assert diff is not None and diff < 1e-3
