"""Drafters trained during RL, behind one interface the RL loops use.

An ``OnlineDrafter`` says what of a drafter trains (``trainable``: the pytree that
sits in ``TrainState.drafter_params``), how the learner trains it (a
``DrafterObjective``) and how the rollout reads it back (``rollout_params``), so the
sync and async loops never look inside a drafter. Builders are registered by drafter
class. Hidden-state drafters (EAGLE-3, MTP) train with the training-time-test loss
(``specrl_jax.speculative.drafters.training_time_test``) through ``online_objective``;
``joint_loss`` trains an MTP head jointly with the policy; the history drafter trains
its fallback.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from specrl_jax.config import SamplingParams
from specrl_jax.models.transformer import ForwardOutput
from specrl_jax.rl.loop.learner import Batch, DrafterObjective
from specrl_jax.speculative.drafters.base import Drafter
from specrl_jax.speculative.drafters.draft_model import DraftModel
from specrl_jax.speculative.drafters.draft_model_offline import (
    cross_entropy_BxT as draft_cross_entropy)
from specrl_jax.speculative.drafters.hidden_state import HiddenStateDrafter
from specrl_jax.speculative.drafters.history import History
from specrl_jax.speculative.drafters.training_time_test import unrolled_loss

Array = jax.Array


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
                  "with specrl_jax.rl.loop.online_drafters.register.")


@register(DraftModel)
def _draft_model(drafter: DraftModel, *, sampling: SamplingParams, loss_weight: float
                 ) -> OnlineDrafter:
  """A separate small model, distilled toward the policy's warped next-token
  distribution on the rollout's response tokens (soft cross-entropy)."""
  graphdef = drafter.graphdef

  def loss_fn(drafter_params, policy_output, batch: Batch):
    logits_BxTxV = nnx.merge(graphdef, drafter_params)(batch.tokens)[:, :-1]
    cross_entropy_BxT = draft_cross_entropy(logits_BxTxV, policy_output.logits[:, :-1],
                                            sampling)
    # Position t drafts token t + 1: train where that token is a response token.
    mask_BxT = batch.response_mask[:, 1:].astype(jnp.float32)
    # A per-row constant normaliser keeps micro-batch means exact (DrafterObjective).
    loss = jnp.sum(cross_entropy_BxT * mask_BxT) / mask_BxT.size
    per_token = jnp.sum(cross_entropy_BxT * mask_BxT) / jnp.maximum(mask_BxT.sum(), 1.0)
    return loss, {"cross_entropy": per_token}

  return OnlineDrafter(drafter=drafter, trainable=drafter.params(),
                       objective=DrafterObjective(loss_fn=loss_fn, loss_weight=loss_weight),
                       rollout_params=lambda trainable: trainable)


@register(HiddenStateDrafter)
def _hidden_state(drafter: HiddenStateDrafter, *, sampling: SamplingParams, loss_weight: float
                  ) -> OnlineDrafter:
  del sampling  # trained toward the policy's plain distribution (training-time test)
  static = drafter.params()
  return OnlineDrafter(
      drafter=drafter, trainable=drafter.weights,
      objective=online_objective(drafter, loss_weight=loss_weight),
      rollout_params=lambda trainable: dict(static, weights=trainable))


@register(History)
def _history(drafter: History, *, sampling: SamplingParams, loss_weight: float
             ) -> OnlineDrafter:
  """The history drafter trains its fallback (the history itself is not learned): the
  fallback's trainer, its params placed beside the bank (which the step fills in,
  ``rl.loop.drafter_memory``)."""
  if drafter.fallback is None:
    raise TypeError("History without a fallback has nothing to train online: give it a "
                    "learned fallback, or train nothing (online=False).")
  inner = online_drafter(drafter.fallback, sampling=sampling, loss_weight=loss_weight)
  return OnlineDrafter(
      drafter=drafter, trainable=inner.trainable, objective=inner.objective,
      rollout_params=lambda trainable: {"bank": drafter.store.device_arrays(),
                                        "fallback": inner.rollout_params(trainable)})


def online_objective(drafter: HiddenStateDrafter, *, loss_weight: float = 1.0,
                     unroll_steps: int = 7, step_decay: float = 0.8) -> DrafterObjective:
  """The learner hook that trains ``drafter`` every RL step on the rollout batch.

  The learner calls the loss with the policy's *detached* forward (logits and the
  layers in ``drafter.hidden_layers``) and the batch; it adds ``loss_weight`` times
  the loss and updates the drafter weights it holds in ``TrainState.drafter_params``
  (pass ``drafter.weights`` there; they are checkpointed with the policy). Gradients
  never reach the shared tables, so they stay the target's copies; with the learner's
  AdamW a zero gradient means a zero update unless weight_decay > 0.
  """
  def loss_fn(weights, policy_output: ForwardOutput, batch: Batch):
    return unrolled_loss(drafter, weights, batch.tokens, policy_output, batch.response_mask,
                         unroll_steps=unroll_steps, step_decay=step_decay)

  return DrafterObjective(loss_fn=loss_fn, hidden_layers=drafter.hidden_layers,
                          loss_weight=loss_weight)


def joint_loss(target_graphdef: nnx.GraphDef, target_params, drafter: HiddenStateDrafter,
               weights: dict[str, Any], tokens_BxT: Array, response_mask_BxT: Array, *,
               loss_weight: float = 0.3, unroll_steps: int = 1
               ) -> tuple[Array, dict[str, Array]]:
  """Next-token cross-entropy of the target plus ``loss_weight`` times the drafter's
  cross-entropy to the actual tokens, both differentiable in the target: MTP trained
  jointly with the policy, as DeepSeek-V3 does (gradients flow into the target through
  the hidden states the drafter reads; the drafter's shared tables stay frozen)."""
  target = nnx.merge(target_graphdef, target_params)
  out = target.forward(tokens_BxT, hidden_layers=drafter.hidden_layers)
  mask_BxT = jnp.asarray(response_mask_BxT, jnp.float32)[:, 1:]
  log_probs_BxTxV = jax.nn.log_softmax(out.logits[:, :-1].astype(jnp.float32), axis=-1)
  token_log_probs_BxT = jnp.take_along_axis(log_probs_BxTxV, tokens_BxT[:, 1:, None],
                                            axis=-1)[..., 0]
  target_loss = -jnp.sum(token_log_probs_BxT * mask_BxT) / jnp.maximum(jnp.sum(mask_BxT), 1)
  drafter_loss, metrics = unrolled_loss(drafter, weights, tokens_BxT, out, response_mask_BxT,
                                        unroll_steps=unroll_steps, labels="tokens")
  return target_loss + loss_weight * drafter_loss, dict(
      metrics, target_loss=target_loss, drafter_loss=drafter_loss)

