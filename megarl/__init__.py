"""megarl: Megatron-centric RL post-training for LLMs (the HybridFlow design).

Roles (actor, critic, reference, reward) are megatron-core models with their own TP/PP/DP layouts,
driven by one Ray controller; the actor's shards are resharded in place into vLLM before each rollout.
"""

__version__ = "0.1.0"
