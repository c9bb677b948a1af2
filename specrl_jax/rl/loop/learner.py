"""The sharded GRPO learner: train state, optimizer, and one jitted train step.

The policy is a ``specrl_jax.Transformer`` split with ``nnx.split`` into a static
graphdef and a parameter state; everything that changes during training lives in one
``TrainState`` pytree, sharded over a ("data", "fsdp", "tensor") mesh by the rules in
``specrl_jax.parallel``. ``make_train_step`` compiles one update with explicit in/out
shardings, the state donated, and micro-batches accumulated with ``lax.scan``. An
update that would make any weight or optimizer moment non-finite is not kept
(``rl.loop.numerics``): the step returns its input state and says so in its metrics. The
optimizer and its config live in ``rl.loop.optimizer``; the loss in ``rl.loop.policy_loss``.
Weights and optimizer moments are float32 master copies whatever the model computes
in (``rl.loop.precision``).

An optional drafter (EAGLE-3 / MTP heads trained online) rides along: its params and
optimizer state sit in the train state, and its loss reads the policy forward's
*detached* hidden states, so it never changes the policy's gradient.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specrl_jax.config import SamplingParams, check
from specrl_jax.parallel.mesh import BATCH_AXES, batch_sharding, data_parallel_size, replicated
from specrl_jax.parallel.rules import TRANSFORMER_RULES, PartitionRules, named_shardings
from specrl_jax.rl.loop import lora, precision
from specrl_jax.rl.algo.logprobs import token_log_probs
from specrl_jax.rl.algo.aggregation import aggregation_weights, valid_token_weights
from specrl_jax.rl.algo.losses import combine_metrics
from specrl_jax.rl.loop.numerics import keep_if_finite
from specrl_jax.rl.loop.optimizer import (  # noqa: F401  (re-exported: the learner's config)
    SCHEDULES, LearnerConfig, drafter_peak, learning_rate_schedule, make_optimizer,
)
from specrl_jax.rl.loop.policy_loss import (  # noqa: F401  (check_warp re-exported)
    check_warp, policy_and_drafter_loss, policy_forward,
)
from specrl_jax.rl.loop.train_state import (  # noqa: F401  (re-exported: the learner's data)
    Batch, DrafterLossFn, DrafterObjective, TrainState,
)

Array = jax.Array


# ----------------------------------------------------------------------------- state

def train_state_shardings(state: TrainState, mesh: Mesh,
                          rules: PartitionRules = TRANSFORMER_RULES) -> TrainState:
  """NamedShardings for every leaf of a (concrete or abstract) train state."""
  return named_shardings(state, mesh, rules)


def _state_builder(params, config: LearnerConfig, *, rng: Array, with_reference: bool,
                   drafter_params):
  """(build, args): ``build(*args)`` makes a fresh TrainState; traceable under jit."""
  if jnp.issubdtype(jnp.asarray(rng).dtype, jax.dtypes.prng_key):
    rng = jax.random.key_data(rng)
  policy_tx = make_optimizer(config)
  drafter_tx = make_optimizer(config, drafter_peak(config))

  def build(params_in, drafter_in, rng_in):
    policy = params() if callable(params) else params_in
    drafter = drafter_params() if callable(drafter_params) else drafter_in
    if config.lora is None:
      master, frozen = precision.master_copy(policy, config.master_dtype), None
      compute_dtypes = precision.compute_dtypes_if_changed(policy, master)
    else:  # the adapters train (in float32); the base is frozen in its own dtype
      master, frozen, compute_dtypes = lora.init_adapters(
          policy, config.lora, jax.random.fold_in(jax.random.wrap_key_data(rng_in), 1),
          jnp.dtype(config.master_dtype or "float32")), policy, None
    drafter_master = precision.master_copy(drafter, config.master_dtype)
    return TrainState(
        step=jnp.zeros((), jnp.int32), params=master, opt_state=policy_tx.init(master),
        rng=rng_in,
        # Frozen, so kept in the model's own dtype: it never takes an update to lose.
        ref_params=jax.tree.map(jnp.copy, policy) if with_reference else None,
        drafter_params=drafter_master,
        drafter_opt_state=None if drafter is None else drafter_tx.init(drafter_master),
        frozen_params=frozen, compute_dtypes=compute_dtypes,
        drafter_compute_dtypes=precision.compute_dtypes_if_changed(drafter, drafter_master),
        lora=config.lora)

  # Functions are traced inside build; arrays are passed in (never baked as constants).
  args = (None if callable(params) else params,
          None if callable(drafter_params) else drafter_params, rng)
  return build, args


def abstract_train_state(params, config: LearnerConfig, mesh: Mesh, *, rng: Array,
                         with_reference: bool = False, drafter_params=None,
                         rules: PartitionRules = TRANSFORMER_RULES) -> TrainState:
  """What ``init_train_state`` would return, as ShapeDtypeStructs carrying their
  shardings, without allocating anything: the target to restore a checkpoint onto."""
  build, args = _state_builder(params, config, rng=rng, with_reference=with_reference,
                               drafter_params=drafter_params)
  abstract = jax.eval_shape(build, *args)
  return jax.tree.map(
      lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
      abstract, train_state_shardings(abstract, mesh, rules))


def init_train_state(params, config: LearnerConfig, mesh: Mesh, *, rng: Array,
                     with_reference: bool = False, drafter_params=None,
                     rules: PartitionRules = TRANSFORMER_RULES) -> TrainState:
  """A fresh train state laid out on ``mesh``.

  params / drafter_params: a pytree of arrays (e.g. ``nnx.split(model)[1]``), or a
    zero-argument function returning one. A function runs under jit with the target
    shardings, so every device creates only its own shard: the way to initialise on a
    multi-host mesh, where no single host can hold the model.
  with_reference: keep a frozen copy of the initial policy for the KL term.
  The weights are kept in ``config.master_dtype`` (``rl.loop.precision``); the dtypes they
  came in are the ones the model computes in.
  """
  build, args = _state_builder(params, config, rng=rng, with_reference=with_reference,
                               drafter_params=drafter_params)
  shardings = train_state_shardings(jax.eval_shape(build, *args), mesh, rules)
  return jax.jit(build, out_shardings=shardings)(*args)


# ----------------------------------------------------------------------------- step

def validate_batch(batch: Batch, mesh: Mesh, config: LearnerConfig) -> None:
  """Raises ConfigError unless ``batch`` can be split over ``mesh`` and micro-batches."""
  tokens_shape = tuple(batch.tokens.shape)
  check(len(tokens_shape) == 2, "Batch", "tokens.shape", tokens_shape, "[B, T]")
  rows = tokens_shape[0]
  check(batch.advantages is not None, "Batch", "advantages", None,
        "an array (the learner sets it: rl.learn_step)")
  check(batch.old_logprobs is not None or config.skip_log_prob_pass, "Batch",
        "old_logprobs", None, "an array (the learner sets it: rl.learn_step), or None "
        "with LearnerConfig.skip_log_prob_pass=True")
  for name in ("response_mask", "old_logprobs", "ref_logprobs", "rollout_logprobs"):
    value = getattr(batch, name)
    if value is not None:
      check(tuple(value.shape) == tokens_shape, "Batch", f"{name}.shape", tuple(value.shape),
            f"the tokens' shape {tokens_shape}")
  check(tuple(batch.advantages.shape) == (rows,), "Batch", "advantages.shape",
        tuple(batch.advantages.shape), f"({rows},), one advantage per row")
  replicas = data_parallel_size(mesh)
  check(rows % replicas == 0, "Batch", "tokens.shape[0]", rows,
        f"a multiple of the data-parallel size data*fsdp={replicas} of mesh "
        f"{dict(mesh.shape)}")
  check((rows // replicas) % config.num_micro_batches == 0, "LearnerConfig",
        "num_micro_batches", config.num_micro_batches,
        f"a divisor of the per-replica batch {rows // replicas} "
        f"(batch {rows} / data*fsdp {replicas})")


def _split_micro_batches(tree, num_micro_batches: int, mesh: Mesh):
  """[B, ...] -> [M, B / M, ...] with micro-batch m = rows m, m + M, m + 2M, ...

  Strided rather than contiguous: each device's contiguous block of rows holds a
  share of every micro-batch, so all devices work on every scan step and no rows
  move between devices.
  """
  sharding = NamedSharding(mesh, P(None, BATCH_AXES))

  def split(x):
    x = x.reshape((x.shape[0] // num_micro_batches, num_micro_batches) + x.shape[1:])
    return jax.lax.with_sharding_constraint(jnp.swapaxes(x, 0, 1), sharding)

  return jax.tree.map(split, tree)


@dataclasses.dataclass(frozen=True)
class TrainStep:
  """``step(state, batch) -> (state, metrics)``; checks the batch, then runs ``jitted``.

  ``jitted`` is the compiled update (explicit in/out shardings, state donated): call
  it directly, or ``.lower(...)`` it, when the batch is known to be valid.
  """
  jitted: Callable[[TrainState, Batch], tuple[TrainState, dict[str, Array]]]
  mesh: Mesh
  config: LearnerConfig
  state_shardings: TrainState

  def __call__(self, state: TrainState, batch: Batch):
    validate_batch(batch, self.mesh, self.config)
    return self.jitted(state, batch)


def make_train_step(graphdef: nnx.GraphDef, config: LearnerConfig, mesh: Mesh,
                    state: TrainState, *, sampling: SamplingParams = SamplingParams(),
                    drafter: DrafterObjective | None = None,
                    rules: PartitionRules = TRANSFORMER_RULES) -> TrainStep:
  """The jitted GRPO update over ``mesh`` for states shaped like ``state``.

  sampling: the warp of the rollout the batches come from (``RolloutConfig.sampling``):
  the learner's log-probs use it so the ratio compares like with like.

  ``state`` (concrete or ``jax.eval_shape``-abstract) fixes the train-state structure,
  e.g. whether reference and drafter slots are filled. ``drafter`` must be given
  exactly when the state holds drafter params. Metrics include ``update_finite`` and
  ``nonfinite_leaf`` (``rl.loop.numerics.leaf_name`` names it; -1 when all are finite).
  """
  check((drafter is None) == (state.drafter_params is None), "make_train_step",
        "drafter", drafter, "a DrafterObjective exactly when the state has drafter_params")
  check_warp(sampling, "make_train_step")
  policy_tx = make_optimizer(config)
  drafter_tx = make_optimizer(config, drafter_peak(config))
  schedule = learning_rate_schedule(config)
  state_shardings = train_state_shardings(state, mesh, rules)
  loss_fn = policy_and_drafter_loss(graphdef, config, mesh, drafter, sampling)
  grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)
  micro_batches = config.num_micro_batches

  def train_step(state: TrainState, batch: Batch):
    # Weights come from the full batch so that summing micro-batches (and shards)
    # gives exactly the full-batch loss whatever the aggregation mode.
    token_weights_BxT = aggregation_weights(batch.response_mask, config.loss)
    metric_weights_BxT = valid_token_weights(batch.response_mask)
    micro = _split_micro_batches((batch, token_weights_BxT, metric_weights_BxT),
                                 micro_batches, mesh)
    zero_grads = jax.lax.with_sharding_constraint(
        jax.tree.map(jnp.zeros_like, (state.params, state.drafter_params)),
        (state_shardings.params, state_shardings.drafter_params))

    def accumulate(grads, micro_batch):
      (_, aux), grads_now = grad_fn(state.params, state.drafter_params, state, *micro_batch)
      return jax.tree.map(jnp.add, grads, grads_now), aux

    (policy_grads, drafter_grads), (metrics, drafter_metrics) = jax.lax.scan(
        accumulate, zero_grads, micro)
    metrics = combine_metrics(metrics)
    metrics["grad_norm"] = optax.tree.norm(policy_grads)
    metrics["learning_rate"] = schedule(state.step)
    updates, opt_state = policy_tx.update(policy_grads, state.opt_state, state.params)
    new_state = state.replace(step=state.step + 1,
                              params=optax.apply_updates(state.params, updates),
                              opt_state=opt_state,
                              rng=jax.random.key_data(jax.random.split(
                                  jax.random.wrap_key_data(state.rng))[0]))
    if drafter is not None:
      for name, values in drafter_metrics.items():
        metrics[f"drafter/{name}"] = jnp.mean(values, axis=0)
      metrics["drafter/grad_norm"] = optax.tree.norm(drafter_grads)
      updates, drafter_opt_state = drafter_tx.update(drafter_grads, state.drafter_opt_state,
                                                     state.drafter_params)
      new_state = new_state.replace(
          drafter_params=optax.apply_updates(state.drafter_params, updates),
          drafter_opt_state=drafter_opt_state)
    new_state, guard_metrics = keep_if_finite(new_state, state)
    return new_state, dict(metrics, **guard_metrics)

  jitted = jax.jit(train_step, in_shardings=(state_shardings, batch_sharding(mesh)),
                   out_shardings=(state_shardings, replicated(mesh)), donate_argnums=0)
  return TrainStep(jitted=jitted, mesh=mesh, config=config, state_shardings=state_shardings)


def make_log_prob_step(graphdef: nnx.GraphDef, mesh: Mesh, params, *,
                       sampling: SamplingParams = SamplingParams(),
                       rules: PartitionRules = TRANSFORMER_RULES
                       ) -> Callable[[Any, Array, Array], Array]:
  """Jitted ``(params, tokens_BxT, response_mask_BxT) -> log-probs [B, T]`` on ``mesh``.

  The "log-prob" stage of a GRPO step: recomputing old (or reference) log-probs with
  the trainer's numerics for the batch the sampler produced, under the sampler's warp
  ``sampling``.
  """
  check_warp(sampling, "make_log_prob_step")
  param_shardings = named_shardings(params, mesh, rules)

  def log_probs(params, tokens_BxT, response_mask_BxT):
    logits = policy_forward(nnx.merge(graphdef, params), tokens_BxT, (), mesh).logits
    return token_log_probs(logits, tokens_BxT, response_mask_BxT, sampling)

  rows = batch_sharding(mesh)
  return jax.jit(log_probs, in_shardings=(param_shardings, rows, rows), out_shardings=rows)
