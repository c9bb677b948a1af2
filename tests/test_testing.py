"""specrl_jax.testing: the assertions pass on exact samplers and fail on subtly wrong ones.

A statistical test that cannot fail proves nothing, so every assertion here is shown
both ways: exact numpy samplers pass, samplers that are off by a few percent, give
mass to an impossible outcome, or ignore the context of a context-dependent joint fail.
"""

import itertools

import numpy as np
import pytest
import scipy.stats

from specrl_jax import testing
from specrl_jax.config import ModelConfig, SamplingParams

VOCAB = 8


@pytest.fixture(scope="module")
def model():
  config = ModelConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_layers=2,
                       num_heads=2, num_kv_heads=1, head_dim=8)
  return testing.peaked_random_model(config, seed=0)


def peaked_probs(seed: int, size: int) -> np.ndarray:
  """A distribution with a few large and many tiny (< 5 expected) outcomes."""
  weights = np.random.default_rng(seed).dirichlet(np.full(size, 0.3))
  return weights / weights.sum()


def perturbed(probs: np.ndarray, relative: float) -> np.ndarray:
  """probs with alternate outcomes raised / lowered by ``relative``, renormalised."""
  signs = np.where(np.arange(probs.size) % 2 == 0, 1.0, -1.0)
  changed = probs * (1.0 + relative * signs)
  return changed / changed.sum()


# --- chi_square -----------------------------------------------------------------

def test_threshold_is_df_plus_ten_standard_deviations():
  assert testing.chi_square_threshold(8) == pytest.approx(8 + 10 * 4)
  assert testing.chi_square_threshold(0) == 0


def test_small_bins_are_merged_into_one_bin():
  # Expected counts 50, 30, 10, 5, 3, 2: the 3 and 2 bins become one bin of 5.
  statistic, df = testing.chi_square([50, 30, 10, 5, 1, 4], [.5, .3, .1, .05, .03, .02], 100)
  assert df == 4
  assert statistic == pytest.approx(0.0)


def test_a_merged_bin_still_too_small_joins_the_smallest_remaining_bin():
  # Expected 60, 30, 7, 2, 1: the merged 2 + 1 = 3 < 5 joins the 7 -> bins 60, 30, 10.
  statistic, df = testing.chi_square([55, 35, 5, 3, 2], [.6, .3, .07, .02, .01], 100)
  assert df == 2
  assert statistic == pytest.approx(25 / 60 + 25 / 30)


def test_statistic_agrees_with_scipy_when_no_bin_is_small():
  probs = np.array([0.4, 0.3, 0.2, 0.1])
  observed = np.array([430, 280, 190, 100])
  statistic, df = testing.chi_square(observed, probs, 1000)
  expected = scipy.stats.chisquare(observed, probs * 1000)
  assert df == 3
  assert statistic == pytest.approx(expected.statistic)


def test_chi_square_rejects_malformed_inputs():
  with pytest.raises(ValueError, match="sum to 1"):
    testing.chi_square([1, 1], [0.5, 0.6], 2)
  with pytest.raises(ValueError, match="num_samples=3"):
    testing.chi_square([1, 1], [0.5, 0.5], 3)


# --- assert_distribution_matches -----------------------------------------------

@pytest.mark.parametrize("probs", [np.full(16, 1 / 16), peaked_probs(1, 40), np.array([.9, .1])],
                         ids=["uniform", "peaked_with_tiny_tail", "two_outcomes"])
def test_exact_sampler_passes(probs):
  samples = np.random.default_rng(0).choice(probs.size, size=20_000, p=probs)
  testing.assert_distribution_matches(samples, probs)


@pytest.mark.parametrize("relative", [0.03, 0.05])
def test_probabilities_off_by_a_few_percent_fail(relative):
  probs = peaked_probs(2, 12)
  samples = np.random.default_rng(0).choice(probs.size, size=400_000,
                                            p=perturbed(probs, relative))
  with pytest.raises(AssertionError, match=r"chi-square .* > .*Largest deviations"):
    testing.assert_distribution_matches(samples, probs, name="biased")


def test_a_single_zero_probability_outcome_fails_and_is_named():
  probs = np.array([0.5, 0.3, 0.2, 0.0])
  samples = np.random.default_rng(0).choice(4, size=50_000, p=probs)
  samples[123] = 3
  with pytest.raises(AssertionError, match="outcome 3 has probability 0 but was sampled 1 "):
    testing.assert_distribution_matches(samples, probs)


def test_outcomes_outside_the_support_fail():
  with pytest.raises(AssertionError, match="outcome 7 is outside"):
    testing.assert_distribution_matches(np.array([0, 1, 7]), np.array([0.5, 0.5]))


# --- per position and joint -----------------------------------------------------

def two_token_joint(seed: int) -> dict[tuple[int, ...], float]:
  """A context-dependent joint over two tokens of a 6-token vocabulary; token 5 is a
  stop token, so (5,) is a complete outcome."""
  rng = np.random.default_rng(seed)
  first = rng.dirichlet(np.full(6, 1.0))
  joint = {(5,): first[5]}
  for a in range(5):
    second = rng.dirichlet(np.full(6, 0.3))
    joint.update({(a, b): first[a] * second[b] for b in range(6)})
  return joint


def sample_joint(joint, num_samples, seed) -> tuple[np.ndarray, np.ndarray]:
  """Exact samples as (tokens [N, L] with -1 after the end, lengths [N])."""
  outcomes = list(joint)
  probs = np.array([joint[o] for o in outcomes])
  picks = np.random.default_rng(seed).choice(len(outcomes), size=num_samples, p=probs / probs.sum())
  length = max(len(o) for o in outcomes)
  tokens = np.full((num_samples, length), -1)
  lengths = np.zeros(num_samples, int)
  for row, pick in enumerate(picks):
    tokens[row, :len(outcomes[pick])] = outcomes[pick]
    lengths[row] = len(outcomes[pick])
  return tokens, lengths


def test_joint_and_marginals_of_exact_samples_pass():
  joint = two_token_joint(0)
  tokens, lengths = sample_joint(joint, 20_000, seed=1)
  testing.assert_joint_matches(tokens, lengths, joint)
  testing.assert_per_position_matches(tokens, testing.marginals_from_joint(joint, 6))


def test_context_independent_sampler_passes_marginals_but_fails_the_joint():
  # Sampling each position from its marginal gets every per-position test right while
  # breaking the dependence between positions: the blind spot the joint test closes.
  joint = two_token_joint(0)
  tokens, _ = sample_joint(joint, 20_000, seed=1)
  shuffled = tokens.copy()
  continuing = np.flatnonzero(tokens[:, 0] != 5)
  shuffled[continuing, 1] = np.random.default_rng(2).permutation(tokens[continuing, 1])
  lengths = np.where(shuffled[:, 1] >= 0, 2, 1)
  marginals = testing.marginals_from_joint(joint, 6)
  testing.assert_per_position_matches(shuffled, marginals)
  with pytest.raises(AssertionError, match="joint of 2 tokens"):
    testing.assert_joint_matches(shuffled, lengths, joint)


def test_wrong_marginal_at_one_position_fails_naming_that_position():
  joint = two_token_joint(0)
  tokens, _ = sample_joint(joint, 20_000, seed=1)
  marginals = testing.marginals_from_joint(joint, 6)
  likely = int(np.argmax(marginals[1]))
  wrong = tokens.copy()
  # A tenth of the most likely second token's samples become another token.
  moved = (tokens[:, 1] == likely) & (np.arange(len(tokens)) % 10 == 0)
  wrong[moved, 1] = (likely + 1) % 5
  testing.assert_per_position_matches(tokens, marginals)
  with pytest.raises(AssertionError, match="position 1"):
    testing.assert_per_position_matches(wrong, marginals)


def test_continuing_after_a_stop_token_is_an_impossible_outcome():
  joint = two_token_joint(0)
  tokens, lengths = sample_joint(joint, 1000, seed=1)
  stopped = np.flatnonzero(tokens[:, 0] == 5)[0]
  tokens[stopped, 1], lengths[stopped] = 2, 2
  with pytest.raises(AssertionError, match=r"outcome \(5, 2\) has probability 0"):
    testing.assert_joint_matches(tokens, lengths, joint)


def test_joint_prefix_and_marginals_are_consistent():
  joint = two_token_joint(3)
  first = testing.joint_prefix(joint, 1)
  marginals = testing.marginals_from_joint(joint, 6)
  np.testing.assert_allclose([first[(t,)] for t in range(6)], marginals[0])
  assert sum(first.values()) == pytest.approx(1.0)
  # Position 1 misses exactly the mass of sequences that stopped at position 0.
  assert marginals[1].sum() == pytest.approx(1.0 - joint[(5,)])


# --- exact enumeration of a tiny model -------------------------------------------

def test_peaked_random_model_depends_on_more_than_the_last_token(model):
  # Same last token, different token two back: the next-token distributions differ.
  sequences = np.array([[a, 3, 4] for a in range(VOCAB)])
  probs = np.exp(testing.full_forward_log_probs(model, sequences, SamplingParams())[:, -1])
  total_variation = [0.5 * np.abs(probs[a] - probs[b]).sum()
                     for a, b in itertools.combinations(range(VOCAB), 2)]
  assert np.mean(total_variation) > 0.2
  assert probs.max(axis=-1).mean() > 2 / VOCAB  # far from uniform


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.7, stop_token_ids=(2,)),
], ids=["t1", "top_k", "top_p_stop"])
def test_enumeration_is_a_distribution_of_full_forward_products(model, sampling):
  prompt = [1, 5, 3]
  exact = testing.enumerate_sequence_distribution(model, prompt, sampling, 3)
  assert sum(exact.values()) == pytest.approx(1.0, abs=1e-5)
  outcomes = list(exact)
  tokens = np.full((len(outcomes), 3), -1)
  lengths = np.array([len(o) for o in outcomes])
  for row, outcome in enumerate(outcomes):
    tokens[row, :len(outcome)] = outcome
  log_probs = testing.response_log_probs(model, [prompt] * len(outcomes), tokens, lengths,
                                         sampling)
  np.testing.assert_allclose(np.log([exact[o] for o in outcomes]), log_probs.sum(axis=1),
                             atol=1e-4)
  for outcome in outcomes:
    # Only a stop token ends an outcome early, and nothing follows a stop token.
    assert len(outcome) == 3 or outcome[-1] in sampling.stop_token_ids
    assert not set(outcome[:-1]) & set(sampling.stop_token_ids)
  if sampling.top_k:
    assert len(exact) <= sampling.top_k ** 3


def test_greedy_enumeration_is_the_greedy_reference(model):
  exact = testing.enumerate_sequence_distribution(model, [4, 4, 1], SamplingParams(temperature=0),
                                                  4)
  assert list(exact.values()) == [1.0]
  assert list(exact) == [tuple(testing.greedy_reference(model, [[4, 4, 1]], 4)[0])]


def ancestral_samples(model, prompt, sampling, length, num_samples, seed):
  """Plain ancestral sampling with full forwards (tokens with -1 after stops, lengths)."""
  rng = np.random.default_rng(seed)
  tokens = np.full((num_samples, length), -1)
  lengths = np.zeros(num_samples, int)
  alive = np.ones(num_samples, bool)
  for step in range(length):
    sequences = np.concatenate([np.tile(prompt, (num_samples, 1)),
                                np.maximum(tokens[:, :step], 0)], axis=1)
    probs = np.exp(testing.full_forward_log_probs(model, sequences, sampling)[:, -1])
    cumulative = np.cumsum(probs / probs.sum(-1, keepdims=True), axis=-1)
    drawn = np.minimum((rng.random((num_samples, 1)) > cumulative).sum(-1), probs.shape[1] - 1)
    tokens[alive, step] = drawn[alive]
    lengths += alive
    alive &= ~np.isin(drawn, sampling.stop_token_ids)
  return tokens, lengths


def test_ancestral_sampling_matches_enumeration_and_a_wrong_temperature_does_not(model):
  prompt = [1, 5, 3]
  sampling = SamplingParams(temperature=1.0, stop_token_ids=(2,))
  exact = testing.enumerate_sequence_distribution(model, prompt, sampling, 3)
  tokens, lengths = ancestral_samples(model, prompt, sampling, 3, 20_000, seed=0)
  testing.assert_joint_matches(tokens, lengths, exact)
  testing.assert_per_position_matches(tokens, testing.marginals_from_joint(exact, VOCAB))

  hotter = SamplingParams(temperature=1.15, stop_token_ids=(2,))
  tokens, lengths = ancestral_samples(model, prompt, hotter, 3, 20_000, seed=0)
  with pytest.raises(AssertionError, match="joint of 3 tokens"):
    testing.assert_joint_matches(tokens, lengths, exact)
