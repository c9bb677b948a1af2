"""The draft shape chosen per round inside the compiled RL rollout keeps the rollout
lossless: the RL rollout's samples follow the exactly enumerated joint distribution of
the target while the shape changes between the sampled tokens (every width starts by
trying each shape in turn), with slot compaction and continuous batching (fewer slots
than samples); its log-probs are the target's; greedy decoding through the same round
hook is token-identical to plain decoding, and pinned to a chain it drafts as that
chain's own program."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specrl_jax import drafters, parallel, testing
from specrl_jax.config import ModelConfig, SamplingParams, SpecConfig
from specrl_jax.models import tokenizer
from specrl_jax.rl import tasks
from specrl_jax.rl.loop.rollout import RolloutConfig, make_rollout
from specrl_jax.sampling.engine import EngineConfig
from specrl_jax.speculative.generate import generate
from specrl_jax.sampling.programs import programs_compiled
from specrl_jax.speculative.inloop import InLoopState, fade
from specrl_jax.speculative.inloop_calibration import calibrate
from specrl_jax.speculative.inloop_rollout import generate_in_loop, in_loop_config

VOCAB = tokenizer.VOCAB_SIZE
CONFIG = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64)
TASK = tasks.Arithmetic(min_digits=1, max_digits=1)
MAX_NEW = 5   # with top-k 3 the joint of whole responses is enumerable (3^5)
GROUP, PROMPTS_PER_STEP = 8, 1024   # 8192 samples of one prompt
SPEC = SpecConfig(num_draft_tokens=2, adaptive=True, adaptive_trees=((2, 1),))


@pytest.fixture(scope="module")
def target():
  return testing.peaked_random_model(CONFIG, seed=0)


@pytest.fixture(scope="module")
def noisy_drafter(target):
  return drafters.DraftModel(testing.perturbed_model(target, seed=2, noise=0.3))


def fresh_controller():
  """A controller for SPEC at two widths, every round seconds 1 (plain as dear as any)."""
  config = in_loop_config(SPEC)
  return InLoopState.initial(config, np.ones((len(config.shapes), 2)))


def responses(trajectories, prompt_length: int):
  """(tokens [R, MAX_NEW] with -1 after each end, lengths [R]) of the rollout's rows."""
  rows = np.asarray(trajectories.batch.tokens)
  lengths = np.asarray(trajectories.lengths_R)
  tokens = np.full((rows.shape[0], MAX_NEW), -1, np.int64)
  for r, n in enumerate(lengths):
    tokens[r, :n] = rows[r, prompt_length:prompt_length + n]
  return tokens, lengths


def test_rl_rollout_samples_follow_the_exact_joint_while_the_shape_changes_per_round(
    target, noisy_drafter):
  prompt_set = tasks.make_prompt_set(TASK, 1, seed=0)
  prompt = prompt_set.prompts[0]
  sampling = SamplingParams(temperature=1.0, top_k=3, max_new_tokens=MAX_NEW)
  marginals = testing.marginals_from_joint(
      testing.enumerate_sequence_distribution(target, prompt, sampling, 2), VOCAB)
  stop = int(np.argmax(marginals[0] + marginals[1]))  # ends many responses early
  sampling = dataclasses.replace(sampling, stop_token_ids=(stop,))
  mesh = parallel.make_mesh((1, 1, 1), devices=jax.devices()[:1])
  # 2048 slots for 8192 samples (continuous batching), compacted to 1024 (a third width
  # doubled the compile time, most of this test's).
  engine = EngineConfig(page_size=4, num_slots=2048, compaction=True, compaction_min_width=1024)
  graphdef, params = nnx.split(target)
  rollout = make_rollout(graphdef, CONFIG, TASK,
                         RolloutConfig(group_size=GROUP, prompts_per_step=PROMPTS_PER_STEP,
                                       sampling=sampling),
                         mesh, prompt_width=prompt_set.tokens_PxT.shape[1],
                         drafter=noisy_drafter, spec=SPEC, engine=engine)
  # Plain rounds cost what chains do: drafting wins wherever acceptance is high.
  controller = fresh_controller()
  batch = prompt_set.take([0] * PROMPTS_PER_STEP)
  trajectories = jax.jit(rollout)(params, noisy_drafter.params(), batch, jax.random.key(7),
                                  0, controller)
  rounds_SxW = np.asarray(trajectories.controller.rounds_SxW)
  # The full width's first rounds try every shape in turn, one per round, while its
  # sequences decode (a shape change between their sampled tokens); then the batch
  # narrowed and decoded on.
  assert np.all(rounds_SxW[:, 0] > 0), rounds_SxW
  assert rounds_SxW[:, 1:].sum() > 0, rounds_SxW
  tokens, lengths = responses(trajectories, len(prompt))
  exact = testing.enumerate_sequence_distribution(target, prompt, sampling, MAX_NEW)
  testing.assert_joint_matches(tokens, lengths, exact, name="in-loop adaptive RL rollout")
  testing.assert_per_position_matches(tokens, testing.marginals_from_joint(exact, VOCAB),
                                      name="in-loop adaptive RL rollout")
  rows = np.asarray(trajectories.batch.rollout_logprobs)[:256]
  log_probs = np.stack([rows[r, len(prompt):len(prompt) + MAX_NEW] for r in range(256)])
  expected = testing.response_log_probs(target, [prompt] * 256, tokens[:256], lengths[:256],
                                        sampling)
  np.testing.assert_allclose(np.where(tokens[:256] >= 0, log_probs, 0.0),
                             np.where(tokens[:256] >= 0, expected, 0.0), atol=1e-5)


PROMPTS = [[5], [3, 10, 11], [9, 2, 6, 5], [1, 2, 3, 4, 5, 6, 7, 8],
           [11, 0, 1, 2, 4, 4, 9, 10, 1], [3, 10, 11], [1, 2, 3, 4, 5, 6, 7, 8], [7, 7]]


# Two widths each, (3, 2) and (8, 4): every width compiles every shape again. The
# draft-model case, the carried controller and the calibration share one program.
THREE_SLOTS = EngineConfig(page_size=4, num_slots=3, compaction=True, compaction_min_width=2)
ONE_PER_SAMPLE = EngineConfig(page_size=4, num_slots=0, compaction=True, compaction_min_width=4)


@pytest.fixture(scope="module")
def greedy(target):
  stop = testing.greedy_reference(target, PROMPTS, 12)[0][2]  # ends some early
  return SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(stop,))


@pytest.mark.parametrize("drafter_name,engine", [("draft_model", THREE_SLOTS),
                                                 ("ngram", ONE_PER_SAMPLE)],
                         ids=["draft_model-3", "ngram-0"])
def test_greedy_decoding_through_the_in_loop_hook_is_plain_decoding(
    target, noisy_drafter, greedy, drafter_name, engine):
  drafter = noisy_drafter if drafter_name == "draft_model" else drafters.NGram(n=2)
  plain = generate(target, PROMPTS, sampling=greedy, engine=EngineConfig(page_size=4))
  out, controller = generate_in_loop(
      target, PROMPTS, sampling=greedy, rng=jax.random.key(0), drafter=drafter, spec=SPEC,
      controller=fresh_controller(), engine=engine)
  np.testing.assert_array_equal(out.tokens, plain.tokens)
  np.testing.assert_array_equal(out.lengths, plain.lengths)
  rounds_SxW = np.asarray(controller.rounds_SxW)
  assert rounds_SxW.sum() == out.stats["target_calls"]
  assert np.count_nonzero(rounds_SxW.sum(axis=1)) >= 3  # several shapes ran


def test_pinned_to_a_chain_the_in_loop_hook_drafts_as_that_chains_own_program(
    target, noisy_drafter, greedy):
  """A draft model that catches up before drafting keeps no copy of its prompt's partly
  filled last page at admission (the prompts here end mid-page): it re-feeds those
  tokens, and so drafts, accepts and verifies exactly as the fixed chain."""
  config = in_loop_config(SPEC)
  pinned = fresh_controller().replace(force=jnp.int32(config.labels.index("chain_k2")))
  out, _ = generate_in_loop(target, PROMPTS, sampling=greedy, rng=jax.random.key(0),
                            drafter=noisy_drafter, spec=SPEC, controller=pinned,
                            engine=THREE_SLOTS)
  fixed = generate(target, PROMPTS, sampling=greedy, drafter=noisy_drafter,
                   spec=SpecConfig(num_draft_tokens=2), engine=THREE_SLOTS)
  np.testing.assert_array_equal(out.tokens, fixed.tokens)
  assert out.stats["target_calls"] == fixed.stats["target_calls"]
  np.testing.assert_array_equal(out.stats["per_position_acceptance"],
                                fixed.stats["per_position_acceptance"])
  assert 0 < out.stats["per_position_acceptance"][0] < 1


def test_a_controller_carried_from_call_to_call_reuses_the_compiled_programs(
    target, noisy_drafter, greedy):
  """``generate_in_loop`` hands its controller back as host data; passing that to the
  next call, as a run carries it, compiles nothing new."""
  config, controller = in_loop_config(SPEC), fresh_controller()
  for call in range(3):
    out, after = generate_in_loop(target, PROMPTS, sampling=greedy, rng=jax.random.key(0),
                                  drafter=noisy_drafter, spec=SPEC, controller=controller,
                                  engine=THREE_SLOTS)
    controller = fade(config, controller, after)
    if call == 0:
      compiled = programs_compiled()
  assert programs_compiled() == compiled


def test_calibration_times_every_shape_at_every_width_through_the_same_programs(
    target, noisy_drafter, greedy):
  calibration = calibrate(target, PROMPTS, sampling=greedy, drafter=noisy_drafter,
                          spec=SPEC, engine=THREE_SLOTS, rng=jax.random.key(0))
  assert calibration.widths == (3, 2)
  assert calibration.cost_SxW.shape == (len(in_loop_config(SPEC).shapes), 2)
  assert np.all(np.isfinite(calibration.cost_SxW)) and np.all(calibration.cost_SxW > 0)
  assert calibration.fixed_seconds >= 0
