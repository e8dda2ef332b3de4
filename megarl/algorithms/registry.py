"""Name -> function registries for the RL maths: advantage estimators, policy losses, KL estimators, aggregations.

Configs name an algorithm by string (``advantage: grpo``); the trainer looks it up here. A lookup of an unknown
name fails with the list of valid names, so a typo in a YAML file is caught at start-up, not mid-run.

    @register_advantage("grpo")
    def grpo(scores, group_ids, response_mask, ...): ...

    get_advantage("grpo")      # -> grpo
    get_advantage("gpro")      # UnknownNameError: unknown advantage estimator 'gpro'; valid: gae, grpo, ...

The `Registry` class is `megarl.registry`'s (shared with rewards, environments and tool-call parsers).
Every function in the package is registered when ``megarl.algorithms`` is imported (its ``__init__`` imports
all modules), so importing this module alone is enough for lookups to see them.
"""

from __future__ import annotations

from megarl.registry import Registry

ADVANTAGES = Registry("advantage estimator")
POLICY_LOSSES = Registry("policy loss")
KL_ESTIMATORS = Registry("KL estimator")
AGGREGATIONS = Registry("loss aggregation mode")

register_advantage = ADVANTAGES.register
get_advantage = ADVANTAGES.get
register_policy_loss = POLICY_LOSSES.register
get_policy_loss = POLICY_LOSSES.get
register_kl = KL_ESTIMATORS.register
get_kl = KL_ESTIMATORS.get
register_aggregation = AGGREGATIONS.register
get_aggregation = AGGREGATIONS.get
