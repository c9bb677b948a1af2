"""Training hidden-state drafters (MTP, EAGLE-3): offline from the target's rollouts, or
online inside the RL learner.

The loss is EAGLE-3's *training-time test*. Step 0 runs the drafter over a sequence
with the target's features as inputs, exactly as decoding does for committed tokens.
Step i > 0 feeds each position the drafter's own step i - 1 output at the previous
position instead, and attends to what a depth-i draft node sees while decoding: the
committed context up to its root (step-0 keys at positions <= j - i) and its own chain
of drafted ancestors (the step-k key at position j - i + k, k = 1..i). Every step's
output at position j is trained toward the target's distribution for token j + 1 with
soft cross-entropy, step i weighted ``step_decay ** i``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from safetensors.numpy import load_file, save_file

from specrl_jax.config import ConfigError, SamplingParams, check
from specrl_jax.models.attention import grouped_attention
from specrl_jax.models.transformer import ForwardOutput, Transformer
from specrl_jax.parallel.rules import path_string
from specrl_jax.rl.learner import Batch, DrafterObjective
from specrl_jax.sampling.engine import EngineConfig
from specrl_jax.sampling.generate import generate
from specrl_jax.speculative.drafters.eagle3 import check_draft_to_target
from specrl_jax.speculative.drafters.hidden_state import (
    ATTENTION_LAYER, HiddenStateDrafter, check_weights, merge_weights, shift_right)

Array = jax.Array

LABELS = ("target", "tokens")


# ----------------------------------------------------------------- draft vocabulary

def build_draft_vocab(token_ids: Iterable[Any], vocab_size: int, draft_vocab_size: int
                      ) -> np.ndarray:
  """EAGLE-3's reduced vocabulary: the ``draft_vocab_size`` most frequent target ids in
  ``token_ids`` (arrays or lists; negative ids are padding and ignored), ties to the
  lower id, unseen ids filling up in id order. Returned sorted, as int32: the
  draft-to-target table (SpecForge stores it as offsets ``table - arange``)."""
  check(isinstance(draft_vocab_size, int) and 0 < draft_vocab_size <= vocab_size,
        "build_draft_vocab", "draft_vocab_size", draft_vocab_size,
        f"an integer in [1, vocab_size={vocab_size}]")
  counts = np.zeros(vocab_size, np.int64)
  for ids in token_ids:
    ids = np.asarray(ids).reshape(-1)
    ids = ids[ids >= 0]
    if ids.size and ids.max() >= vocab_size:
      raise ConfigError(f"build_draft_vocab got token id {int(ids.max())}: expected ids in "
                        f"[0, {vocab_size}) (the target's vocabulary).")
    counts += np.bincount(ids, minlength=vocab_size)
  # Stable sort on -count keeps the lower id first among equal counts.
  order = np.argsort(-counts, kind="stable")
  return np.sort(order[:draft_vocab_size]).astype(np.int32)


# ----------------------------------------------------------------- training-time test

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
    mask_TxS = jnp.concatenate(masks, axis=1)
    keys = self.keys + (k_BxTxKxD,)
    values = self.values + (v_BxTxKxD,)
    out = grouped_attention(q_BxTxHxD, jnp.concatenate(keys, axis=1),
                            jnp.concatenate(values, axis=1),
                            jnp.broadcast_to(mask_TxS, (batch,) + mask_TxS.shape))
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
  check(isinstance(unroll_steps, int) and unroll_steps >= 1, "unrolled_loss", "unroll_steps",
        unroll_steps, "a positive integer")
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


# ----------------------------------------------------------------- data

@dataclasses.dataclass(frozen=True)
class RolloutData:
  """Training sequences: prompt + response tokens, right padded with 0.

  tokens: int32 [N, T]; response_mask: bool [N, T], true on response tokens.
  """
  tokens: np.ndarray
  response_mask: np.ndarray

  def __post_init__(self):
    check(self.tokens.ndim == 2 and self.tokens.shape == self.response_mask.shape,
          "RolloutData", "shapes", (self.tokens.shape, self.response_mask.shape),
          "tokens and response_mask of the same [N, T] shape")


def rollout_data(target: Transformer, prompts: Sequence[Sequence[int]], *,
                 sampling: SamplingParams, rng: Array, engine: EngineConfig = EngineConfig(),
                 pad_to_multiple: int = 8) -> RolloutData:
  """Samples the target's own responses to ``prompts`` (plain decoding) as training
  data: what the drafter will be asked to predict while speculating for this policy."""
  out = generate(target, prompts, sampling=sampling, rng=rng, engine=engine)
  return sequences_to_data(prompts, out.tokens, out.lengths, pad_to_multiple=pad_to_multiple)


def sequences_to_data(prompts: Sequence[Sequence[int]], responses_NxL: np.ndarray,
                      lengths_N: np.ndarray, *, pad_to_multiple: int = 8) -> RolloutData:
  """Packs prompts and their responses (generate's tokens/lengths) into RolloutData."""
  rows = [list(map(int, p)) + list(map(int, r[:n]))
          for p, r, n in zip(prompts, np.asarray(responses_NxL), np.asarray(lengths_N))]
  width = -(-max(len(r) for r in rows) // pad_to_multiple) * pad_to_multiple
  tokens = np.zeros((len(rows), width), np.int32)
  mask = np.zeros((len(rows), width), bool)
  for index, (prompt, row) in enumerate(zip(prompts, rows)):
    tokens[index, :len(row)] = row
    mask[index, len(prompt):len(row)] = True
  return RolloutData(tokens=tokens, response_mask=mask)


# ----------------------------------------------------------------- offline training

@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterTrainingConfig:
  """Offline drafter training: AdamW on a warmup + cosine schedule, global-norm clip."""

  num_updates: int = 500
  batch_size: int = 32
  learning_rate: float = 3e-3
  warmup_updates: int = 20
  weight_decay: float = 0.0
  max_grad_norm: float | None = 1.0
  unroll_steps: int = 7
  step_decay: float = 0.8
  seed: int = 0

  def __post_init__(self):
    owner = "DrafterTrainingConfig"
    for name in ("num_updates", "batch_size", "unroll_steps"):
      value = getattr(self, name)
      check(isinstance(value, int) and not isinstance(value, bool) and value > 0, owner,
            name, value, "a positive integer")
    check(isinstance(self.warmup_updates, int) and 0 <= self.warmup_updates, owner,
          "warmup_updates", self.warmup_updates, "an integer >= 0")
    check(self.learning_rate > 0, owner, "learning_rate", self.learning_rate, "> 0")
    check(self.weight_decay >= 0, owner, "weight_decay", self.weight_decay, ">= 0")
    check(self.max_grad_norm is None or self.max_grad_norm > 0, owner, "max_grad_norm",
          self.max_grad_norm, "None or > 0")
    check(0 < self.step_decay <= 1, owner, "step_decay", self.step_decay, "in (0, 1]")

  def optimizer(self) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, self.learning_rate, max(self.warmup_updates, 1),
        max(self.num_updates, self.warmup_updates + 1), end_value=0.1 * self.learning_rate)
    adamw = optax.adamw(schedule, weight_decay=self.weight_decay,
                        mask=lambda tree: jax.tree.map(lambda x: x.ndim > 1, tree))
    if self.max_grad_norm is None:
      return adamw
    return optax.chain(optax.clip_by_global_norm(self.max_grad_norm), adamw)


def make_update(drafter: HiddenStateDrafter, target_graphdef: nnx.GraphDef,
                config: DrafterTrainingConfig) -> Callable:
  """Jitted ``update(trainable, opt_state, shared, target_params, tokens, response_mask)
  -> (trainable, opt_state, loss, metrics)``: one AdamW step on the unrolled loss of a
  frozen target. Only the trainable weights (never the shared tables) are updated."""
  tx = config.optimizer()

  def loss_fn(trainable, shared, target_params, tokens_BxT, response_mask_BxT):
    target = nnx.merge(target_graphdef, target_params)
    out = target_forward(target, tokens_BxT, drafter.hidden_layers)
    return unrolled_loss(drafter, {"trainable": trainable, "shared": shared}, tokens_BxT,
                         out, response_mask_BxT, unroll_steps=config.unroll_steps,
                         step_decay=config.step_decay)

  @jax.jit
  def update(trainable, opt_state, shared, target_params, tokens_BxT, response_mask_BxT):
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        trainable, shared, target_params, tokens_BxT, response_mask_BxT)
    updates, opt_state = tx.update(grads, opt_state, trainable)
    return optax.apply_updates(trainable, updates), opt_state, loss, metrics

  return update


def train_offline(drafter: HiddenStateDrafter, target: Transformer, data: RolloutData,
                  config: DrafterTrainingConfig = DrafterTrainingConfig(), *,
                  log_every: int = 0, log: Callable[[dict], None] = print
                  ) -> tuple[HiddenStateDrafter, list[dict[str, Any]]]:
  """Trains ``drafter`` on ``data`` (e.g. ``rollout_data`` of the target) with the
  target frozen. Returns the trained drafter and the per-update history (loss, and the
  per-step expected acceptance)."""
  drafter.check_target(target.config)
  check(data.tokens.shape[0] >= 1, "train_offline", "data", data.tokens.shape,
        "at least one sequence")
  target_graphdef, target_params = nnx.split(target)
  update = make_update(drafter, target_graphdef, config)
  trainable, shared = drafter.weights["trainable"], drafter.weights["shared"]
  opt_state = config.optimizer().init(trainable)
  sampler = np.random.default_rng(config.seed)
  history = []
  for index in range(config.num_updates):
    rows = sampler.choice(data.tokens.shape[0], config.batch_size,
                          replace=data.tokens.shape[0] < config.batch_size)
    trainable, opt_state, loss, metrics = update(
        trainable, opt_state, shared, target_params, jnp.asarray(data.tokens[rows]),
        jnp.asarray(data.response_mask[rows]))
    if log_every and (index % log_every == 0 or index == config.num_updates - 1):
      record = {"update": index, "loss": float(loss),
                "expected_acceptance": np.asarray(metrics["expected_acceptance"]).round(4).tolist()}
      history.append(record)
      log(record)
    elif not log_every:
      history.append({"update": index, "loss": loss})
  history = [dict(h, loss=float(h["loss"])) for h in history]
  return drafter.with_weights({"trainable": trainable, "shared": shared}), history


def evaluate(drafter: HiddenStateDrafter, target: Transformer, data: RolloutData, *,
             unroll_steps: int = 7, batch_size: int = 64) -> dict[str, Any]:
  """Loss and per-step expected acceptance of ``drafter`` on ``data`` (no training)."""
  @jax.jit
  def measure(weights, target_params, tokens_BxT, response_mask_BxT):
    out = target_forward(nnx.merge(target_graphdef, target_params), tokens_BxT,
                         drafter.hidden_layers)
    return unrolled_loss(drafter, weights, tokens_BxT, out, response_mask_BxT,
                         unroll_steps=unroll_steps)

  target_graphdef, target_params = nnx.split(target)
  losses, rates, weights = [], [], []
  for start in range(0, data.tokens.shape[0], batch_size):
    rows = slice(start, start + batch_size)
    loss, metrics = measure(drafter.weights, target_params, jnp.asarray(data.tokens[rows]),
                            jnp.asarray(data.response_mask[rows]))
    count = float(data.response_mask[rows].sum())
    losses.append(float(loss) * count)
    rates.append(np.asarray(metrics["expected_acceptance"]) * count)
    weights.append(count)
  total = max(sum(weights), 1.0)
  return {"loss": sum(losses) / total,
          "expected_acceptance": (np.sum(rates, axis=0) / total).round(4).tolist()}


# ----------------------------------------------------------------- online (during RL)

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


# ----------------------------------------------------------------- native checkpoints

_TABLE_KEY = "draft_to_target"


def save_drafter(directory: str | os.PathLike, drafter: HiddenStateDrafter) -> None:
  """Writes the drafter's weights (safetensors, nnx paths) and its table."""
  directory = os.fspath(directory)
  os.makedirs(directory, exist_ok=True)
  tensors = {f"{part}/{path_string(path)}": np.asarray(leaf)
             for part in ("trainable", "shared")
             for path, leaf in jax.tree_util.tree_leaves_with_path(drafter.weights[part])}
  if drafter.draft_to_target is not None:
    tensors[_TABLE_KEY] = np.asarray(drafter.draft_to_target, np.int32)
  save_file(tensors, os.path.join(directory, "drafter.safetensors"))
  with open(os.path.join(directory, "drafter.json"), "w") as f:
    json.dump({"kind": type(drafter).__name__,
               "hidden_layers": list(drafter.hidden_layers)}, f)


def load_drafter(directory: str | os.PathLike, template: HiddenStateDrafter
                 ) -> HiddenStateDrafter:
  """The weights saved by ``save_drafter`` put into a drafter shaped like ``template``
  (same class, built for the target); shapes are checked with a clear error."""
  directory = os.fspath(directory)
  with open(os.path.join(directory, "drafter.json")) as f:
    meta = json.load(f)
  if meta["kind"] != type(template).__name__:
    raise ConfigError(f"{directory} holds a {meta['kind']} drafter; the template is a "
                      f"{type(template).__name__}.")
  tensors = load_file(os.path.join(directory, "drafter.safetensors"))
  parts = {}
  for part in ("trainable", "shared"):
    leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(template.weights[part])
    names = [f"{part}/{path_string(path)}" for path, _ in leaves_with_path]
    missing = [n for n in names if n not in tensors]
    if missing:
      raise ConfigError(f"{directory} lacks drafter weights {missing}.")
    parts[part] = jax.tree.unflatten(treedef, [jnp.asarray(tensors[n]) for n in names])
  check_weights(type(template).__name__, template.weights, parts)
  drafter = template.with_weights(parts)
  if _TABLE_KEY in tensors:
    size = None if template.draft_to_target is None else np.size(template.draft_to_target)
    if size != tensors[_TABLE_KEY].size:
      raise ConfigError(f"{directory} holds a draft vocabulary of {tensors[_TABLE_KEY].size} "
                        f"ids; the template's has {size or 'none (the full vocabulary)'}.")
    drafter.draft_to_target = check_draft_to_target(tensors[_TABLE_KEY], template.vocab_size,
                                                    size)
  return drafter
