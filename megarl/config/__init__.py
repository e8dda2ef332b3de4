"""Job configuration: frozen dataclasses per component (`schema`), YAML load with dotted overrides (`loader`),
cross-field validation (`validate`), rank placement (`placement`), generated docs (`docs`).

    cfg = load_config("yaml_configs/cpu_quickstart.yaml", ["actor.parallel.tp=2"])
"""

from megarl.config.arch import resolve_arch
from megarl.config.errors import ConfigError
from megarl.config.loader import apply_overrides, dump_yaml, from_dict, load_config, parse_config, to_dict
from megarl.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    ArchConfig,
    CheckpointConfig,
    CriticConfig,
    DataConfig,
    JobConfig,
    KLConfig,
    LoggingConfig,
    LoraConfig,
    ModelConfig,
    OffloadConfig,
    OptimizerConfig,
    ParallelConfig,
    PoolConfig,
    ReferenceConfig,
    ResourcesConfig,
    RewardConfig,
    RewardModelConfig,
    RoleConfig,
    RolloutConfig,
    TrainedRoleConfig,
    TrainerConfig,
)
from megarl.config.validate import validate

__all__ = [
    "AlgorithmConfig", "ArchConfig", "CheckpointConfig", "ConfigError", "CriticConfig", "DataConfig", "JobConfig",
    "KLConfig", "LoggingConfig", "ModelConfig", "OffloadConfig", "OptimizerConfig", "ParallelConfig", "PoolConfig",
    "ReferenceConfig", "ResourcesConfig", "RewardConfig", "RewardModelConfig", "RoleConfig", "RolloutConfig",
    "TrainedRoleConfig", "ActorConfig", "LoraConfig", "TrainerConfig", "apply_overrides", "dump_yaml", "from_dict",
    "load_config", "parse_config", "resolve_arch", "to_dict", "validate",
]
