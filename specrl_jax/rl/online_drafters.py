"""Drafters trained during RL, behind one interface the RL loops use.

An ``OnlineDrafter`` says what of a drafter trains (``trainable``: the pytree that
sits in ``TrainState.drafter_params``), how the learner trains it (a
``DrafterObjective``) and how the rollout reads it back (``rollout_params``), so the
sync and async loops never look inside a drafter. Builders are registered by drafter
class; hidden-state drafters (EAGLE-3, MTP) come from
``specrl_jax.speculative.drafters.training``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from specrl_jax.config import SamplingParams
from specrl_jax.rl.learner import Batch, DrafterObjective
from specrl_jax.sampling.warp import warped_log_probs
from specrl_jax.speculative.drafters.base import Drafter
from specrl_jax.speculative.drafters.draft_model import DraftModel


@dataclasses.dataclass(frozen=True)
class OnlineDrafter:
  """drafter: the static drafter the rollout runs; trainable: its initial trainable
  pytree; objective: its loss for the learner; rollout_params: trainable -> the
  ``params()`` pytree the rollout passes to the drafter."""
  drafter: Drafter
  trainable: Any
  objective: DrafterObjective
  rollout_params: Callable[[Any], Any]


Builder = Callable[..., OnlineDrafter]
BUILDERS: dict[type, Builder] = {}


def register(drafter_type: type) -> Callable[[Builder], Builder]:
  def decorate(builder: Builder) -> Builder:
    BUILDERS[drafter_type] = builder
    return builder
  return decorate


def online_drafter(drafter: Drafter, *, sampling: SamplingParams, loss_weight: float = 1.0
                   ) -> OnlineDrafter:
  """The OnlineDrafter of ``drafter`` (the builder of its class or nearest base)."""
  for klass in type(drafter).__mro__:
    if klass in BUILDERS:
      return BUILDERS[klass](drafter, sampling=sampling, loss_weight=loss_weight)
  raise TypeError(f"{type(drafter).__name__} cannot train online: no builder among "
                  f"{sorted(k.__name__ for k in BUILDERS)}; train it offline or register one "
                  "with specrl_jax.rl.online_drafters.register.")


@register(DraftModel)
def _draft_model(drafter: DraftModel, *, sampling: SamplingParams, loss_weight: float
                 ) -> OnlineDrafter:
  """A separate small model, distilled toward the policy's warped next-token
  distribution on the rollout's response tokens (soft cross-entropy)."""
  graphdef = drafter.graphdef

  def loss_fn(drafter_params, policy_output, batch: Batch):
    logits_BxTxV = nnx.merge(graphdef, drafter_params)(batch.tokens)[:, :-1]
    target_BxTxV = jnp.exp(warped_log_probs(policy_output.logits[:, :-1], sampling))
    log_q_BxTxV = jax.nn.log_softmax(logits_BxTxV / sampling.temperature)
    cross_entropy_BxT = -jnp.sum(jnp.where(target_BxTxV > 0, target_BxTxV * log_q_BxTxV, 0.0),
                                 axis=-1)
    # Position t drafts token t + 1: train where that token is a response token.
    mask_BxT = batch.response_mask[:, 1:].astype(jnp.float32)
    # A per-row constant normaliser keeps micro-batch means exact (DrafterObjective).
    loss = jnp.sum(cross_entropy_BxT * mask_BxT) / mask_BxT.size
    per_token = jnp.sum(cross_entropy_BxT * mask_BxT) / jnp.maximum(mask_BxT.sum(), 1.0)
    return loss, {"cross_entropy": per_token}

  return OnlineDrafter(drafter=drafter, trainable=drafter.params(),
                       objective=DrafterObjective(loss_fn=loss_fn, loss_weight=loss_weight),
                       rollout_params=lambda trainable: trainable)


def _register_hidden_state_drafters() -> None:
  try:
    from specrl_jax.speculative.drafters import training
    from specrl_jax.speculative.drafters.hidden_state import HiddenStateDrafter
  except ImportError:  # the EAGLE-3 / MTP modules are optional here
    return

  @register(HiddenStateDrafter)
  def _hidden_state(drafter, *, sampling: SamplingParams, loss_weight: float) -> OnlineDrafter:
    del sampling  # trained toward the policy's plain distribution (training-time test)
    static = drafter.params()
    return OnlineDrafter(
        drafter=drafter, trainable=drafter.weights,
        objective=training.online_objective(drafter, loss_weight=loss_weight),
        rollout_params=lambda trainable: dict(static, weights=trainable))


_register_hidden_state_drafters()
