"""Offline training of hidden-state drafters (MTP, EAGLE-3) on the target's own
rollouts, with the target frozen: the draft vocabulary, the data, the update loop and
its evaluation. The loss is ``training_time_test.unrolled_loss``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from specrl_jax.config import ConfigError, SamplingParams, check, check_positive_int
from specrl_jax.models.transformer import Transformer
from specrl_jax.sampling.engine import EngineConfig
from specrl_jax.sampling.generate import generate
from specrl_jax.speculative.drafters.hidden_state import HiddenStateDrafter
from specrl_jax.speculative.drafters.training_time_test import target_forward, unrolled_loss

Array = jax.Array


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
      check_positive_int(owner, name, value)
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

