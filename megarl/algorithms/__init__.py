"""The pure maths of RL post-training: advantage estimators, policy and value losses, KL estimators and
controllers, loss aggregation, log-probs and entropy (full-vocabulary and vocab-parallel).

Tensors are [batch, response_len] with a 0/1 ``response_mask`` unless a docstring says otherwise. That mask is the
loss mask (the batch's ``loss_mask``, `megarl.data.batch`): 1 on the tokens the policy sampled, 0 on everything else;
it need not be contiguous (multi-turn rows have 0s for tool tokens between sampled spans), and every function here
reads only the mask, never a span from the first to the last valid token. Advantage
estimators, policy losses, KL estimators and aggregation modes are registered by name; look them up with
``get_advantage``, ``get_policy_loss``, ``get_kl``, ``get_aggregation`` (unknown names list the valid ones).
Importing this package registers everything.
"""

from megarl.algorithms.advantages import (
    expand_per_sequence,
    gae,
    grpo,
    per_sequence_advantages,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    rloo,
    scores_to_token_rewards,
)
from megarl.algorithms.aggregate import aggregate, aggregation_modes
from megarl.algorithms.entropy import entropy_from_logits, entropy_from_vocab_parallel
from megarl.algorithms.kl import apply_kl_penalty, kl, kl_kinds, kl_loss
from megarl.algorithms.kl_controller import AdaptiveKLController, FixedKLController, build_kl_controller
from megarl.algorithms.log_probs import (
    log_probs_from_logits,
    vocab_parallel_log_probs,
    vocab_parallel_log_probs_and_entropy,
)
from megarl.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from megarl.algorithms.overlong import filter_truncated, soft_overlong_penalty
from megarl.algorithms.policy_loss import cispo_policy_loss, gspo_policy_loss, policy_loss, policy_loss_names
from megarl.algorithms.registry import (
    get_advantage,
    get_aggregation,
    get_kl,
    get_policy_loss,
    register_advantage,
    register_aggregation,
    register_kl,
    register_policy_loss,
)
from megarl.algorithms.rollout_correction import mismatch_metrics, rollout_correction
from megarl.algorithms.value_loss import value_loss
from megarl.registry import UnknownNameError

__all__ = [
    "UnknownNameError",
    "AdaptiveKLController",
    "FixedKLController",
    "aggregate",
    "aggregation_modes",
    "apply_kl_penalty",
    "build_kl_controller",
    "cispo_policy_loss",
    "entropy_from_logits",
    "entropy_from_vocab_parallel",
    "expand_per_sequence",
    "filter_truncated",
    "gae",
    "get_advantage",
    "get_aggregation",
    "get_kl",
    "get_policy_loss",
    "grpo",
    "gspo_policy_loss",
    "kl",
    "kl_kinds",
    "kl_loss",
    "log_probs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "mismatch_metrics",
    "per_sequence_advantages",
    "policy_loss",
    "policy_loss_names",
    "register_advantage",
    "register_aggregation",
    "register_kl",
    "register_policy_loss",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "rloo",
    "rollout_correction",
    "scores_to_token_rewards",
    "soft_overlong_penalty",
    "value_loss",
    "vocab_parallel_log_probs",
    "vocab_parallel_log_probs_and_entropy",
]
