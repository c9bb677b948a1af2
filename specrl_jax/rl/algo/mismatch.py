"""The training-inference mismatch: how far the rollout engine's log-probs of the
sampled tokens are from the learner's, per response token.

The sampler decodes with a paged KV cache (and, speculatively, verifies drafts), the
learner runs one causal forward over whole rows; with the same weights the two differ
only by floating-point rounding, and a mismatch far above it (a stale policy, a bug in
a kernel, bf16 accumulations) biases the gradient. NeMo-RL's ``token_mult_prob_error``
is the same measure in multiplicative form: mean of exp(|difference|), 1 when equal.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

def mismatch_metrics(learner_logprobs_BxT: Array, rollout_logprobs_BxT: Array,
                     mask_BxT: Array, metric_weights_BxT: Array) -> dict[str, Array]:
  """logprob_mismatch_mean / _max: mean and max |rollout - learner| log-prob over
  response tokens; token_mult_prob_error: their mean exp(|difference|).

  metric_weights_BxT: ``aggregation.valid_token_weights`` of the full batch, so sums over
  micro-batches give full-batch means.
  """
  valid_BxT = mask_BxT.astype(bool)
  # where, not multiply: padded positions may hold -inf log-probs.
  gap_BxT = jnp.where(valid_BxT, jnp.abs(jax.lax.stop_gradient(learner_logprobs_BxT)
                                         - rollout_logprobs_BxT), 0.0)
  return {
      "logprob_mismatch_mean": jnp.sum(gap_BxT * metric_weights_BxT),
      "logprob_mismatch_max": jnp.max(gap_BxT),
      "token_mult_prob_error": jnp.sum(jnp.where(valid_BxT, jnp.exp(gap_BxT), 0.0)
                                       * metric_weights_BxT),
  }
