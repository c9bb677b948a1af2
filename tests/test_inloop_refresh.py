"""The in-loop controller's round costs refreshed from the async rollouts' own time.

With ``refresh_weight`` > 0 the async pipeline times each rollout and, before the next
rollout gets the controller, rescales the table cells the rollout ran
(``speculative.inloop_calibration.refresh``: its seconds beyond the calibration's fixed
part against the table's prediction, one batch shard's share of the rounds). The
refreshed table is the train state's, so a checkpoint holds it; the batches in flight
at a checkpoint keep their measured seconds, so a resumed run refreshes them exactly as
the uninterrupted run did. The first rollout a pipeline dispatches compiles its program
and refreshes nothing. A sync run or a given table refuses a refresh weight."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specrl_jax as sj
from specrl_jax import parallel, rl
from specrl_jax.config import ConfigError
from specrl_jax.rl import tasks
from specrl_jax.rl.app.experiment import experiment_config
from specrl_jax.rl.loop import async_pipeline, online_drafters, rollout
from specrl_jax.rl.loop.shape_control import shape_labels, with_controller
from specrl_jax.speculative.inloop_calibration import refresh
from conftest import (RL_LEARNER as LEARNER, RL_POLICY as POLICY, RL_PROMPTS as PROMPTS,
                      RL_SAMPLING as SAMPLING, RL_TASK as TASK)

SPEC = sj.SpecConfig(num_draft_tokens=2, adaptive=True)
# 8 samples per rollout shard, compacted 8 -> 4 (each width more compiles every shape
# again).
ENGINE = sj.EngineConfig(num_slots=0, compaction=True, compaction_min_width=4)
# A table far off this machine (a second per round): every refresh must pull the cells
# a rollout ran down toward what they cost here.
COST = np.array([[1.0, 1.0], [1.2, 1.1], [1.4, 1.2]], np.float32)
FIXED = 1e-3
WEIGHT = 0.5


@pytest.fixture(scope="module")
def pipeline():
  devices = jax.devices()
  rollout_mesh = parallel.make_mesh((2, 1, 1), devices=devices[:2])
  train_mesh = parallel.make_mesh((2, 1, 1), devices=devices[2:4])
  graphdef, params = nnx.split(sj.Transformer(POLICY, rngs=nnx.Rngs(0)))
  online = online_drafters.online_drafter(
      sj.drafters.DraftModel(sj.Transformer(POLICY.replace(num_layers=1), rngs=nnx.Rngs(1))),
      sampling=SAMPLING)
  state = rl.init_train_state(params, LEARNER, train_mesh, rng=jax.random.key(0),
                              drafter_params=online.trainable)
  state = with_controller(state, SPEC, COST, train_mesh, fixed_seconds=FIXED)
  return async_pipeline.AsyncPipeline(
      graphdef, POLICY, TASK, LEARNER,
      rollout.RolloutConfig(group_size=4, prompts_per_step=4, sampling=SAMPLING),
      rollout_mesh=rollout_mesh, train_mesh=train_mesh, state=state,
      prompt_width=PROMPTS.tokens_PxT.shape[1], max_policy_lag=1, online=online,
      spec=SPEC, engine=ENGINE), state


def _run(pipeline, state, first, updates, *, in_flight=None, keep_at=None):
  """Per update: (the table the rollout chose with, its rounds [S, W], its seconds, the
  table after the update); with keep_at, a copy of that update's state and the batches
  in flight then."""
  out, kept = [], None
  state = _copy(pipeline, state)  # the run donates what it is given
  for record in pipeline.run(
      state, first_update=first, num_updates=updates, in_flight=in_flight,
      prompts_of=lambda b: PROMPTS.take(tasks.step_indices(16, b, 4, seed=0)),
      rng_of=lambda b: jax.random.fold_in(jax.random.key(0), b), refresh_weight=WEIGHT):
    labels = shape_labels(record.state.controller)
    m = record.metrics
    out.append((np.stack([m[f"inloop_round_seconds_{x}"] for x in labels]),
                np.stack([m[f"inloop_rounds_{x}"] for x in labels]), m["rollout_seconds"],
                np.asarray(jax.device_get(record.state.controller.cost_SxW))))
    if record.update == keep_at:  # copied now: the next update donates the state
      kept = (_copy(pipeline, record.state), pipeline.in_flight())
  return out, kept


def _copy(pipeline, state):
  return jax.device_put(jax.tree.map(jnp.copy, state), pipeline.train_step.state_shardings)


def test_each_rollout_refreshes_the_cells_it_ran_from_its_own_seconds(pipeline):
  pipeline, state = pipeline
  steps, _ = _run(pipeline, state, 0, 4)
  # The pipeline's first rollout compiled its program, so its seconds time that too:
  # it refreshes nothing.
  np.testing.assert_array_equal(steps[0][3], steps[0][0])
  for before, rounds_SxW, seconds, after in steps[1:]:
    # One shard's share of the rounds: the two shards decode side by side.
    np.testing.assert_allclose(after, refresh(before, FIXED, rounds_SxW / 2, seconds, WEIGHT),
                               rtol=1e-6)
    np.testing.assert_array_equal(after[rounds_SxW == 0], before[rounds_SxW == 0])
    ran = rounds_SxW > 0
    assert ran.any() and np.all(after[ran] < before[ran])  # seconds a round, not here
  # The batch generated after update 1 (max_policy_lag 1: batch 3) chose with its table.
  np.testing.assert_array_equal(steps[3][0], steps[1][3])


def test_a_resumed_run_refreshes_its_restored_batches_as_the_uninterrupted_run(pipeline):
  pipeline, state = pipeline
  whole, (saved, in_flight) = _run(pipeline, state, 0, 3, keep_at=0)
  assert int(in_flight["count"]) == 1 and float(in_flight["0"]["rollout_seconds"]) > 0
  resumed, _ = _run(pipeline, saved, 1, 2, in_flight=in_flight)
  # Batch 1 was in flight: its recorded seconds refresh the table as before.
  np.testing.assert_array_equal(resumed[0][3], whole[1][3])
  assert resumed[0][2] == whole[1][2]


@pytest.mark.parametrize("overrides, allowed", [
    (["--drafter.adaptive=true", "--drafter.refresh_weight=0.5"], "rl.mode='async'"),
    (["--rl.mode=async", "--drafter.adaptive=true", "--drafter.refresh_weight=0.5",
      "--drafter.round_seconds=1,1,1,1,1"], "a given table stays as given"),
    (["--rl.mode=async", "--drafter.refresh_weight=0.5"], "0 unless adaptive=True"),
    (["--rl.mode=async", "--drafter.adaptive=true", "--drafter.refresh_weight=2"],
     "at most 1"),
])
def test_a_refresh_weight_the_run_cannot_use_is_refused_naming_what_is_allowed(
    overrides, allowed):
  with pytest.raises(ConfigError, match="refresh_weight.*" + allowed.replace("(", r"\(")):
    experiment_config("tiny", overrides)
