"""One role's megatron-core model on this rank: the layer below `checkpoint/` and `roles/`.

  megatron_engine  `MegatronEngine`: GPTModel chunk + DDP + DistributedOptimizer + LR schedule + pipeline
                   schedule (`run`, `step`); `OptimizerSettings`
  heads            `ScalarHead` (critic / reward model) and its checkpoint names (`HF_HEAD_NAME`,
                   `MEGATRON_HEAD_NAME`)
  offload          moving parameters, gradient buffers and optimizer state to host memory and back

Nothing here imports `checkpoint/`, `roles/` or anything above them (tests/unit/test_layering.py).
"""

from megarl.engine.megatron_engine import LossFn, MegatronEngine, MicroBatch, OptimizerSettings

__all__ = ["LossFn", "MegatronEngine", "MicroBatch", "OptimizerSettings"]
