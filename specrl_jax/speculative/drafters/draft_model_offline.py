"""Offline distillation of a draft model on the target's own rollouts.

A draft model's drafts are accepted at the rate its distribution overlaps the
target's sampling distribution on the texts the target actually writes, so this
trains exactly that: soft cross-entropy toward the target's warped next-token
distribution (temperature, top-k/top-p as the rollouts sample) on the response tokens
of ``offline.RolloutData`` (``offline.rollout_data`` samples it from the target). The
same objective as online training (``rl.loop.online_drafters``), run on a fixed set
of rollouts with the target frozen: e.g. a drafter made for a policy before RL starts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from specrl_jax.config import SamplingParams, check
from specrl_jax.models.transformer import Transformer
from specrl_jax.sampling.warp import warped_log_probs
from specrl_jax.speculative.drafters.offline import DrafterTrainingConfig, RolloutData

Array = jax.Array


def cross_entropy_BxT(draft_logits_BxTxV: Array, target_logits_BxTxV: Array,
                      sampling: SamplingParams) -> Array:
  """-sum_v p_target(v) log q_draft(v) at every position, both at ``sampling`` (the
  rollouts' warp): the draft model's objective offline here and online in
  ``rl.loop.online_drafters``."""
  p_BxTxV = jnp.exp(warped_log_probs(target_logits_BxTxV, sampling))
  log_q_BxTxV = jax.nn.log_softmax(draft_logits_BxTxV / sampling.temperature)
  # Tokens the warp removed have p = 0 and may have log q = -inf: 0 * -inf is nan.
  return -jnp.sum(jnp.where(p_BxTxV > 0, p_BxTxV * log_q_BxTxV, 0.0), axis=-1)


def distillation_loss(draft: Transformer, target_logits_BxTxV: Array, tokens_BxT: Array,
                      response_mask_BxT: Array, sampling: SamplingParams) -> Array:
  """Mean of ``cross_entropy_BxT`` over response tokens (position t predicts t + 1)."""
  per_token_BxT = cross_entropy_BxT(draft(tokens_BxT)[:, :-1], target_logits_BxTxV[:, :-1],
                                    sampling)
  mask_BxT = response_mask_BxT[:, 1:].astype(jnp.float32)
  return jnp.sum(per_token_BxT * mask_BxT) / jnp.maximum(mask_BxT.sum(), 1.0)


def distill_draft_model(draft: Transformer, target: Transformer, data: RolloutData, *,
                        sampling: SamplingParams,
                        config: DrafterTrainingConfig = DrafterTrainingConfig(),
                        log_every: int = 0, log: Callable[[dict], None] = print
                        ) -> tuple[Transformer, list[dict[str, Any]]]:
  """``draft`` (a new object) after ``config.num_updates`` AdamW steps on batches of
  ``data`` drawn with ``config.seed``; the per-update losses (host floats)."""
  check(draft.config.vocab_size == target.config.vocab_size, "distill_draft_model", "draft",
        f"vocab_size {draft.config.vocab_size}",
        f"the target's vocab_size {target.config.vocab_size}: drafts are target token ids")
  check(data.tokens.shape[0] >= 1, "distill_draft_model", "data", data.tokens.shape,
        "at least one sequence")
  check(int(data.tokens.max()) < target.config.vocab_size, "distill_draft_model",
        "data.tokens", f"max id {int(data.tokens.max())}",
        f"ids below the vocab_size {target.config.vocab_size}")
  tx = config.optimizer()
  graphdef, params = nnx.split(draft)
  target_graphdef, target_params = nnx.split(target)

  @jax.jit
  def update(params, opt_state, target_params, tokens_BxT, response_mask_BxT):
    target_logits = nnx.merge(target_graphdef, target_params)(tokens_BxT)
    loss, grads = jax.value_and_grad(lambda p: distillation_loss(
        nnx.merge(graphdef, p), target_logits, tokens_BxT, response_mask_BxT, sampling))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = tx.init(params)
  sampler = np.random.default_rng(config.seed)
  losses = []
  for index in range(config.num_updates):
    rows = sampler.choice(data.tokens.shape[0], config.batch_size,
                          replace=data.tokens.shape[0] < config.batch_size)
    params, opt_state, loss = update(params, opt_state, target_params,
                                     jnp.asarray(data.tokens[rows]),
                                     jnp.asarray(data.response_mask[rows]))
    losses.append(loss)
    if log_every and (index % log_every == 0 or index == config.num_updates - 1):
      log({"update": index, "loss": float(loss)})
  history = [{"update": i, "loss": float(x)} for i, x in enumerate(jax.device_get(losses))]
  return nnx.merge(graphdef, params), history
