"""The names a config chooses among, apart from the tensor code that implements them: the config
(and `plait check`, `plait plan`) loads and validates without importing torch. Each table of
functions in this package is keyed by these names (tests/unit/test_estimators.py checks both agree)."""

from __future__ import annotations


ESTIMATOR_NAMES = ("grpo", "rloo", "opo", "reinforce_pp", "reinforce_pp_baseline")  # advantages.ESTIMATORS
# the estimators whose advantages are token returns whitened over the round's tokens (REINFORCE++)
TOKEN_WHITENED = ("reinforce_pp", "reinforce_pp_baseline")
SCALES = ("group", "batch", "none")  # what the centred rewards are divided by (group_advantages)
# the scale each estimator uses when algo.scale_rewards is left unset (its authors' choice)
DEFAULT_SCALE = {
    "grpo": "group",
    "rloo": "none",
    "opo": "none",
    "reinforce_pp": "batch",
    "reinforce_pp_baseline": "batch",
}
REWARD_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")  # how several rewards combine

KL_NAMES = ("k1", "k2", "k3")  # kl.KL_ESTIMATORS

# loss type -> (objective, aggregation): losses.OBJECTIVES and losses.AGGREGATIONS
LOSS_TYPES: dict[str, tuple[str, str]] = {
    "grpo": ("clipped", "grpo"),
    "bnpo": ("clipped", "bnpo"),
    "dapo": ("clipped", "dapo"),
    "dr_grpo": ("clipped", "dr_grpo"),
    "cispo": ("cispo", "dapo"),
}
IS_LEVELS = ("token", "sequence")  # where the importance ratio is taken (importance_log_ratio)
ENGINE_IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

# vLLM's default max_logprobs: the most likeliest tokens a replica names at a position, so the
# most a teacher on a rollout server can give a position (teacher.top_k)
MAX_TOP_K = 20
