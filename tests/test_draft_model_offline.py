"""A draft model distilled offline on the target's own rollouts: the acceptance rate it
would have in speculation (the overlap of its distribution with the target's on the
target's texts) rises, and bad input is refused by name."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specrl_jax as sj
from specrl_jax import testing
from specrl_jax.sampling.warp import warped_log_probs
from specrl_jax.speculative.drafters import training

SAMPLING = sj.SamplingParams(temperature=0.8, max_new_tokens=8)


@pytest.fixture(scope="module")
def data(target):
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 12, rng.integers(1, 5)).tolist() for _ in range(96)]
  return training.rollout_data(target, prompts, sampling=SAMPLING, rng=jax.random.key(0),
                               engine=sj.EngineConfig(page_size=4))


def acceptance(draft, target, data: training.RolloutData) -> float:
  """Mean over response tokens of sum_v min(p, q): the probability that a draft of the
  next token is accepted, both at SAMPLING."""
  tokens = jnp.asarray(data.tokens)
  p = jnp.exp(warped_log_probs(target(tokens)[:, :-1], SAMPLING))
  q = jnp.exp(warped_log_probs(draft(tokens)[:, :-1], SAMPLING))
  overlap = jnp.sum(jnp.minimum(p, q), axis=-1)
  mask = data.response_mask[:, 1:]
  return float(jnp.sum(overlap * mask) / mask.sum())


def test_distilling_on_rollouts_raises_the_acceptance_on_unseen_rollouts(target, data):
  train, held_out = (dataclasses.replace(data, tokens=data.tokens[rows],
                                         response_mask=data.response_mask[rows])
                     for rows in (slice(0, 64), slice(64, None)))
  draft = testing.perturbed_model(target, seed=5, noise=1.5)
  config = training.DrafterTrainingConfig(num_updates=60, batch_size=16, learning_rate=1e-2,
                                          warmup_updates=5)
  distilled, history = training.distill_draft_model(draft, target, train, sampling=SAMPLING,
                                                    config=config)
  assert len(history) == 60
  assert np.mean([h["loss"] for h in history[-10:]]) < history[0]["loss"]
  before, after = acceptance(draft, target, held_out), acceptance(distilled, target, held_out)
  assert after > before + 0.1, (before, after)


def test_a_draft_of_another_vocabulary_or_out_of_range_data_is_refused(target, data):
  other = testing.peaked_random_model(dataclasses.replace(target.config, vocab_size=16), seed=1)
  with pytest.raises(ValueError, match="vocab_size"):
    training.distill_draft_model(other, target, data, sampling=SAMPLING)
  bad = dataclasses.replace(data, tokens=np.where(data.response_mask, 12, data.tokens))
  with pytest.raises(ValueError, match="data.tokens"):
    training.distill_draft_model(testing.perturbed_model(target, seed=5), target, bad,
                                 sampling=SAMPLING)
