"""Megatron role wrappers: actor, reference, critic, reward model over `MegatronEngine` (see each module)."""

from megarl.roles.actor import Actor, PolicyLossSettings, Reference
from megarl.roles.base import BatchingSettings, Role, optimizer_settings_from_config
from megarl.roles.critic import Critic, RewardModel
from megarl.roles.megatron_engine import MegatronEngine, OptimizerSettings

__all__ = [
    "Actor", "BatchingSettings", "Critic", "MegatronEngine", "OptimizerSettings", "PolicyLossSettings",
    "Reference", "RewardModel", "Role", "optimizer_settings_from_config",
]
