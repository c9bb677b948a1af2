"""EAGLE-3's *training-time test*: the loss that trains hidden-state drafters (MTP,
EAGLE-3), offline (``offline``) or inside the RL learner (``rl.loop.online_drafters``).

Step 0 runs the drafter over a sequence with the target's features as inputs, exactly
as decoding does for committed tokens. Step i > 0 feeds each position the drafter's own
step i - 1 output at the previous position instead, and attends to what a depth-i draft
node sees while decoding: the committed context up to its root (step-0 keys at
positions <= j - i) and its own chain of drafted ancestors (the step-k key at position
j - i + k, k = 1..i). Every step's output at position j is trained toward the target's
distribution for token j + 1 with soft cross-entropy, step i weighted ``step_decay ** i``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from specrl_jax.config import check, check_positive_int
from specrl_jax.models.attention import grouped_attention
from specrl_jax.models.transformer import ForwardOutput, Transformer
from specrl_jax.speculative.drafters.hidden_state import (
    ATTENTION_LAYER, HiddenStateDrafter, merge_weights, shift_right)

Array = jax.Array

LABELS = ("target", "tokens")


@flax.struct.dataclass
class UnrollKV:
  """KV backend of the training-time-test unroll (one attention layer).

  Holds the keys/values of the steps run so far; step i's queries see the step-0 keys
  at positions <= j - i and the step-k key at position j - i + k for k = 1..i (itself
  for k = i). Every visible key is at a position <= j, so right padding needs no mask.
  """
  keys: tuple[Array, ...] = ()
  values: tuple[Array, ...] = ()

  def attend(self, layer, q_BxTxHxD, k_BxTxKxD, v_BxTxKxD):
    if layer != ATTENTION_LAYER:
      raise ValueError(f"UnrollKV serves one attention layer; got layer {layer}.")
    step = len(self.keys)
    batch, length = q_BxTxHxD.shape[:2]
    query_Tx1 = jnp.arange(length)[:, None]
    key_1xT = jnp.arange(length)[None, :]
    masks = [key_1xT <= query_Tx1 - step]
    masks += [key_1xT == query_Tx1 - step + k for k in range(1, step + 1)]
    mask_TxL = jnp.concatenate(masks, axis=1)
    keys = self.keys + (k_BxTxKxD,)
    values = self.values + (v_BxTxKxD,)
    out = grouped_attention(q_BxTxHxD, jnp.concatenate(keys, axis=1),
                            jnp.concatenate(values, axis=1),
                            jnp.broadcast_to(mask_TxL, (batch,) + mask_TxL.shape))
    return out, UnrollKV(keys=keys, values=values)


def unroll(head: nnx.Module, tokens_BxT: Array, features_BxTxD: Array, unroll_steps: int
           ) -> list[Array]:
  """The drafter head's outputs [B, T, D] at each training-time-test step.

  features_BxTxD[:, j] is the target's feature at position j (read by entry j + 1).
  Step i's output at position j is what decoding computes for a depth-i draft node at
  position j whose root is j - i, when the drafted tokens are the true ones.
  """
  batch, length = tokens_BxT.shape
  positions_BxT = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  inputs_BxTxD = shift_right(features_BxTxD)
  kv = UnrollKV()
  outputs = []
  for _ in range(unroll_steps):
    outputs_BxTxD, kv = head.decode(tokens_BxT, inputs_BxTxD, positions_BxT, kv)
    outputs.append(outputs_BxTxD)
    inputs_BxTxD = shift_right(outputs_BxTxD)
  return outputs


def _frozen_tables(weights: dict[str, Any]) -> dict[str, Any]:
  return {"trainable": weights["trainable"],
          "shared": jax.lax.stop_gradient(weights["shared"])}


def unrolled_loss(drafter: HiddenStateDrafter, weights: dict[str, Any], tokens_BxT: Array,
                  target_output: ForwardOutput, response_mask_BxT: Array, *,
                  unroll_steps: int = 7, step_decay: float = 0.8, labels: str = "target"
                  ) -> tuple[Array, dict[str, Array]]:
  """Training-time-test loss of ``drafter`` with ``weights`` on a batch of sequences.

  target_output: the target's forward over ``tokens_BxT`` with ``drafter.hidden_layers``
    (hidden states and logits). Detach it unless the target trains jointly.
  response_mask_BxT: true on the tokens to predict (the learner's Batch convention:
    response tokens, never position 0); position j is trained when token j + 1 is.
  labels: "target" = soft cross-entropy to the target's distribution (restricted to
    the draft vocabulary and renormalised); "tokens" = cross-entropy to the actual
    next token (MTP trained jointly with the policy on data).
  Returns (loss, metrics). The loss is a per-row token mean summed over steps, averaged
  over rows, so micro-batch means average to the full-batch value. Metrics:
  "expected_acceptance" [steps] (mean over trained positions of sum_v min(p, q): the
  chance a sampled draft at that depth is accepted, given its parent was) and
  "top1_agreement" [steps].
  """
  check_positive_int("unrolled_loss", "unroll_steps", unroll_steps)
  check(labels in LABELS, "unrolled_loss", "labels", labels, f"one of {LABELS}")
  head = merge_weights(drafter.graphdef, _frozen_tables(weights))
  batch, length = tokens_BxT.shape
  predict_BxT = jnp.pad(jnp.asarray(response_mask_BxT, bool)[:, 1:], ((0, 0), (0, 1)))
  table = None if drafter.draft_to_target is None else jnp.asarray(drafter.draft_to_target)

  target_logits_BxTxV = target_output.logits.astype(jnp.float32)
  target_probs_BxTxV = jax.lax.stop_gradient(jax.nn.softmax(target_logits_BxTxV, axis=-1))
  if labels == "target":
    restricted = target_logits_BxTxV if table is None else target_logits_BxTxV[..., table]
    soft_labels_BxTxU = jax.lax.stop_gradient(jax.nn.softmax(restricted, axis=-1))
  else:
    next_BxT = jnp.pad(tokens_BxT[:, 1:], ((0, 0), (0, 1)))
    if table is not None:
      draft_id_V = jnp.full((drafter.vocab_size,), -1, jnp.int32).at[table].set(
          jnp.arange(table.size, dtype=jnp.int32))
      next_BxT = draft_id_V[next_BxT]
      predict_BxT = predict_BxT & (next_BxT >= 0)
    num_draft = drafter.vocab_size if table is None else table.size
    soft_labels_BxTxU = jax.nn.one_hot(next_BxT, num_draft)

  features_BxTxD = head.features(target_output.hidden, target_output.layer_hidden)
  position_T = jnp.arange(length)
  total_B = jnp.zeros((batch,), jnp.float32)
  acceptance, agreement = [], []
  for step, outputs_BxTxD in enumerate(unroll(head, tokens_BxT, features_BxTxD, unroll_steps)):
    log_q_BxTxU = jax.nn.log_softmax(head.logits(outputs_BxTxD), axis=-1)
    cross_entropy_BxT = -jnp.sum(soft_labels_BxTxU * log_q_BxTxU, axis=-1)
    valid_BxT = predict_BxT & (position_T >= step)[None, :]
    count_B = jnp.sum(valid_BxT, axis=1)
    total_B += (step_decay ** step) * jnp.sum(jnp.where(valid_BxT, cross_entropy_BxT, 0),
                                              axis=1) / jnp.maximum(count_B, 1)
    # Metrics on the target vocabulary, at temperature 1.
    q_BxTxU = jax.lax.stop_gradient(jnp.exp(log_q_BxTxU))
    q_BxTxV = q_BxTxU if table is None else jnp.zeros_like(target_probs_BxTxV).at[
        ..., table].set(q_BxTxU)
    overlap_BxT = jnp.sum(jnp.minimum(q_BxTxV, target_probs_BxTxV), axis=-1)
    same_BxT = jnp.argmax(q_BxTxV, axis=-1) == jnp.argmax(target_probs_BxTxV, axis=-1)
    denominator = jnp.maximum(jnp.sum(valid_BxT), 1)
    acceptance.append(jnp.sum(jnp.where(valid_BxT, overlap_BxT, 0)) / denominator)
    agreement.append(jnp.sum(valid_BxT & same_BxT) / denominator)
  loss = jnp.mean(total_B)
  return loss, {"expected_acceptance": jnp.stack(acceptance),
                "top1_agreement": jnp.stack(agreement)}


def expected_acceptance_length(per_step_acceptance: Sequence[float], num_draft_tokens: int
                               ) -> float:
  """1 + sum_d prod_{i<=d} a_i: tokens per round of a chain whose depth-d draft is
  accepted with probability a_d given its parent was (steps beyond the unroll repeat
  the last rate)."""
  rates = list(per_step_acceptance)
  length, survive = 1.0, 1.0
  for depth in range(num_draft_tokens):
    survive *= rates[min(depth, len(rates) - 1)]
    length += survive
  return length


def target_forward(target: Transformer, tokens_BxT: Array, hidden_layers: tuple[int, ...]
                   ) -> ForwardOutput:
  """The target's causal forward with the layers a drafter reads, detached."""
  out = target.forward(tokens_BxT, hidden_layers=hidden_layers)
  stop = jax.lax.stop_gradient
  return out.replace(logits=stop(out.logits), hidden=stop(out.hidden),
                     layer_hidden=tuple(stop(h) for h in out.layer_hidden))

