"""Megatron role wrappers: actor, reference, critic, reward model over `megarl.engine.MegatronEngine`
(see each module)."""

from megarl.engine import OptimizerSettings  # roles take it; re-exported for callers building roles
from megarl.roles.actor import Actor, PolicyLossSettings, Reference
from megarl.roles.base import BatchingSettings, Role, optimizer_settings_from_config
from megarl.roles.critic import Critic, RewardModel

__all__ = [
    "Actor", "BatchingSettings", "Critic", "OptimizerSettings", "PolicyLossSettings",
    "Reference", "RewardModel", "Role", "optimizer_settings_from_config",
]
