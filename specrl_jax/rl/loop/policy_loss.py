"""The function the learner differentiates: the policy forward, the GRPO loss, the
drafter's loss on the policy's detached activations, and the per-step diagnostics
(the training-inference mismatch).

The forward reads the compute copy of the master weights (``rl.loop.precision``), so the
learner differentiates the forward the sampler runs; with ``LearnerConfig.remat`` each
decoder block keeps only what its policy says for the backward pass.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax.numpy as jnp

from specrl_jax.config import SamplingParams, check
from specrl_jax.models.transformer import ForwardOutput
from specrl_jax.parallel.mesh import BATCH_AXES
from specrl_jax.rl.loop import precision
from specrl_jax.rl.algo.logprobs import token_log_probs
from specrl_jax.rl.algo.losses import grpo_loss
from specrl_jax.rl.algo.mismatch import mismatch_metrics
from specrl_jax.rl.loop.optimizer import LearnerConfig
from specrl_jax.rl.loop.train_state import Batch, DrafterObjective, TrainState

Array = jax.Array


def check_warp(sampling: SamplingParams, owner: str) -> None:
  """The rollout's warp, which the learner's log-probs reuse, must sample: greedy
  log-probs have no gradient."""
  check(isinstance(sampling, SamplingParams) and not sampling.greedy, owner, "sampling",
        sampling, "SamplingParams with temperature > 0 (greedy log-probs have no gradient)")


def detached(out: ForwardOutput) -> ForwardOutput:
  stop = jax.lax.stop_gradient
  return ForwardOutput(logits=stop(out.logits), hidden=stop(out.hidden),
                       layer_hidden=tuple(stop(h) for h in out.layer_hidden), kv=out.kv)


def policy_forward(model, tokens_BxT: Array, hidden_layers: tuple[int, ...], mesh: Mesh,
                   remat: str = "none") -> ForwardOutput:
  """The policy forward with activations pinned to batch sharding at both ends.

  Without the pins the partitioner may split activations over fsdp (the weights'
  layout) instead of gathering weights, which is FSDP turned inside out.
  """
  rows = NamedSharding(mesh, P(BATCH_AXES))
  # Gather the (fsdp-sharded) table whole before the lookup, as FSDP does for every
  # weight; a lookup into a D-sharded table would yield D-sharded activations.
  table_VxD = jax.lax.with_sharding_constraint(model.embed[...], NamedSharding(mesh, P()))
  embeds_BxTxD = jnp.take(table_VxD, tokens_BxT, axis=0).astype(jnp.dtype(model.config.dtype))
  embeds_BxTxD = jax.lax.with_sharding_constraint(embeds_BxTxD, rows)
  out = model.forward(tokens_BxT, hidden_layers=hidden_layers,
                      inputs_embeds_BxTxD=embeds_BxTxD, remat=remat)
  return out.replace(logits=jax.lax.with_sharding_constraint(out.logits, rows),
                     hidden=jax.lax.with_sharding_constraint(out.hidden, rows))


def policy_and_drafter_loss(graphdef: nnx.GraphDef, config: LearnerConfig, mesh: Mesh,
                            drafter: DrafterObjective | None, sampling: SamplingParams):
  """loss(params, drafter_params, state, micro_batch, weights...) for value_and_grad in
  its first two arguments (the master copies, or LoRA adapters); ``state`` supplies
  what stays fixed: the reference policy, a LoRA base, the compute dtypes.

  A batch without ``old_logprobs`` takes the ratio's denominator from this forward,
  detached (``LearnerConfig.skip_log_prob_pass``): each batch gets one update, so the
  learner's log-prob pass would compute these very values with these very weights.
  """
  hidden_layers = () if drafter is None else drafter.hidden_layers
  micro_batches = config.num_micro_batches

  def loss_fn(params, drafter_params, state: TrainState, batch: Batch, token_weights_BxT,
              metric_weights_BxT):
    ref_params = state.ref_params
    model = nnx.merge(graphdef, state.compute_params(params))
    out = policy_forward(model, batch.tokens, hidden_layers, mesh, config.remat)
    logprobs_BxT = token_log_probs(out.logits, batch.tokens, batch.response_mask,
                                   sampling)
    old_logprobs_BxT = batch.old_logprobs
    if old_logprobs_BxT is None:
      old_logprobs_BxT = jax.lax.stop_gradient(logprobs_BxT)
    ref_logprobs_BxT = batch.ref_logprobs
    if ref_logprobs_BxT is None and ref_params is not None:
      # A full copy of the initial policy (never adapters), in the model's dtype.
      reference = nnx.merge(graphdef, precision.compute_copy(ref_params,
                                                             state.compute_dtypes))
      ref_logits = policy_forward(reference, batch.tokens, (), mesh).logits
      ref_logprobs_BxT = jax.lax.stop_gradient(token_log_probs(
          ref_logits, batch.tokens, batch.response_mask, sampling))
    loss, metrics = grpo_loss(
        logprobs_BxT, old_logprobs_BxT, batch.advantages, batch.response_mask,
        ref_logprobs=ref_logprobs_BxT, rollout_logprobs=batch.rollout_logprobs,
        config=config.loss, token_weights=token_weights_BxT,
        metric_weights=metric_weights_BxT)
    metrics = dict(metrics, loss=loss)
    if batch.rollout_logprobs is not None:
      metrics.update(mismatch_metrics(logprobs_BxT, batch.rollout_logprobs,
                                      batch.response_mask, metric_weights_BxT))
    drafter_metrics = {}
    total = loss
    if drafter is not None:
      drafter_loss, drafter_metrics = drafter.loss_fn(
          state.compute_drafter_params(drafter_params), detached(out), batch)
      drafter_metrics = dict(drafter_metrics, loss=drafter_loss)
      # Each micro-batch's drafter loss is its own mean: average them.
      total = total + drafter.loss_weight * drafter_loss / micro_batches
    return total, (metrics, drafter_metrics)

  return loss_fn
