"""The sharded GRPO learner: one step on any mesh is the single-device step.

Runs on the 8 simulated CPU devices of conftest.py. "Relative error" of a parameter
tensor is ||sharded - single|| / ||single||: Adam divides each gradient entry by its
own magnitude, so an entry whose gradient is ~1e-8 turns float-rounding differences
of the reduction order into visible per-entry noise, while the tensor as a whole
agrees to ~1e-6.
"""

import dataclasses
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import specrl_jax as sj
from specrl_jax import parallel, rl
from specrl_jax.config import ConfigError
from specrl_jax.rl.loop.rollout import RolloutConfig

MODEL = sj.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=8)
B, T, PROMPT = 16, 12, 4
SAMPLING = sj.SamplingParams(temperature=0.9)  # the rollout's warp, which the learner reuses
CONFIG = rl.LearnerConfig(
    learning_rate=1e-3, weight_decay=0.01, num_micro_batches=2,
    loss=rl.GRPOConfig(beta=0.05, tis_cap=2.0, clip_eps_high=0.28))
MESHES = [(8, 1, 1), (2, 4, 1), (2, 2, 2)]


def _drafter_loss(drafter_params, policy, batch):
  """A real (if tiny) drafter: a linear head on layer 0's detached hidden states,
  distilled toward the policy's detached next-token distribution on response tokens.
  Normalised by a constant so micro-batch means average to the full-batch value."""
  logits_BxTxV = policy.layer_hidden[0] @ drafter_params["lm_head"]
  targets_BxTxV = jax.nn.softmax(policy.logits, axis=-1)
  cross_entropy_BxT = -jnp.sum(targets_BxTxV * jax.nn.log_softmax(logits_BxTxV), axis=-1)
  mask_BxT = batch.response_mask.astype(jnp.float32)
  loss = jnp.sum(cross_entropy_BxT * mask_BxT) / math.prod(mask_BxT.shape)
  return loss, {"tokens": mask_BxT.sum()}


DRAFTER = rl.DrafterObjective(loss_fn=_drafter_loss, hidden_layers=(0,), loss_weight=0.5)


@pytest.fixture(scope="module")
def setup():
  model = sj.Transformer(MODEL, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, MODEL.vocab_size, (B, T)).astype(np.int32)
  lengths = rng.integers(0, T - PROMPT + 1, B)
  lengths[3] = 0  # a row whose response is empty
  positions = np.arange(T)[None]
  mask = (positions >= PROMPT) & (positions < PROMPT + lengths[:, None])
  logprobs = np.asarray(rl.policy_log_probs(model, tokens, mask, SAMPLING))
  old = np.where(mask, logprobs + rng.normal(0, 0.3, (B, T)), 0).astype(np.float32)
  rollout = np.where(mask, old + rng.normal(0, 0.3, (B, T)), 0).astype(np.float32)
  advantages = np.asarray(rl.group_advantages(rng.normal(size=B), 4))
  batch = rl.Batch(tokens=tokens, response_mask=mask, old_logprobs=old,
                   advantages=advantages, rollout_logprobs=rollout)
  drafter = {"lm_head": (0.02 * rng.normal(size=(MODEL.hidden_size, MODEL.vocab_size)))
             .astype(np.float32)}
  return dict(graphdef=graphdef, params=jax.tree.map(np.asarray, params), batch=batch,
              drafter=drafter, model=model)


_COMPILED = {}  # one compiled step per (mesh, config, drafter), shared between tests


def _one_step(setup, mesh, config=CONFIG, drafter=DRAFTER, steps=1):
  state = rl.init_train_state(setup["params"], config, mesh, rng=jax.random.key(0),
                              with_reference=True,
                              drafter_params=setup["drafter"] if drafter else None)
  key = (tuple(mesh.devices.shape), config, drafter)
  if key not in _COMPILED:
    _COMPILED[key] = rl.make_train_step(setup["graphdef"], config, mesh, state,
                                        sampling=SAMPLING, drafter=drafter)
  step = _COMPILED[key]
  batch = parallel.shard_batch(setup["batch"], mesh)
  history = []
  for _ in range(steps):
    state, metrics = step(state, batch)
    history.append(jax.tree.map(float, metrics))
  return state, history


@pytest.fixture(scope="module")
def single_device(setup):
  return _one_step(setup, parallel.make_mesh((1, 1, 1), devices=jax.devices()[:1]))


def _assert_relative_close(got, want, tolerance=1e-5):
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    error = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
    assert error <= tolerance, (parallel.path_string(path), error)


# Per-dimension mesh axes of each parameter: FSDP over "fsdp" on the model width, heads
# and MLP hidden (and vocab) over "tensor", norms replicated.
EXPECTED_AXES = {
    "embed": ("tensor", "fsdp"),
    "lm_head": ("fsdp", "tensor"),
    "q_proj": ("fsdp", "tensor", None),
    "k_proj": ("fsdp", "tensor", None),
    "v_proj": ("fsdp", "tensor", None),
    "o_proj": ("tensor", None, "fsdp"),
    "gate_proj": ("fsdp", "tensor"),
    "up_proj": ("fsdp", "tensor"),
    "down_proj": ("tensor", "fsdp"),
    "scale": (None,),
}


def _assert_sharded_as_rules_say(tree, mesh_shape):
  sizes = dict(zip(parallel.AXES, mesh_shape))
  checked = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    name = parallel.path_string(path).split("/")[-1]
    axes = EXPECTED_AXES[name]
    expected = tuple(dim // (sizes[axis] if axis else 1) for dim, axis in zip(leaf.shape, axes))
    assert leaf.addressable_shards[0].data.shape == expected, (parallel.path_string(path),
                                                               mesh_shape)
    checked += 1
  assert checked > 0


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_sharded_step_matches_single_device_step(setup, single_device, mesh_shape):
  want_state, [want] = single_device
  state, [got] = _one_step(setup, parallel.make_mesh(mesh_shape))
  assert abs(got["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"])
  assert abs(got["drafter/loss"] - want["drafter/loss"]) <= 1e-5 * abs(want["drafter/loss"])
  _assert_relative_close(state.params, want_state.params)
  _assert_relative_close(state.drafter_params, want_state.drafter_params)
  _assert_relative_close(state.opt_state, want_state.opt_state)
  # Parameters, both Adam moments, the reference copy and the drafter all follow the rules.
  adam = state.opt_state[1][0]
  for tree in (state.params, adam.mu, adam.nu, state.ref_params, state.drafter_params):
    _assert_sharded_as_rules_say(tree, mesh_shape)
  assert state.step.sharding.is_fully_replicated


def test_step_is_a_real_grpo_update(setup, single_device):
  """Metrics come from the loss of the batch; the KL to the (still equal) reference is
  0 on the first step; drafter metrics arrive; params move."""
  state, [metrics] = single_device
  old = setup["params"]
  assert metrics["kl"] == 0.0 and metrics["clip_fraction"] > 0
  assert metrics["learning_rate"] == pytest.approx(1e-3)
  assert metrics["drafter/tokens"] == pytest.approx(setup["batch"].response_mask.sum() / 2)
  moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), state.params, old)
  assert min(jax.tree.leaves(moved)) > 0
  assert int(state.step) == 1


def test_micro_batching_and_the_drafter_leave_the_policy_update_unchanged(setup,
                                                                          single_device):
  """One full batch without a drafter gives the same policy step as two accumulated
  micro-batches with a drafter: accumulation is exact and the drafter reads detached
  states."""
  want_state, [want] = single_device
  config = dataclasses.replace(CONFIG, num_micro_batches=1)
  mesh = parallel.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  state, [got] = _one_step(setup, mesh, config=config, drafter=None)
  for name in ("loss", "pg_loss", "kl", "clip_fraction", "ratio_mean", "ratio_max",
               "ratio_min", "entropy", "is_weight_mean", "is_capped_fraction", "grad_norm"):
    assert got[name] == pytest.approx(want[name], rel=1e-5, abs=1e-7), name
  _assert_relative_close(state.params, want_state.params)


def test_drafter_loss_is_computed_on_the_policy_hidden_states_and_decreases(setup):
  model = setup["model"]
  out = model.forward(setup["batch"].tokens, hidden_layers=(0,))
  expected, _ = _drafter_loss(setup["drafter"], out, setup["batch"])
  mesh = parallel.make_mesh((2, 2, 2))
  _, history = _one_step(setup, mesh, steps=3)
  assert history[0]["drafter/loss"] == pytest.approx(float(expected), rel=1e-5)
  losses = [m["drafter/loss"] for m in history]
  assert losses[2] < losses[1] < losses[0]


def test_log_prob_step_matches_unsharded_log_probs(setup):
  mesh = parallel.make_mesh((2, 2, 2))
  batch = setup["batch"]
  log_prob_step = rl.make_log_prob_step(setup["graphdef"], mesh, setup["params"],
                                        sampling=SAMPLING)
  got = log_prob_step(setup["params"], batch.tokens, batch.response_mask)
  want = rl.policy_log_probs(setup["model"], batch.tokens, batch.response_mask, SAMPLING)
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)
  assert got.sharding.spec == jax.sharding.PartitionSpec(parallel.BATCH_AXES)


def test_init_from_a_function_builds_each_shard_in_place(setup):
  """The multi-host path: the model is created under jit with the target shardings."""
  mesh = parallel.make_mesh((2, 2, 2))
  state = rl.init_train_state(lambda: nnx.split(sj.Transformer(MODEL, rngs=nnx.Rngs(0)))[1],
                              CONFIG, mesh, rng=jax.random.key(0))
  chex.assert_trees_all_close(jax.tree.map(np.asarray, state.params), setup["params"],
                              rtol=1e-6, atol=1e-8)
  _assert_sharded_as_rules_say(state.params, (2, 2, 2))
  assert state.ref_params is None and state.drafter_params is None


def test_bad_meshes_batches_and_configs_raise_clear_errors(setup):
  with pytest.raises(ConfigError, match=r"product equals the 8 available devices"):
    parallel.make_mesh((2, 2, 1))
  with pytest.raises(ConfigError, match="three positive sizes"):
    parallel.make_mesh((8, 1))
  mesh = parallel.make_mesh((2, 4, 1))
  abstract = jax.eval_shape(lambda: rl.init_train_state(
      setup["params"], CONFIG, mesh, rng=jax.random.key(0), with_reference=True,
      drafter_params=setup["drafter"]))
  step = rl.make_train_step(setup["graphdef"], CONFIG, mesh, abstract, sampling=SAMPLING,
                            drafter=DRAFTER)
  batch = setup["batch"]
  twelve_rows = jax.tree.map(lambda x: x[:12], batch)
  with pytest.raises(ConfigError, match=r"tokens.shape\[0\]=12 .*data-parallel size "
                                        r"data\*fsdp=8"):
    step(abstract, twelve_rows)
  with pytest.raises(ConfigError, match=r"num_micro_batches=2 .*per-replica batch 1"):
    step(abstract, jax.tree.map(lambda x: x[:8], batch))
  with pytest.raises(ConfigError, match=r"advantages.shape"):
    step(abstract, batch.replace(advantages=batch.advantages[:8]))
  with pytest.raises(ConfigError, match="drafter"):
    rl.make_train_step(setup["graphdef"], CONFIG, mesh, abstract, drafter=None)
  with pytest.raises(ConfigError, match="temperature > 0"):
    RolloutConfig(sampling=sj.SamplingParams(temperature=0.0))
  with pytest.raises(ConfigError, match="temperature > 0"):
    rl.make_train_step(setup["graphdef"], CONFIG, mesh, abstract, drafter=DRAFTER,
                       sampling=sj.SamplingParams(temperature=0.0))
  with pytest.raises(ConfigError, match="schedule='exponential'"):
    rl.LearnerConfig(schedule="exponential")
  with pytest.raises(ConfigError, match="aggregation='token-sum'"):
    rl.LearnerConfig(loss=rl.GRPOConfig(aggregation="token-sum"))


def test_schedule_warms_up_linearly_then_decays_by_cosine():
  config = rl.LearnerConfig(learning_rate=1.0, warmup_steps=10, decay_steps=100,
                            final_learning_rate_ratio=0.1)
  schedule = rl.learning_rate_schedule(config)
  cosine_midpoint = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5))
  for step, expected in [(0, 0.0), (5, 0.5), (10, 1.0), (60, cosine_midpoint), (110, 0.1),
                         (500, 0.1)]:
    assert float(schedule(step)) == pytest.approx(expected, rel=1e-6, abs=1e-7), step


def test_optimizer_clips_the_global_norm_and_decays_matrices_only():
  # b1 = b2 = 0 and a huge eps make Adam's step lr * g / (|g| + eps): proportional to
  # the (clipped) gradient, so clipping shows in the update.
  config = rl.LearnerConfig(learning_rate=0.1, schedule="constant", weight_decay=0.5,
                            max_grad_norm=1.0, adam_b1=0.0, adam_b2=0.0, adam_eps=1e3)
  tx = rl.make_optimizer(config)
  params = {"matrix": jnp.ones((2, 2)), "scale": jnp.ones((2,))}
  grads = {"matrix": jnp.zeros((2, 2)), "scale": jnp.full((2,), 300.0)}
  updates, _ = tx.update(grads, tx.init(params), params)
  new = optax.apply_updates(params, updates)
  np.testing.assert_allclose(np.asarray(new["matrix"]), 1 - 0.1 * 0.5, rtol=1e-6)
  clipped = 1 / math.sqrt(2)  # each entry after scaling the norm 300*sqrt(2) down to 1
  np.testing.assert_allclose(np.asarray(new["scale"]), 1 - 0.1 * clipped / (clipped + 1e3),
                             rtol=1e-6)
