"""megarl: Megatron-centric RL post-training for LLMs (the HybridFlow design).

Roles (actor, critic, reference, reward) are megatron-core models with their own TP/PP/DP layouts,
driven by one Ray controller; the actor's shards are resharded in place into vLLM before each rollout.

Python API (`megarl.api`): `megarl.RLTrainer(model=..., reward=fn, train_data=..., ...)`, `megarl.JobConfig`.
"""

__version__ = "0.1.0"
__all__ = ["JobConfig", "RLTrainer", "__version__"]


def __getattr__(name: str):
    # lazy, so `import megarl` (the CLI's --version, every worker process) stays cheap
    if name in ("RLTrainer", "JobConfig"):
        from megarl import api

        return getattr(api, name)
    raise AttributeError(f"module 'megarl' has no attribute {name!r}")
