"""The in-loop draft-shape controller in sync GRPO: an adaptive RL step is still one
jitted call with no host transfer; the controller's state (acceptance, round costs,
exploration) is carried in the train state from step to step and saved in
checkpoints, so a run restored from one chooses exactly as the uninterrupted run;
rollout log-probs are the learner's; the metrics say which shape ran at which width.
Bad pairings of spec and carried controller are refused before anything compiles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specrl_jax as sj
from specrl_jax import parallel, rl
from specrl_jax.checkpoint import TrainCheckpointManager
from specrl_jax.config import ConfigError
from specrl_jax.rl import tasks
from specrl_jax.rl.loop import online_drafters, rollout, sync
from specrl_jax.rl.loop.shape_calibration import calibrate_rollout, rollout_widths
from specrl_jax.rl.loop.shape_control import with_controller
from specrl_jax.speculative.inloop_rollout import in_loop_config
from conftest import (RL_LEARNER as LEARNER, RL_POLICY as POLICY, RL_PROMPTS as PROMPTS,
                      RL_SAMPLING as SAMPLING, RL_TASK as TASK)

DRAFT = POLICY.replace(num_layers=1)
ROLLOUT = rollout.RolloutConfig(group_size=4, prompts_per_step=4, sampling=SAMPLING)
SPEC = sj.SpecConfig(num_draft_tokens=2, adaptive=True)
# A slot per sample, compacted 8 -> 4 on each of the two batch shards (each width more
# compiles every shape again).
ENGINE = sj.EngineConfig(num_slots=0, compaction=True, compaction_min_width=4)
WIDTHS = (8, 4)
# Round seconds [plain, k1, k2] x widths: drafting costs more the wider the batch.
COST = np.array([[1.0, 1.0], [1.3, 1.1], [1.6, 1.2]], np.float32)


@pytest.fixture(scope="module")
def adaptive():
  mesh = parallel.make_mesh((2, 1, 1), devices=jax.devices()[:2])
  graphdef, params = nnx.split(sj.Transformer(POLICY, rngs=nnx.Rngs(0)))
  online = online_drafters.online_drafter(
      sj.drafters.DraftModel(sj.Transformer(DRAFT, rngs=nnx.Rngs(1))), sampling=SAMPLING)
  state = rl.init_train_state(params, LEARNER, mesh, rng=jax.random.key(0),
                              drafter_params=online.trainable)
  state = with_controller(state, SPEC, COST, mesh)
  program = sync.build_program(graphdef, POLICY, TASK, LEARNER, ROLLOUT, mesh, state,
                               prompt_width=PROMPTS.tokens_PxT.shape[1], online=online,
                               spec=SPEC, engine=ENGINE)
  return program, state


def _inputs(program, step):
  prompts = sync.prompts_on_mesh(PROMPTS.take(tasks.step_indices(16, step, 4, seed=0)),
                                 program.mesh)
  return prompts, jax.device_put(jax.random.fold_in(jax.random.key(0), step), program.replicated)


def _copy(program, state):
  return jax.device_put(jax.tree.map(jnp.copy, state), program.train_step.state_shardings)


def _run(program, state, steps):
  records = []
  for step in steps:
    state, metrics = program.rl_step(state, *_inputs(program, step))
    records.append(sync.to_host(metrics))
  return state, records


@pytest.fixture(scope="module")
def uninterrupted(adaptive):
  program, state = adaptive
  return _run(program, _copy(program, state), range(4))


def test_an_adaptive_rl_step_is_one_jitted_call_that_carries_the_controller(
    adaptive, uninterrupted):
  program, state = adaptive
  final, records = uninterrupted
  assert program.rl_step._cache_size() == 1
  state, _ = program.rl_step(_copy(program, final), *_inputs(program, 4))
  inputs = _inputs(program, 5)
  with jax.transfer_guard("disallow"):
    state, metrics = program.rl_step(state, *inputs)
  assert program.rl_step._cache_size() == 1
  metrics = sync.to_host(metrics)
  labels = in_loop_config(SPEC).labels
  rounds = np.array([metrics[f"inloop_rounds_{label}"] for label in labels])
  # Every round of the step is one of the menu's, at one of the widths.
  assert rounds.shape == (3, len(WIDTHS)) and rounds.sum() == metrics["target_calls"]
  np.testing.assert_allclose([metrics[f"inloop_round_seconds_{label}"] for label in labels],
                             COST)
  assert len(metrics["inloop_shape_by_width"]) == len(WIDTHS)
  assert len(metrics["inloop_acceptance"]) == SPEC.num_draft_tokens
  # The first steps explored every shape at every width the rollouts reached.
  first = records[0]
  ran = np.array([first[f"inloop_rounds_{label}"] for label in labels])
  assert np.all(ran[:, 0] > 0) and sum(first["inloop_exploration_rounds"]) >= 3
  # Carried: the counts keep growing across steps (the train state holds them).
  assert int(state.controller.clock) > int(final.controller.clock) > 0
  assert 0 <= metrics["logprob_mismatch_max"] < 1e-5


def test_a_run_restored_from_a_checkpoint_chooses_as_the_uninterrupted_run(
    adaptive, uninterrupted, tmp_path):
  program, state = adaptive
  whole_state, whole = uninterrupted
  half, first = _run(program, _copy(program, state), range(2))
  with TrainCheckpointManager(tmp_path, async_save=False) as manager:
    manager.save(2, half, force=True)
  # A fresh controller in the target: only the checkpoint's can make the steps agree.
  target = with_controller(_copy(program, state), SPEC, COST, program.mesh)
  with TrainCheckpointManager(tmp_path) as manager:
    restored = manager.restore(target)
  np.testing.assert_array_equal(restored.controller.rounds_SxW, half.controller.rounds_SxW)
  _, second = _run(program, restored, range(2, 4))
  assert first + second == whole
  assert any(sum(r["inloop_exploration_rounds"]) > 0 for r in whole)


def test_an_adaptive_spec_without_a_carried_controller_is_refused_before_compiling(adaptive):
  program, state = adaptive
  bare = state.replace(controller=None)
  graphdef = program.graphdef
  with pytest.raises(ConfigError, match="no controller"):
    sync.build_program(graphdef, POLICY, TASK, LEARNER, ROLLOUT, program.mesh, bare,
                       prompt_width=PROMPTS.tokens_PxT.shape[1], online=program.online,
                       spec=SPEC, engine=ENGINE)
  with pytest.raises(ConfigError, match="not adaptive"):
    sync.build_program(graphdef, POLICY, TASK, LEARNER, ROLLOUT, program.mesh, state,
                       prompt_width=PROMPTS.tokens_PxT.shape[1], online=program.online,
                       spec=sj.SpecConfig(num_draft_tokens=2), engine=ENGINE)


def test_round_costs_are_measured_per_shape_and_width_on_the_rollouts_own_layout(adaptive):
  program, state = adaptive
  kwargs = dict(prompt_width=PROMPTS.tokens_PxT.shape[1], drafter=program.drafter, spec=SPEC,
                engine=ENGINE)
  assert rollout_widths(POLICY, ROLLOUT, program.mesh, **kwargs) == WIDTHS
  calibration = calibrate_rollout(
      program.graphdef, state.compute_params(), program.rollout_drafter_params(state),
      POLICY, ROLLOUT, program.mesh, prompts=PROMPTS.take(range(4)), rng=jax.random.key(3),
      **kwargs)
  assert calibration.widths == WIDTHS and calibration.cost_SxW.shape == COST.shape
  assert np.all(np.isfinite(calibration.cost_SxW)) and np.all(calibration.cost_SxW > 0)
