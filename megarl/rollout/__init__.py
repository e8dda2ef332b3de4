"""Rollout: the engine protocol, sampling settings and prompt policy (engine.py), vLLM's parameter layout
(vllm_layout.py), and the in-process vLLM engine (vllm_adapter.py;
its weight-loading path vllm_weights.py: the only modules that import vLLM)."""

from megarl.rollout.engine import (
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
    "OverlongPromptError", "PromptPlan", "RolloutEngine", "RolloutSample", "RolloutSamples", "SamplingSettings",
    "plan_prompts", "ParamShard", "ShardPart", "build_shard",
]
