"""Rule-based rewards: a registry of `fn(response_text, answer, record) -> float`, built-ins, user functions
loaded from a file, and batch scoring that names the failing record."""

from megarl.rewards import builtin  # noqa: F401  (registers the built-ins)
from megarl.rewards.builtin import exact_match, extract_number, gsm8k, normalize_text, token_fraction
from megarl.rewards.registry import RewardFn, get_reward, list_rewards, register_reward
from megarl.rewards.scoring import (
    RewardError,
    RewardFailure,
    RewardTimeout,
    ScoredBatch,
    build_reward_fn,
    check_failures,
    score_batch,
    score_responses,
)
from megarl.rewards.user import load_reward_file

__all__ = [
    "RewardError",
    "RewardFailure",
    "RewardFn",
    "RewardTimeout",
    "ScoredBatch",
    "build_reward_fn",
    "check_failures",
    "exact_match",
    "extract_number",
    "get_reward",
    "gsm8k",
    "list_rewards",
    "load_reward_file",
    "normalize_text",
    "register_reward",
    "score_batch",
    "score_responses",
    "token_fraction",
]
