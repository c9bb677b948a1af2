"""Goodness-of-fit assertions for samplers, in the style serving engines test with.

A sampler is exact when what it emits follows a known distribution. These assertions
compare emitted outcomes with that distribution by Pearson's chi-square: bins whose
expected count is below 5 are merged, and the test fails when the statistic exceeds
``df + 10 * sqrt(2 * df)`` (about seven standard deviations of the null distribution,
so a seeded test essentially never fails by chance while a real bias in tens of
thousands of samples does). An outcome the distribution gives probability 0 fails at
once, whatever its count.

Three levels, weakest first: one categorical (``assert_distribution_matches``), every
position's marginal (``assert_per_position_matches``) and the joint distribution of
whole token sequences (``assert_joint_matches``). Only the joint catches errors in how
one position's token depends on the earlier ones (tree or KV bookkeeping), so exact
samplers should be checked against the joint of a tiny context-dependent model.
"""

from __future__ import annotations

from typing import Hashable, Mapping, Sequence

import chex
import numpy as np

# Bins expected to hold fewer samples than this are merged (the usual rule of thumb
# for the chi-square approximation).
MIN_EXPECTED_COUNT = 5.0
# Probabilities are computed in float32 by the models under test; sums may be off by
# about this much.
_PROBABILITY_SUM_TOLERANCE = 1e-4
ENDED = -1  # the "sequence already ended" outcome of a position (token id -1)

Outcome = tuple[int, ...]


def chi_square_threshold(df: int) -> float:
  """The largest statistic accepted for ``df`` degrees of freedom."""
  return df + 10.0 * np.sqrt(2.0 * df)


def _merge_small_bins(observed_O: np.ndarray, expected_O: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray]:
  """All bins expected below MIN_EXPECTED_COUNT become one bin; if that bin is still
  below it, it joins the smallest remaining bin."""
  small_O = expected_O < MIN_EXPECTED_COUNT
  if not small_O.any():
    return observed_O, expected_O
  observed = observed_O[~small_O]
  expected = expected_O[~small_O]
  merged_observed = observed_O[small_O].sum()
  merged_expected = expected_O[small_O].sum()
  if merged_expected >= MIN_EXPECTED_COUNT or expected.size == 0:
    return np.append(observed, merged_observed), np.append(expected, merged_expected)
  smallest = int(np.argmin(expected))
  observed, expected = observed.copy(), expected.copy()
  observed[smallest] += merged_observed
  expected[smallest] += merged_expected
  return observed, expected


def chi_square(observed_counts: Sequence[float], expected_probs: Sequence[float],
               num_samples: int) -> tuple[float, int]:
  """Pearson's statistic of counts against probabilities, small bins merged.

  Returns (statistic, degrees of freedom = bins after merging - 1).
  """
  observed_O = np.asarray(observed_counts, np.float64).reshape(-1)
  probs_O = np.asarray(expected_probs, np.float64).reshape(-1)
  chex.assert_equal_shape([observed_O, probs_O])
  if num_samples <= 0:
    raise ValueError(f"num_samples={num_samples} must be positive.")
  if np.any(probs_O < 0) or abs(probs_O.sum() - 1.0) > _PROBABILITY_SUM_TOLERANCE:
    raise ValueError(f"expected_probs must be non-negative and sum to 1; they sum to "
                     f"{probs_O.sum():.6g} (min {probs_O.min():.3g}).")
  if observed_O.sum() != num_samples:
    raise ValueError(f"observed_counts sum to {observed_O.sum():g}, not num_samples="
                     f"{num_samples}.")
  observed, expected = _merge_small_bins(observed_O, probs_O / probs_O.sum() * num_samples)
  statistic = float(np.sum((observed - expected) ** 2 / expected))
  return statistic, int(expected.size - 1)


def _describe(outcome: Hashable) -> str:
  if isinstance(outcome, tuple):
    return "(" + ", ".join(str(int(t)) for t in outcome) + ")"
  return str(outcome)


def assert_distribution_matches(samples: Sequence[int], probs: Sequence[float], *,
                                name: str = "",
                                labels: Sequence[Hashable] | None = None) -> None:
  """Asserts that integer ``samples`` in [0, O) were drawn from ``probs`` [O].

  ``labels[i]`` names outcome i in the failure message (default: i).
  """
  samples_N = np.asarray(samples).reshape(-1)
  probs_O = np.asarray(probs, np.float64).reshape(-1)
  label = (lambda i: _describe(labels[i])) if labels is not None else str
  prefix = f"{name}: " if name else ""
  if samples_N.size == 0:
    raise ValueError(f"{prefix}no samples to test.")
  outside = samples_N[(samples_N < 0) | (samples_N >= probs_O.size)]
  if outside.size:
    raise AssertionError(f"{prefix}sampled outcome {int(outside[0])} is outside the "
                         f"{probs_O.size} outcomes [0, {probs_O.size}).")
  counts_O = np.bincount(samples_N.astype(np.int64), minlength=probs_O.size)
  impossible_O = (counts_O > 0) & (probs_O <= 0)
  if impossible_O.any():
    first = int(np.argmax(impossible_O))
    raise AssertionError(
        f"{prefix}outcome {label(first)} has probability 0 but was sampled "
        f"{counts_O[first]} of {samples_N.size} times ({int(impossible_O.sum())} "
        "impossible outcomes sampled in all).")
  statistic, df = chi_square(counts_O, probs_O, samples_N.size)
  threshold = chi_square_threshold(df)
  if statistic > threshold:
    expected_O = probs_O / probs_O.sum() * samples_N.size
    contribution_O = (counts_O - expected_O) ** 2 / np.maximum(expected_O, 1e-300)
    worst = np.argsort(-contribution_O)[:5]
    rows = "\n".join(f"  outcome {label(int(i))}: observed {counts_O[i]}, expected "
                     f"{expected_O[i]:.1f}" for i in worst)
    raise AssertionError(
        f"{prefix}samples do not follow the expected distribution: chi-square "
        f"{statistic:.1f} > {threshold:.1f} (df={df}, {samples_N.size} samples). "
        f"Largest deviations:\n{rows}")


def _position_probs(marginal_V: np.ndarray) -> np.ndarray:
  """The V token probabilities plus the "already ended" outcome's."""
  ended = max(0.0, 1.0 - float(marginal_V.sum()))
  if ended < _PROBABILITY_SUM_TOLERANCE:
    ended = 0.0
  return np.append(marginal_V, ended)


def assert_per_position_matches(tokens_NxL: np.ndarray, marginal_probs_LxV: np.ndarray,
                                *, name: str = "") -> None:
  """Asserts that column t of ``tokens_NxL`` follows ``marginal_probs_LxV[t]``.

  Rows of the marginals may sum to less than 1: the rest is the probability that the
  sequence has already ended, i.e. that the token is -1. Tokens beyond the marginals'
  length are not tested.
  """
  tokens_NxL = np.asarray(tokens_NxL)
  marginal_probs_LxV = np.asarray(marginal_probs_LxV, np.float64)
  chex.assert_rank([tokens_NxL, marginal_probs_LxV], 2)
  length, vocab = marginal_probs_LxV.shape
  if tokens_NxL.shape[1] < length:
    raise ValueError(f"tokens have {tokens_NxL.shape[1]} positions; the marginals "
                     f"describe {length}.")
  for position in range(length):
    column_N = tokens_NxL[:, position]
    outcome_N = np.where(column_N == ENDED, vocab, column_N)
    assert_distribution_matches(
        outcome_N, _position_probs(marginal_probs_LxV[position]),
        name=f"{name + ' ' if name else ''}position {position}",
        labels=list(range(vocab)) + ["<ended>"])


def sequence_outcomes(tokens_NxL: np.ndarray, lengths_N: np.ndarray, length: int
                      ) -> list[Outcome]:
  """Each row's first min(length, lengths_N[n]) tokens as a tuple."""
  tokens_NxL = np.asarray(tokens_NxL)
  lengths_N = np.asarray(lengths_N).reshape(-1)
  chex.assert_rank(tokens_NxL, 2)
  chex.assert_axis_dimension(tokens_NxL, 0, lengths_N.shape[0])
  cut_N = np.minimum(lengths_N, length)
  return [tuple(int(t) for t in row[:cut]) for row, cut in zip(tokens_NxL, cut_N)]


def joint_prefix(exact: Mapping[Outcome, float], length: int) -> dict[Outcome, float]:
  """The joint distribution of the first ``length`` tokens (a marginal of ``exact``)."""
  prefixes: dict[Outcome, float] = {}
  for outcome, prob in exact.items():
    key = outcome[:length]
    prefixes[key] = prefixes.get(key, 0.0) + prob
  return prefixes


def marginals_from_joint(exact: Mapping[Outcome, float], vocab_size: int) -> np.ndarray:
  """Per-position token probabilities [L, V] of a joint over sequences of up to L tokens
  (a shorter sequence contributes "ended" to the later positions)."""
  length = max(len(outcome) for outcome in exact)
  marginals_LxV = np.zeros((length, vocab_size))
  for outcome, prob in exact.items():
    for position, token in enumerate(outcome):
      marginals_LxV[position, token] += prob
  return marginals_LxV


def assert_joint_matches(tokens_NxL: np.ndarray, lengths_N: np.ndarray,
                         exact: Mapping[Outcome, float], *, name: str = "") -> None:
  """Asserts that the rows' first tokens follow the exact joint distribution ``exact``.

  ``exact`` maps each possible outcome (a tuple of the first L token ids, shorter when
  the sequence ends early on a stop token) to its probability, as returned by
  ``enumerate_sequence_distribution``; L is its longest outcome.
  """
  length = max(len(outcome) for outcome in exact)
  if np.asarray(tokens_NxL).shape[1] < length:
    raise ValueError(f"tokens have {np.asarray(tokens_NxL).shape[1]} positions; the exact "
                     f"distribution describes sequences of {length} tokens.")
  labels = list(exact)
  index_of = {outcome: i for i, outcome in enumerate(labels)}
  samples = []
  for outcome in sequence_outcomes(tokens_NxL, lengths_N, length):
    if outcome not in index_of:
      index_of[outcome] = len(labels)
      labels.append(outcome)
    samples.append(index_of[outcome])
  probs = np.asarray([exact.get(outcome, 0.0) for outcome in labels], np.float64)
  assert_distribution_matches(np.asarray(samples), probs,
                              name=f"{name + ' ' if name else ''}joint of {length} tokens",
                              labels=labels)
