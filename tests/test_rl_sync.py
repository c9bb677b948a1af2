"""Synchronous GRPO: one RL step (data-parallel speculative rollout -> rewards ->
advantages -> log-probs -> update with the online drafter loss) is one compiled call
with no host round trip, and its trajectories are laid out as the learner expects."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specrl_jax as sj
from specrl_jax import parallel, rl
from specrl_jax.models import tokenizer
from specrl_jax.rl.app import experiment
from specrl_jax.rl.loop import online_drafters, rollout, sync
from specrl_jax.rl import tasks
from conftest import (RL_LEARNER as LEARNER, RL_POLICY as POLICY, RL_PROMPTS as PROMPTS,
                      RL_SAMPLING as SAMPLING, RL_TASK as TASK)

DRAFT = POLICY.replace(num_layers=1)
ROLLOUT = rollout.RolloutConfig(group_size=4, prompts_per_step=4, sampling=SAMPLING)


def _program(mesh, task=TASK):
  graphdef, params = nnx.split(sj.Transformer(POLICY, rngs=nnx.Rngs(0)))
  online = online_drafters.online_drafter(
      sj.drafters.DraftModel(sj.Transformer(DRAFT, rngs=nnx.Rngs(1))), sampling=SAMPLING)
  state = rl.init_train_state(params, LEARNER, mesh, rng=jax.random.key(0),
                              drafter_params=online.trainable)
  program = sync.build_program(graphdef, POLICY, task, LEARNER, ROLLOUT, mesh, state,
                               prompt_width=PROMPTS.tokens_PxT.shape[1], online=online,
                               spec=sj.SpecConfig(num_draft_tokens=3))
  return program, state


def _inputs(program, step):
  prompts = sync.prompts_on_mesh(PROMPTS.take(tasks.step_indices(16, step, 4, seed=0)),
                                 program.mesh)
  return prompts, jax.device_put(jax.random.fold_in(jax.random.key(0), step), program.replicated)


def _copy(program, state):
  """A copy laid out like the step's input (the step donates its state)."""
  return jax.device_put(jax.tree.map(jnp.copy, state), program.train_step.state_shardings)


@pytest.fixture(scope="module")
def speculative():
  """A data-parallel program: 2 x 2 batch shards, each decoding its own prompt's group."""
  mesh = parallel.make_mesh((2, 2, 1), devices=jax.devices()[:4])
  return _program(mesh)


def test_one_rl_step_is_one_jitted_call_with_no_host_transfer(speculative):
  program, state = speculative
  state = _copy(program, state)
  state, _ = program.rl_step(state, *_inputs(program, 0))  # compiles
  inputs = _inputs(program, 1)
  drafter_before = jax.tree.map(np.asarray, state.drafter_params)
  with jax.transfer_guard("disallow"):
    state, metrics = program.rl_step(state, *inputs)
  assert program.rl_step._cache_size() == 1
  metrics = sync.to_host(metrics)
  assert int(state.step) == 2 and metrics["policy_version"] == 1
  assert np.isfinite(metrics["loss"]) and metrics["rewards_finite"]
  assert metrics["acceptance_length"] > 1.0 and metrics["target_calls"] > 0
  assert 0 < metrics["slot_utilization"] <= 1
  assert len(metrics["per_position_acceptance"]) == 3
  assert metrics["generated_tokens"] >= ROLLOUT.group_size * ROLLOUT.prompts_per_step
  # The training-inference mismatch of a float32 on-policy step: rounding only.
  assert 0 <= metrics["logprob_mismatch_mean"] <= metrics["logprob_mismatch_max"] < 1e-4
  assert 1 <= metrics["token_mult_prob_error"] < 1 + 1e-4
  # The online drafter loss moved the drafter the next rollout drafts with (the policy
  # moves only when a group's rewards differ, which a random policy rarely manages).
  assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(drafter_before),
                                                      jax.tree.leaves(state.drafter_params)))


def test_trajectories_hold_groups_with_their_rewards_and_advantages(speculative):
  program, state = speculative
  prompts, rng = _inputs(program, 5)
  trajectories = program.rollout_jit(state, prompts, rng)
  assert trajectories.batch.advantages is None and trajectories.batch.old_logprobs is None
  # The learner sets advantages (and its own log-probs) from the rollout's rewards.
  batch = jax.device_get(program.learn.batch(trajectories, trajectories.batch.rollout_logprobs))
  trajectories, group = jax.device_get(trajectories), ROLLOUT.group_size
  rows = np.asarray(batch.tokens)
  lengths = np.asarray(trajectories.lengths_R)
  for row in range(rows.shape[0]):
    prompt = int(prompts.lengths_P[row // group])
    np.testing.assert_array_equal(rows[row, :prompt], prompts.tokens_PxT[row // group, :prompt])
    mask = np.asarray(batch.response_mask[row])
    assert mask.sum() == lengths[row] and mask[prompt:prompt + lengths[row]].all()
    assert np.all(np.asarray(batch.rollout_logprobs[row])[mask] <= 0)
  rewards = np.asarray(trajectories.rewards_R).reshape(-1, group)
  advantages = np.asarray(batch.advantages).reshape(-1, group)
  expected = (rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, keepdims=True) + 1e-6)
  np.testing.assert_allclose(advantages, expected, atol=1e-5)


def test_build_rows_places_the_response_right_after_each_prompt():
  tokens, mask, log_probs = rollout.build_rows(
      jnp.asarray([[1, 5, 6, 0], [1, 7, 0, 0]]), jnp.asarray([3, 2]),
      jnp.asarray([[9, 2, -1], [8, 8, 2]]), jnp.asarray([2, 3]),
      jnp.asarray([[-0.5, -0.25, 0.0], [-1.0, -2.0, -3.0]]))
  np.testing.assert_array_equal(tokens, [[1, 5, 6, 9, 2, 0, 0], [1, 7, 8, 8, 2, 0, 0]])
  np.testing.assert_array_equal(mask, [[0, 0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0, 0]])
  np.testing.assert_allclose(log_probs, [[0, 0, 0, -0.5, -0.25, 0, 0], [0, 0, -1, -2, -3, 0, 0]])


def test_the_rollout_gives_every_sample_its_own_slot(speculative):
  """EngineConfig(num_slots=0) means a slot per request, and in a rollout a request is
  a sample: each of the 4 shards decodes its prompt's 4 samples side by side."""
  program, state = speculative
  prompts, rng = _inputs(program, 3)
  metrics = sync.to_host(rollout.rollout_metrics(program.rollout_jit(state, prompts, rng),
                                              SAMPLING.max_new_tokens))
  assert metrics["rollout_slots"] == ROLLOUT.prompts_per_step * ROLLOUT.group_size


def test_a_tensor_parallel_rollout_samples_what_one_device_samples():
  """Weights and KV heads split two ways change where the arithmetic runs, not the
  trajectories; a host (Python) reward scores them outside the decode loop's partly
  automatic region; the one-jit step trains on them."""
  one, one_state = _program(parallel.make_mesh((1, 1, 1), devices=jax.devices()[:1]))
  hosted = tasks.PythonRewardTask(task=TASK, fn=tasks.arithmetic_answer_checker)
  two, two_state = _program(parallel.make_mesh((1, 1, 2), devices=jax.devices()[:2]),
                            task=hosted)
  expected = jax.device_get(one.rollout_jit(one_state, *_inputs(one, 0)))
  got = jax.device_get(two.rollout_jit(two_state, *_inputs(two, 0)))
  np.testing.assert_array_equal(got.batch.tokens, expected.batch.tokens)
  np.testing.assert_array_equal(got.rewards_R, expected.rewards_R)
  np.testing.assert_allclose(got.batch.rollout_logprobs, expected.batch.rollout_logprobs,
                             atol=1e-5)
  assert two_state.params["layers"][0]["attn"]["q_proj"].value.sharding.spec[1] == "tensor"
  state, metrics = two.rl_step(_copy(two, two_state), *_inputs(two, 1))
  assert np.isfinite(sync.to_host(metrics)["loss"]) and int(state.step) == 1


def test_heads_split_over_tensor_beside_batch_shards_sample_what_the_batch_shards_alone_do():
  """On a (2, 2, 2) mesh each batch shard decodes with its weights and KV heads split
  over its tensor pair: the same trajectories and (host-scored) rewards as the
  (2, 2, 1) mesh's."""
  whole, whole_state = _program(parallel.make_mesh((2, 2, 1), devices=jax.devices()[:4]))
  hosted = tasks.PythonRewardTask(task=TASK, fn=tasks.arithmetic_answer_checker)
  split, split_state = _program(parallel.make_mesh((2, 2, 2)), task=hosted)
  expected = jax.device_get(whole.rollout_jit(whole_state, *_inputs(whole, 0)))
  got = jax.device_get(split.rollout_jit(split_state, *_inputs(split, 0)))
  np.testing.assert_array_equal(got.batch.tokens, expected.batch.tokens)
  np.testing.assert_allclose(got.batch.rollout_logprobs, expected.batch.rollout_logprobs,
                             atol=1e-5)
  np.testing.assert_array_equal(got.rewards_R, expected.rewards_R)
  assert split_state.params["layers"][0]["attn"]["q_proj"][...].sharding.spec[1] == "tensor"


def _budget_for_slots(num_slots: int) -> int:
  """Bytes per device that hold the policy's float32 weights, the trash page, the
  step's prompts' pages and ``num_slots`` whole sequences, in pages of 16 tokens."""
  page_bytes = 2 * POLICY.num_kv_heads * 16 * POLICY.head_dim * 4 * POLICY.num_layers
  width = -(-PROMPTS.tokens_PxT.shape[1] // 16) * 16
  sequence_pages = -(-(width + SAMPLING.max_new_tokens + 1) // 16)
  prompt_pages = ROLLOUT.prompts_per_step * (width // 16)
  pages = 1 + prompt_pages + num_slots * sequence_pages
  return POLICY.num_params() * 4 + pages * page_bytes


def test_a_memory_budget_sizes_the_rollouts_slots_and_refuses_what_cannot_fit():
  """With num_slots=0 the rollout decodes as many samples at once as the budget holds
  (3 of 16 here, the rest queued), and a slot count past it is refused when the
  program is built, before anything compiles."""
  mesh = parallel.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  graphdef, params = nnx.split(sj.Transformer(POLICY, rngs=nnx.Rngs(0)))
  state = rl.init_train_state(params, LEARNER, mesh, rng=jax.random.key(0))

  def build(**engine):
    return sync.build_program(graphdef, POLICY, TASK, LEARNER, ROLLOUT, mesh, state,
                              prompt_width=PROMPTS.tokens_PxT.shape[1],
                              engine=sj.EngineConfig(**engine))

  with pytest.raises(sj.MemoryBudgetError, match="At most 3 sequences"):
    build(num_slots=4, memory_budget_bytes=_budget_for_slots(3))
  program = build(num_slots=0, memory_budget_bytes=_budget_for_slots(3))
  trajectories = program.rollout_jit(state, *_inputs(program, 0))
  metrics = sync.to_host(rollout.rollout_metrics(trajectories, SAMPLING.max_new_tokens))
  assert metrics["rollout_slots"] == 3
  assert not metrics["pool_exhausted"]
  assert np.all(np.asarray(trajectories.lengths_R) > 0)


def test_the_rl_config_passes_its_memory_budget_to_the_engine():
  config = experiment.experiment_config("tiny", ["--rl.engine.memory_budget_bytes=123456789",
                                                    "--rl.engine.num_slots=0"])
  assert config.rl.engine == sj.EngineConfig(num_slots=0, memory_budget_bytes=123456789)
  with pytest.raises(sj.ConfigError, match="memory_fraction"):
    experiment.experiment_config("tiny", ["--rl.engine.memory_fraction=1.5"])


def test_a_compacting_rollout_counts_its_rounds_per_width_and_its_tail():
  """With slot compaction the rollout's last samples decode in narrower programs: the
  rounds per width add up to the target calls, slot-rounds count each round at its
  width (fewer than at full width), and the tail's share of rounds is reported."""
  mesh = parallel.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  graphdef, params = nnx.split(sj.Transformer(POLICY, rngs=nnx.Rngs(0)))
  state = rl.init_train_state(params, LEARNER, mesh, rng=jax.random.key(0))
  config = experiment.experiment_config("tiny", ["--rl.engine.num_slots=0",
                                                    "--rl.engine.compaction=true"])
  # The untrained policy rarely emits EOS: a quarter of the vocabulary ends a response,
  # so lengths are ragged and the live samples thin out.
  stops = tuple(range(2, 2 + tokenizer.VOCAB_SIZE // 4))
  ragged = rollout.RolloutConfig(group_size=4, prompts_per_step=4, sampling=sj.SamplingParams(
      temperature=1.0, max_new_tokens=SAMPLING.max_new_tokens, stop_token_ids=stops))
  program = sync.build_program(graphdef, POLICY, TASK, LEARNER, ragged, mesh, state,
                               prompt_width=PROMPTS.tokens_PxT.shape[1],
                               engine=config.rl.engine)
  trajectories = program.rollout_jit(state, *_inputs(program, 0))
  metrics = sync.to_host(rollout.rollout_metrics(trajectories, SAMPLING.max_new_tokens))
  slots = ROLLOUT.prompts_per_step * ROLLOUT.group_size
  assert metrics["rollout_slots"] == slots
  by_width = metrics["rounds_by_width"]
  assert len(by_width) == 5 and sum(by_width) == metrics["target_calls"]  # 16, 8, 4, 2, 1
  assert sum(by_width[1:]) > 0, by_width  # responses ended at different rounds
  assert sum(metrics["tokens_by_width"]) == metrics["generated_tokens"]
  assert metrics["slot_utilization"] > (
      metrics["generated_tokens"] - slots) / (metrics["target_calls"] * slots)
  assert 0 < metrics["tail_round_share"] <= 1
  assert not metrics["pool_exhausted"]
