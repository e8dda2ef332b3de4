"""Rollout: the engine protocol, sampling settings and prompt policy (engine.py), vLLM's parameter layout
(vllm_layout.py), the in-process vLLM engine (vllm_adapter.py; its request-level API vllm_requests.py, its
weight-loading path vllm_weights.py: the only modules that import vLLM), the rollout service the trainer talks to
(service.py), and the request-level path: the client protocol episodes program against (client.py), a replica's
engine loop and an in-process client over it (engine_server.py) and the controller's router over the replicas
(router.py; on Ray: megarl.controller.serving)."""

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
