"""The sharded GRPO learner: train state, optimizer, and one jitted train step.

The policy is a ``specrl_jax.Transformer`` split with ``nnx.split`` into a static
graphdef and a parameter state; everything that changes during training lives in one
``TrainState`` pytree, sharded over a ("data", "fsdp", "tensor") mesh by the rules in
``specrl_jax.parallel``. ``make_train_step`` compiles one update with explicit in/out
shardings, the state donated, and micro-batches accumulated with ``lax.scan``. An
update that would make any weight or optimizer moment non-finite is not kept
(``rl.numerics``): the step returns its input state and says so in its metrics. The
optimizer and its config live in ``rl.optimizer``.

An optional drafter (EAGLE-3 / MTP heads trained online) rides along: its params and
optimizer state sit in the train state, and its loss reads the policy forward's
*detached* hidden states, so it never changes the policy's gradient.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specrl_jax.config import SamplingParams, check
from specrl_jax.models.transformer import ForwardOutput
from specrl_jax.parallel.mesh import BATCH_AXES, batch_sharding, data_parallel_size, replicated
from specrl_jax.parallel.rules import TRANSFORMER_RULES, PartitionRules, named_shardings
from specrl_jax.rl.logprobs import token_log_probs
from specrl_jax.rl.losses import (
    aggregation_weights, combine_metrics, grpo_loss, valid_token_weights,
)
from specrl_jax.rl.numerics import keep_if_finite
from specrl_jax.rl.optimizer import (  # noqa: F401  (re-exported: the learner's config)
    SCHEDULES, LearnerConfig, drafter_peak, learning_rate_schedule, make_optimizer,
    non_negative_int,
)

Array = jax.Array




# ----------------------------------------------------------------------------- state

@flax.struct.dataclass
class TrainState:
  """Everything a training run updates, as one pytree (sharded, checkpointed whole).

  rng holds raw key data (uint32), which checkpoints as a plain array; it is advanced
  once per step for stochastic objectives.
  """
  step: Array
  params: Any
  opt_state: Any
  rng: Array
  ref_params: Any = None
  drafter_params: Any = None
  drafter_opt_state: Any = None


@flax.struct.dataclass
class Batch:
  """One training batch of B right-padded rows of prompt + response tokens.

  tokens: int32 [B, T]; response_mask: [B, T], true on response tokens (never at t=0);
  advantages: float32 [B];
  old_logprobs: float32 [B, T], the denominator of the ratio: the learner's own
    log-probs of the tokens (``rl.learn_step`` sets them; None until then);
  ref_logprobs: optional float32 [B, T] reference log-probs (else computed from the
    state's ref_params when present);
  rollout_logprobs: optional float32 [B, T] the sampler's log-probs, for the truncated
    IS correction (GRPOConfig.tis_cap).
  A rollout's batch holds tokens, mask and rollout_logprobs; the learner fills in
  advantages and old_logprobs. The train step needs both.
  """
  tokens: Array
  response_mask: Array
  advantages: Array | None = None
  old_logprobs: Array | None = None
  ref_logprobs: Array | None = None
  rollout_logprobs: Array | None = None


DrafterLossFn = Callable[[Any, ForwardOutput, Batch], tuple[Array, Mapping[str, Array]]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterObjective:
  """How a drafter trains alongside the policy.

  loss_fn(drafter_params, policy_output, batch) -> (loss, metrics): policy_output is
    the policy's ForwardOutput with gradients stopped; its layer_hidden holds the
    layers named in ``hidden_layers``.
  The train step minimises policy loss + loss_weight * drafter loss. With several
  micro-batches the drafter loss and metrics are averaged over them, so a loss that
  is a mean over a micro-batch should divide by a per-row constant to stay exact.
  Drafter params are sharded by the same path rules (an "lm_head" leaf like the
  policy's, anything unmatched replicated).
  """

  loss_fn: DrafterLossFn
  hidden_layers: tuple[int, ...] = ()
  loss_weight: float = 1.0

  def __post_init__(self):
    owner = "DrafterObjective"
    check(callable(self.loss_fn), owner, "loss_fn", self.loss_fn,
          "a function (drafter_params, ForwardOutput, Batch) -> (loss, metrics)")
    check(isinstance(self.hidden_layers, tuple)
          and all(non_negative_int(i) for i in self.hidden_layers),
          owner, "hidden_layers", self.hidden_layers, "a tuple of layer indices >= 0")
    check(self.loss_weight >= 0, owner, "loss_weight", self.loss_weight, ">= 0")


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
    return TrainState(
        step=jnp.zeros((), jnp.int32), params=policy, opt_state=policy_tx.init(policy),
        rng=rng_in,
        ref_params=jax.tree.map(jnp.copy, policy) if with_reference else None,
        drafter_params=drafter,
        drafter_opt_state=None if drafter is None else drafter_tx.init(drafter))

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
  for name in ("advantages", "old_logprobs"):
    check(getattr(batch, name) is not None, "Batch", name, None,
          "an array (the learner sets it: rl.learn_step)")
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


def _detached(out: ForwardOutput) -> ForwardOutput:
  stop = jax.lax.stop_gradient
  return ForwardOutput(logits=stop(out.logits), hidden=stop(out.hidden),
                       layer_hidden=tuple(stop(h) for h in out.layer_hidden), kv=out.kv)


def _forward(model, tokens_BxT: Array, hidden_layers: tuple[int, ...], mesh: Mesh
             ) -> ForwardOutput:
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
                      inputs_embeds_BxTxD=embeds_BxTxD)
  return out.replace(logits=jax.lax.with_sharding_constraint(out.logits, rows),
                     hidden=jax.lax.with_sharding_constraint(out.hidden, rows))


def check_warp(sampling: SamplingParams, owner: str) -> None:
  """The rollout's warp, which the learner's log-probs reuse, must sample: greedy
  log-probs have no gradient."""
  check(isinstance(sampling, SamplingParams) and not sampling.greedy, owner, "sampling",
        sampling, "SamplingParams with temperature > 0 (greedy log-probs have no gradient)")


def _policy_and_drafter_loss(graphdef: nnx.GraphDef, config: LearnerConfig, mesh: Mesh,
                             drafter: DrafterObjective | None, sampling: SamplingParams):
  """loss(params, drafter_params, ref_params, micro_batch, weights) for value_and_grad."""
  hidden_layers = () if drafter is None else drafter.hidden_layers
  micro_batches = config.num_micro_batches

  def loss_fn(params, drafter_params, ref_params, batch: Batch, token_weights_BxT,
              metric_weights_BxT):
    out = _forward(nnx.merge(graphdef, params), batch.tokens, hidden_layers, mesh)
    logprobs_BxT = token_log_probs(out.logits, batch.tokens, batch.response_mask,
                                   sampling)
    ref_logprobs_BxT = batch.ref_logprobs
    if ref_logprobs_BxT is None and ref_params is not None:
      ref_logits = _forward(nnx.merge(graphdef, ref_params), batch.tokens, (), mesh).logits
      ref_logprobs_BxT = jax.lax.stop_gradient(token_log_probs(
          ref_logits, batch.tokens, batch.response_mask, sampling))
    loss, metrics = grpo_loss(
        logprobs_BxT, batch.old_logprobs, batch.advantages, batch.response_mask,
        ref_logprobs=ref_logprobs_BxT, rollout_logprobs=batch.rollout_logprobs,
        config=config.loss, token_weights=token_weights_BxT,
        metric_weights=metric_weights_BxT)
    metrics = dict(metrics, loss=loss)
    drafter_metrics = {}
    total = loss
    if drafter is not None:
      drafter_loss, drafter_metrics = drafter.loss_fn(drafter_params, _detached(out), batch)
      drafter_metrics = dict(drafter_metrics, loss=drafter_loss)
      # Each micro-batch's drafter loss is its own mean: average them.
      total = total + drafter.loss_weight * drafter_loss / micro_batches
    return total, (metrics, drafter_metrics)

  return loss_fn


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
  ``nonfinite_leaf`` (``rl.numerics.leaf_name`` names it; -1 when all are finite).
  """
  check((drafter is None) == (state.drafter_params is None), "make_train_step",
        "drafter", drafter, "a DrafterObjective exactly when the state has drafter_params")
  check_warp(sampling, "make_train_step")
  policy_tx = make_optimizer(config)
  drafter_tx = make_optimizer(config, drafter_peak(config))
  schedule = learning_rate_schedule(config)
  state_shardings = train_state_shardings(state, mesh, rules)
  loss_fn = _policy_and_drafter_loss(graphdef, config, mesh, drafter, sampling)
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
      (_, aux), grads_now = grad_fn(state.params, state.drafter_params, state.ref_params,
                                    *micro_batch)
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
    logits = _forward(nnx.merge(graphdef, params), tokens_BxT, (), mesh).logits
    return token_log_probs(logits, tokens_BxT, response_mask_BxT, sampling)

  rows = batch_sharding(mesh)
  return jax.jit(log_probs, in_shardings=(param_shardings, rows, rows), out_shardings=rows)
