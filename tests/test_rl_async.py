"""Asynchronous GRPO: rollouts on one device mesh and updates on another, overlapped,
never training on trajectories older than ``max_policy_lag`` updates, with the new
weights pushed to the rollout mesh after every update."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specrl_jax as sj
from specrl_jax import parallel, rl
from specrl_jax.rl.loop import async_pipeline, online_drafters, rollout
from specrl_jax.rl import tasks
from conftest import (RL_LEARNER as LEARNER, RL_POLICY as POLICY, RL_PROMPTS as PROMPTS,
                      RL_SAMPLING as SAMPLING, RL_TASK as TASK)


def _pipeline(rollout_shape, train_shape):
  devices = jax.devices()
  rollout_mesh = parallel.make_mesh(rollout_shape, devices=devices[:2])
  train_mesh = parallel.make_mesh(train_shape, devices=devices[2:4])
  graphdef, params = nnx.split(sj.Transformer(POLICY, rngs=nnx.Rngs(0)))
  online = online_drafters.online_drafter(
      sj.drafters.DraftModel(sj.Transformer(POLICY.replace(num_layers=1), rngs=nnx.Rngs(1))),
      sampling=SAMPLING)
  state = rl.init_train_state(params, LEARNER, train_mesh, rng=jax.random.key(0),
                              drafter_params=online.trainable)
  return async_pipeline.AsyncPipeline(
      graphdef, POLICY, TASK, LEARNER,
      rollout.RolloutConfig(group_size=4, prompts_per_step=4, sampling=SAMPLING),
      rollout_mesh=rollout_mesh, train_mesh=train_mesh, state=state,
      prompt_width=PROMPTS.tokens_PxT.shape[1], max_policy_lag=1, online=online,
      spec=sj.SpecConfig(num_draft_tokens=2)), state


@pytest.fixture(scope="module")
def pipeline():
  return _pipeline((2, 1, 1), (2, 1, 1))


def _run(pipeline, state, lag, updates=5):
  records = list(pipeline.run(
      state, first_update=0, num_updates=updates, max_policy_lag=lag,
      prompts_of=lambda b: PROMPTS.take(tasks.step_indices(16, b, 4, seed=0)),
      rng_of=lambda b: jax.random.fold_in(jax.random.key(0), b)))
  return records


@pytest.mark.parametrize("lag", [1, 2])
def test_no_update_trains_on_trajectories_older_than_the_bound(pipeline, lag):
  pipeline, state = pipeline
  pipeline.trained_on.clear()
  # A fresh copy: each run donates the state it is given.
  state = jax.device_put(jax.tree.map(jnp.copy, state), pipeline.train_step.state_shardings)
  records = _run(pipeline, state, lag)
  lags = [update - version for update, version in pipeline.trained_on]
  assert [update for update, _ in pipeline.trained_on] == list(range(5))
  # The pipeline runs as far ahead as allowed: after warm-up every batch is exactly
  # `lag` updates old, and none is older.
  assert lags == [min(update, lag) for update in range(5)]
  assert [r.metrics["policy_lag"] for r in records] == lags
  assert [r.metrics["policy_version"] for r in records] == [v for _, v in pipeline.trained_on]
  for record in records:
    assert np.isfinite(record.metrics["loss"]) and record.metrics["rewards_finite"]
    assert record.metrics["acceptance_length"] > 1.0
    # Every step measures the training-inference mismatch (here with the lag in it).
    assert 0 <= record.metrics["logprob_mismatch_mean"] <= record.metrics["logprob_mismatch_max"]
    assert np.isfinite(record.metrics["logprob_mismatch_max"])
  assert records[0].metrics["logprob_mismatch_max"] < 1e-4  # lag 0: rounding only
  assert int(records[-1].state.step) == 5


def test_pushed_weights_are_the_train_states_on_the_rollout_devices(pipeline):
  pipeline, state = pipeline
  params, drafter_params = pipeline.push_weights(state)
  chex.assert_trees_all_equal(params, state.params)
  chex.assert_trees_all_equal(drafter_params, state.drafter_params)
  rollout_devices = set(pipeline.rollout_mesh.devices.flat)
  for leaf in jax.tree.leaves((params, drafter_params)):
    assert leaf.sharding.device_set == rollout_devices
    assert leaf.sharding.is_fully_replicated


def test_check_lag_refuses_stale_and_future_trajectories():
  assert async_pipeline.check_lag(7, 5, 2) == 2
  with pytest.raises(async_pipeline.StalePolicyError, match="lag 3"):
    async_pipeline.check_lag(8, 5, 2)
  with pytest.raises(async_pipeline.StalePolicyError, match="lag -1"):
    async_pipeline.check_lag(4, 5, 2)


def test_the_schedule_generates_each_batch_with_the_oldest_allowed_policy():
  assert [async_pipeline.rollout_version(b, 0) for b in range(4)] == [0, 1, 2, 3]
  assert [async_pipeline.rollout_version(b, 2) for b in range(5)] == [0, 0, 0, 1, 2]
  assert [async_pipeline.rollout_version(b, 1, first_version=10) for b in (10, 11, 12)] == [10, 10, 11]


def test_meshes_must_not_share_devices():
  devices = jax.devices()
  mesh = parallel.make_mesh((2, 1, 1), devices=devices[:2])
  with pytest.raises(sj.ConfigError, match="share devices"):
    async_pipeline.AsyncPipeline(None, POLICY, TASK, LEARNER, rollout.RolloutConfig(),
                                 rollout_mesh=mesh, train_mesh=mesh, state=None,
                                 prompt_width=16, max_policy_lag=1)


def test_async_rollouts_split_heads_over_a_tensor_axis():
  """Both meshes (1, 1, 2): the weights pushed to the rollout are split over its tensor
  axis as the train state's are, and the pipeline trains on what they generate."""
  pipeline, state = _pipeline((1, 1, 2), (1, 1, 2))
  params, _ = pipeline.push_weights(state)
  q_proj = params["layers"][0]["attn"]["q_proj"].value
  assert q_proj.sharding.spec[1] == "tensor" and not q_proj.sharding.is_fully_replicated
  assert q_proj.sharding.device_set == set(pipeline.rollout_mesh.devices.flat)
  records = _run(pipeline, state, lag=1, updates=2)
  assert all(np.isfinite(r.metrics["loss"]) for r in records)
  assert records[-1].metrics["acceptance_length"] > 1.0
