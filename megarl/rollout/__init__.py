"""Rollout: the engine protocol, sampling settings and prompt policy (engine.py), vLLM's parameter layout
(vllm_layout.py), the in-process vLLM engine (vllm_adapter.py; its request-level API vllm_requests.py, its
weight-loading path vllm_weights.py: the only modules that import vLLM) and the rollout service the trainer talks to
(service.py)."""

from megarl.rollout.engine import (
    Completion,
    GenerationOutput,
    GenerationRequest,
    OverlongPromptError,
    PromptPlan,
    RolloutEngine,
    RolloutSample,
    RolloutSamples,
    SamplingSettings,
    plan_prompts,
)
from megarl.rollout.vllm_layout import ParamShard, ShardPart, build_shard

__all__ = [
    "Completion", "GenerationOutput", "GenerationRequest",
    "OverlongPromptError", "PromptPlan", "RolloutEngine", "RolloutSample", "RolloutSamples", "SamplingSettings",
    "plan_prompts", "ParamShard", "ShardPart", "build_shard",
]
