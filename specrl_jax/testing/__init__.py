"""Statistical assertions and exact references for testing samplers (works with chex).

  stats:     chi_square, assert_distribution_matches, assert_per_position_matches,
             assert_joint_matches and joint-distribution helpers
  reference: enumerate_sequence_distribution (exact joint of a tiny model's first
             tokens), response_log_probs, greedy_reference (full forwards, no cache)
  models:    tiny random models with peaked, context-dependent distributions
"""

from specrl_jax.testing.models import peaked_random_model, perturbed_model
from specrl_jax.testing.reference import (enumerate_sequence_distribution,
                                          full_forward_log_probs, greedy_reference,
                                          response_log_probs)
from specrl_jax.testing.stats import (ENDED, MIN_EXPECTED_COUNT, assert_distribution_matches,
                                      assert_joint_matches, assert_per_position_matches,
                                      chi_square, chi_square_threshold, joint_prefix,
                                      marginals_from_joint, sequence_outcomes)

__all__ = [
    "ENDED", "MIN_EXPECTED_COUNT", "assert_distribution_matches", "assert_joint_matches",
    "assert_per_position_matches", "chi_square", "chi_square_threshold",
    "enumerate_sequence_distribution", "full_forward_log_probs", "greedy_reference",
    "joint_prefix", "marginals_from_joint", "peaked_random_model", "perturbed_model",
    "response_log_probs", "sequence_outcomes",
]
