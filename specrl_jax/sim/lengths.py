"""Response-length distributions.

Rollout time in synchronous RL is set by the longest responses (the batch drains to a
handful of stragglers), so the tail matters more than the mean. Each distribution
returns a deterministic stratified sample, the quantiles at (i + 0.5) / n, so the
simulator is reproducible and the largest of n draws sits where the tail puts it.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

import numpy as np

from specrl_jax.config import check, check_finite_number, check_positive_int


def _stratified_probabilities(n: int) -> np.ndarray:
  return (np.arange(n, dtype=np.float64) + 0.5) / n


@dataclasses.dataclass(frozen=True, kw_only=True)
class FixedLengths:
  """Every response has the same length (a benchmark without stop tokens)."""

  length: int

  def __post_init__(self):
    check_positive_int("FixedLengths", "length", self.length)

  @property
  def max_length(self) -> int:
    return self.length

  def sample(self, n: int) -> np.ndarray:
    check_positive_int("FixedLengths.sample", "n", n)
    return np.full((n,), self.length, np.int64)

  def mean(self) -> float:
    return float(self.length)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LogNormalLengths:
  """Log-normal lengths truncated at ``max_length``: responses that would run longer
  are cut at the generation limit, as an RL rollout does. ``sigma`` sets the tail:
  0.5 is mild, 1.0 heavy (a few responses 5x the median)."""

  median: float
  sigma: float
  max_length: int
  min_length: int = 1

  def __post_init__(self):
    owner = "LogNormalLengths"
    check_finite_number(owner, "median", self.median, above=0)
    check_finite_number(owner, "sigma", self.sigma, above=0)
    check_positive_int(owner, "max_length", self.max_length)
    check_positive_int(owner, "min_length", self.min_length)
    check(self.min_length <= self.max_length, owner, "min_length", self.min_length,
          f"<= max_length={self.max_length}")

  def sample(self, n: int) -> np.ndarray:
    check_positive_int("LogNormalLengths.sample", "n", n)
    normal = statistics.NormalDist()
    z = np.array([normal.inv_cdf(p) for p in _stratified_probabilities(n)])
    lengths = np.exp(math.log(self.median) + self.sigma * z)
    return np.clip(np.rint(lengths), self.min_length, self.max_length).astype(np.int64)

  def mean(self) -> float:
    return float(self.sample(4096).mean())

  def truncated_fraction(self) -> float:
    """Share of responses cut at max_length."""
    z = (math.log(self.max_length) - math.log(self.median)) / self.sigma
    return 1.0 - statistics.NormalDist().cdf(z)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HistogramLengths:
  """A measured histogram: ``counts[i]`` responses with length in
  [bin_edges[i], bin_edges[i + 1]), uniform within a bin."""

  bin_edges: tuple[float, ...]
  counts: tuple[float, ...]

  def __post_init__(self):
    owner = "HistogramLengths"
    edges, counts = self.bin_edges, self.counts
    check(isinstance(edges, tuple) and len(edges) >= 2 and edges[0] >= 1
          and all(b > a for a, b in zip(edges, edges[1:])), owner, "bin_edges", edges,
          "a tuple of >= 2 strictly increasing lengths starting at >= 1")
    check(isinstance(counts, tuple) and len(counts) == len(edges) - 1, owner, "counts",
          counts, f"a tuple of len(bin_edges) - 1 = {len(edges) - 1} counts")
    check(all(c >= 0 for c in counts) and sum(counts) > 0, owner, "counts", counts,
          "non-negative counts with a positive total")

  @classmethod
  def from_lengths(cls, lengths, *, num_bins: int = 32) -> "HistogramLengths":
    lengths = np.asarray(lengths, np.float64)
    check(lengths.size > 0 and float(lengths.min()) >= 1, "HistogramLengths",
          "lengths", lengths.size, "a non-empty list of lengths >= 1")
    low, high = float(lengths.min()), float(lengths.max())
    # numpy's last bin is closed, so the longest response sits inside it.
    counts, edges = np.histogram(lengths, bins=num_bins, range=(low, max(high, low + 1)))
    return cls(bin_edges=tuple(float(e) for e in edges),
               counts=tuple(float(c) for c in counts))

  @property
  def max_length(self) -> int:
    return int(math.floor(self.bin_edges[-1]))

  def sample(self, n: int) -> np.ndarray:
    check_positive_int("HistogramLengths.sample", "n", n)
    cdf = np.concatenate([[0.0], np.cumsum(self.counts)]) / sum(self.counts)
    lengths = np.interp(_stratified_probabilities(n), cdf, np.asarray(self.bin_edges))
    return np.clip(np.floor(lengths), 1, self.max_length).astype(np.int64)

  def mean(self) -> float:
    return float(self.sample(4096).mean())


LengthDistribution = FixedLengths | LogNormalLengths | HistogramLengths
