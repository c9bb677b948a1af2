"""Adaptive draft length: choose k (0 = plain decoding) from what has been measured.

Speculation pays only when the tokens a round emits outweigh what the round costs
over a plain step, and both sides drift: acceptance depends on the prompt and the
policy, round cost on the live batch. The controller keeps, per draft position, how
often a draft there was accepted once reached, and per draft length the measured
seconds per round, and picks the k with the most expected tokens per second (the
``sim.SpeculationCostModel`` arithmetic: 1 + sum_i prod_{j<=i} a_j tokens per round).

Exploration is short, because rollouts are: the first decisions draft the longest
chain (measuring every position's acceptance and the costliest round), then run plain
rounds (the baseline), then the shortest chain. Tokens per round of every length then
follow from the pooled per-position acceptance (a chain of k drafts the same first k
tokens whatever k is), and round times from the line through the measured drafting
lengths, weighted by their rounds (k drafter steps plus a verify of k + 1 tokens:
linear in k; a plain step is not on that line). The best length is run, and measured, from
then on. While plain decoding wins, every ``explore_every``-th decision drafts the
longest chain again (at doubling intervals while plain keeps winning) so that a
drafter that improves (online training) is noticed. While a chain wins, one batch now
and then runs the next longer length instead (after 2, 4, 8, ... decisions, at most
every ``explore_every``-th): a settled length stops measuring the positions past it,
so a choice made on the few rounds of the first exploration would otherwise stand for
good. (Shorter lengths need no such probe: their acceptance is measured by the
winner's rounds and their time by the line.) Plain decoding
that wins narrowly (the best chain within ``close_call`` of it) re-measures that chain
the same way: one noisy timing must not switch speculation off until the next probe.

Each batch of rounds also pays a fixed host cost (dispatch, reading the counters back).
While the same length keeps winning, its batches grow (``decision_rounds``), which pays
that cost less often. Without a queue of waiting requests, the batch ends when its
slowest sequence does: the controller is then given each live sequence's remaining
token budget and minimizes the expected time to finish them all
(``speculative.expected.expected_rounds_to_finish``), where a long draft's last rounds are
partly wasted.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from specrl_jax.config import check
from specrl_jax.speculative.expected import (acceptance_estimates, expected_rounds_to_finish,
                                             expected_tokens_per_round)


@dataclasses.dataclass
class DraftLengthController:
  """Host-side controller; ``choose`` before each batch of rounds, ``observe`` after.

  k_max: the longest chain allowed. min_gain: speculation must beat plain decoding by
  this factor to be chosen (hysteresis against timing noise). close_call: while plain
  decoding wins, a chain predicted within this factor of it is re-measured now and
  then (a neighbour probe) rather than only at the longest-chain probes. smoothing: weight of the
  newest batch of a length among that length's timings and in the acceptance counts
  (later rounds run a smaller tail batch and the drafter may improve, so old
  measurements go stale). max_batch_growth: a length chosen again and again runs in
  batches up to this many times ``rounds_per_decision`` (doubling per repeat).
  """

  k_max: int
  min_gain: float = 1.03
  close_call: float = 1.1
  explore_every: int = 16
  smoothing: float = 0.5
  max_batch_growth: int = 8
  accepted_Z: np.ndarray = dataclasses.field(init=False)
  reached_Z: np.ndarray = dataclasses.field(init=False)
  round_seconds: dict[int, float] = dataclasses.field(init=False, default_factory=dict)
  history: list[tuple[int, int]] = dataclasses.field(init=False, default_factory=list)
  # Per length: faded sums of timed seconds and of the rounds they covered.
  _timed_seconds: dict[int, float] = dataclasses.field(init=False, repr=False,
                                                       default_factory=dict)
  _timed_rounds: dict[int, float] = dataclasses.field(init=False, repr=False,
                                                      default_factory=dict)
  _probe_interval: int = dataclasses.field(init=False, repr=False)
  _since_probe: int = dataclasses.field(init=False, repr=False, default=0)
  _streak: int = dataclasses.field(init=False, repr=False, default=0)
  _last_best: int | None = dataclasses.field(init=False, repr=False, default=None)
  _neighbour_interval: int = dataclasses.field(init=False, repr=False, default=2)
  _since_neighbour: int = dataclasses.field(init=False, repr=False, default=0)
  _probing: bool = dataclasses.field(init=False, repr=False, default=False)

  def __post_init__(self):
    owner = "DraftLengthController"
    check(isinstance(self.k_max, int) and self.k_max >= 1, owner, "k_max", self.k_max,
          "an integer >= 1")
    check(self.min_gain >= 1.0, owner, "min_gain", self.min_gain, "a number >= 1")
    check(self.close_call >= 1.0, owner, "close_call", self.close_call, "a number >= 1")
    check(isinstance(self.explore_every, int) and self.explore_every >= 2, owner,
          "explore_every", self.explore_every, "an integer >= 2")
    check(0 < self.smoothing <= 1, owner, "smoothing", self.smoothing, "in (0, 1]")
    check(isinstance(self.max_batch_growth, int) and self.max_batch_growth >= 1
          and self.max_batch_growth & (self.max_batch_growth - 1) == 0, owner,
          "max_batch_growth", self.max_batch_growth, "a power of two >= 1")
    self._probe_interval = self.explore_every
    self.accepted_Z = np.zeros(self.k_max)
    self.reached_Z = np.zeros(self.k_max)

  def acceptance(self) -> np.ndarray:
    """Conditional acceptance per position (``expected.acceptance_estimates``: position
    0 a Laplace estimate, each deeper one shrunk toward the position before it)."""
    return np.array(acceptance_estimates(self.accepted_Z, self.reached_Z))

  def predicted_round_seconds(self, k: int) -> float:
    """Seconds per round of length k. Drafting rounds (k drafter steps and a verify of
    k + 1 tokens: linear in k) lie on the line fitted to every drafting length's
    measured time, each weighted by the rounds behind it, once two are measured: a
    length measured once, early (a small batch, perhaps a noisy one), is then corrected
    by the many rounds of the lengths run since instead of standing until it is run
    again. Plain rounds are not on that line: their own time, when measured."""
    measured = sorted(self.round_seconds)
    drafting = [m for m in measured if m > 0]
    if k > 0 and len(drafting) >= 2:
      weights = np.sqrt([self._timed_rounds[m] for m in drafting])
      slope, intercept = np.polyfit(drafting, [self.round_seconds[m] for m in drafting], 1,
                                    w=weights)
      return max(float(intercept + slope * k), 1e-9)
    if k in self.round_seconds:
      return self.round_seconds[k]
    if len(measured) == 1:
      return self.round_seconds[measured[0]]
    slope, intercept = np.polyfit(measured, [self.round_seconds[m] for m in measured], 1)
    return max(float(intercept + slope * k), 1e-9)

  def tokens_per_second(self, k: int) -> float:
    tokens = 1.0 if k == 0 else expected_tokens_per_round(tuple(self.acceptance()), k)
    return tokens / self.predicted_round_seconds(k)

  def expected_seconds(self, k: int, remaining_tokens: Sequence[int] | None = None) -> float:
    """Predicted seconds per token of one sequence at length k (steady state: requests
    wait for every slot that frees), or, given each live sequence's remaining token
    budget, to finish them all: the batch runs until its unluckiest sequence is done,
    and a long draft's last rounds are partly wasted on a short remainder."""
    if remaining_tokens is None:
      return 1.0 / self.tokens_per_second(k)
    rounds = expected_rounds_to_finish(remaining_tokens, k, tuple(self.acceptance()))
    return rounds * self.predicted_round_seconds(k)

  def _costs(self, remaining_tokens: Sequence[int] | None) -> dict[int, float]:
    if remaining_tokens is not None and not any(r > 0 for r in remaining_tokens):
      remaining_tokens = None
    return {k: self.expected_seconds(k, remaining_tokens) for k in range(self.k_max + 1)}

  def _best_chain(self, remaining_tokens: Sequence[int] | None
                  ) -> tuple[dict[int, float], int, bool]:
    """(expected cost of every length, the cheapest chain, whether it beats plain
    decoding by ``min_gain``)."""
    cost = self._costs(remaining_tokens)
    chain = min(range(1, self.k_max + 1), key=cost.__getitem__)
    return cost, chain, cost[0] >= self.min_gain * cost[chain]

  def best_length(self, remaining_tokens: Sequence[int] | None = None) -> int:
    """The length with the least expected time by what has been measured so far (0:
    plain decoding, which a chain must beat by ``min_gain``); no exploration."""
    _, chain, wins = self._best_chain(remaining_tokens)
    return chain if wins else 0

  def choose(self, remaining_tokens: Sequence[int] | None = None) -> int:
    """The length for the next batch of rounds. remaining_tokens: the token budget left
    to each live sequence when no request waits for a slot (the batch then ends with
    its slowest sequence); None while requests wait."""
    self._probing = False
    if not self.round_seconds:
      return self.k_max
    if 0 not in self.round_seconds:
      return 0
    if 1 not in self.round_seconds:
      return 1
    cost, chain, wins = self._best_chain(remaining_tokens)
    if wins:
      self._probe_interval = self.explore_every
      self._since_probe = 0
      longer = chain + 1 if chain < self.k_max else None
      return self._neighbour_probe(chain, longer) or self._settle(chain)
    # Plain decoding wins. A close call (the best chain within ``close_call`` of it,
    # e.g. on one noisy timing) re-measures that chain like a neighbour. Otherwise probe
    # the longest chain now and then, half as often after each probe that plain
    # decoding still wins, so that a drafter that stays useless costs ever less.
    self._since_probe += 1
    if self._since_probe < self._probe_interval:
      close = chain if cost[chain] <= self.close_call * cost[0] else None
      return self._neighbour_probe(0, close) or self._settle(0)
    self._since_probe = 0
    self._probe_interval *= 2
    self._streak, self._last_best = 0, None
    return self.k_max

  def _neighbour_probe(self, best: int, neighbour: int | None) -> int | None:
    """``neighbour`` of the winning length, to run once instead when a probe is due
    (None: nothing to probe). A new winner starts over with a short interval, so a
    length chosen low on stale acceptance climbs a step per few decisions. The
    winner's streak (its batch size) is kept: the probe is one batch aside."""
    if best != self._last_best:
      self._neighbour_interval, self._since_neighbour = 2, 0
    self._since_neighbour += 1
    if self._since_neighbour < self._neighbour_interval or neighbour is None:
      return None
    self._since_neighbour = 0
    self._neighbour_interval = min(2 * self._neighbour_interval, self.explore_every)
    self._probing = True
    return neighbour

  def _settle(self, k: int) -> int:
    self._streak = self._streak + 1 if k == self._last_best else 0
    self._last_best = k
    return k

  @property
  def probing(self) -> bool:
    """Whether the last choice was a probe (a neighbour or the longest chain re-measured)
    rather than the length believed best."""
    return self._probing

  def decision_rounds(self, base: int) -> int:
    """Rounds to run for the length just chosen: ``base``, doubled for each decision in
    a row that chose it (exploration and probes run ``base``)."""
    if self._probing:
      return base
    return base * min(2 ** self._streak, self.max_batch_growth)

  def observe(self, k: int, rounds: int, seconds: float | None, accepted_Z: np.ndarray,
              drafted_slot_rounds: int) -> None:
    """After ``rounds`` rounds of length k took ``seconds`` (None: not a clean timing,
    e.g. it included compiling): ``accepted_Z`` counts the accepted drafts at each
    position (summed over slots) and ``drafted_slot_rounds`` the slot-rounds that
    drafted."""
    self.history.append((k, rounds))
    if rounds <= 0:
      return
    if seconds is not None:
      # Seconds over rounds, not a mean of per-round times: a batch cut short by the
      # end of a rollout spreads its fixed dispatch cost over few rounds and counts
      # only as much as its rounds. Older batches fade like the acceptance counts.
      keep = 1 - self.smoothing
      self._timed_seconds[k] = keep * self._timed_seconds.get(k, 0.0) + seconds
      self._timed_rounds[k] = keep * self._timed_rounds.get(k, 0.0) + rounds
      self.round_seconds[k] = self._timed_seconds[k] / self._timed_rounds[k]
    if k == 0 or drafted_slot_rounds <= 0:
      return
    accepted = np.asarray(accepted_Z[:k], np.float64)
    # Position 0 is reached by every drafting slot-round, position i by those that
    # accepted position i - 1.
    reached = np.concatenate([[drafted_slot_rounds], accepted[:-1]])
    # Older counts fade like the round times, so a drafter that improves (online
    # training) or a new phase of the rollout shows within a few decisions.
    keep = 1 - self.smoothing
    self.accepted_Z[:k] = keep * self.accepted_Z[:k] + accepted
    self.reached_Z[:k] = keep * self.reached_Z[:k] + reached
