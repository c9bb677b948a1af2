"""Concurrency-aware speculation: the draft shape chosen per live width.

What speculation gains depends on how many sequences share a round. A full batch makes
the target's forward compute-bound, so verifying k + 1 tokens per sequence costs nearly
k + 1 plain steps and short chains (or plain decoding) win; the last few sequences of a
long-tailed rollout leave it memory-bound, where a long chain or a tree costs little
more than one plain step. With slot compaction (``sampling.compaction``) a rollout
decodes in power-of-two widths, so the width is a natural key for that choice.

``ConcurrencyAwareController`` keeps, per width, a ``DraftLengthController`` for the
chain lengths (its own round times and exploration) that all share one set of
per-position acceptance counts: acceptance is a property of the drafter and the policy,
not of the batch. Trees (a small menu given up front) are measured, not modelled: their
tokens per drafting slot-round (shared across widths) and their round time per width.
A tree is run when its expected time beats the chain the width's controller chose by
``min_gain``; each width tries every tree once after its chains are explored, and
re-tries a losing tree at doubling intervals, as the chain controller re-probes.

Every choice is a chain or a tree run on the same decode state, so every choice is
lossless; only the speed depends on choosing well.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence, Union

import numpy as np

from specrl_jax.config import MAX_TREE_NODES, check, tree_nodes
from specrl_jax.speculative.adaptive import DraftLengthController
from specrl_jax.speculative.expected import expected_rounds_to_finish, expected_tokens_per_round

# A chain length (0 = plain decoding) or a tree's children per depth.
Shape = Union[int, tuple[int, ...]]


def shape_label(shape: Shape) -> str:
  """'plain', 'chain_k3' or 'tree_2x2x1'."""
  if isinstance(shape, tuple):
    return "tree_" + "x".join(map(str, shape))
  return f"chain_k{shape}" if shape else "plain"


def equivalent_chain_rate(tokens_per_round: float, depth: int) -> float:
  """The constant per-position acceptance of a depth-``depth`` chain that emits
  ``tokens_per_round`` on average: what a tree is modelled as when the batch's end is
  near (``expected_rounds_to_finish`` needs per-position rates)."""
  target = min(max(tokens_per_round, 1.0), depth + 1.0)
  low, high = 0.0, 1.0
  for _ in range(50):  # bisection: tokens per round rises with the rate
    middle = (low + high) / 2
    if expected_tokens_per_round((middle,), depth) < target:
      low = middle
    else:
      high = middle
  return (low + high) / 2


def check_tree_menu(owner: str, trees: tuple, k_max: int) -> None:
  """Refuses a menu tree that is not a tuple of positive children counts, deeper than
  the longest chain, a chain in disguise, too large, or listed twice."""
  for tree in trees:
    check(isinstance(tree, tuple) and len(tree) > 0
          and all(isinstance(b, int) and b >= 1 for b in tree), owner, "trees", tree,
          "a tuple of positive children counts per depth, e.g. (2, 2, 1)")
    check(len(tree) <= k_max, owner, "trees", tree,
          f"a depth of at most k_max={k_max} (the state is built for the longest chain)")
    check(any(b > 1 for b in tree), owner, "trees", tree,
          "a tree that branches somewhere (a chain is already in the menu as its length)")
    check(tree_nodes(tree) <= MAX_TREE_NODES, owner, "trees", tree,
          f"at most {MAX_TREE_NODES} draft nodes")
  check(len(set(trees)) == len(trees), owner, "trees", trees, "distinct trees")


@dataclasses.dataclass
class ConcurrencyAwareController:
  """Host-side controller: ``choose(width, ...)`` before each batch of rounds,
  ``observe(width, ...)`` after.

  chains: the chain controller whose settings every width's copy takes and whose
    acceptance counts they all share (default ``DraftLengthController(k_max)``).
  trees: tree shapes (children per depth) the controller may run besides chains, each
    no deeper than ``k_max`` (the decode state is built for the longest chain).
  per_width: False keeps one chain controller for every width (what passing a plain
    ``DraftLengthController`` to ``generate`` gives).
  """

  k_max: int
  trees: tuple[tuple[int, ...], ...] = ()
  chains: DraftLengthController | None = None
  per_width: bool = True
  history: list[tuple[int, Shape, int]] = dataclasses.field(init=False, default_factory=list)
  _by_width: dict[int, DraftLengthController] = dataclasses.field(
      init=False, repr=False, default_factory=dict)
  # Per tree, faded sums of accepted drafts and of the slot-rounds that drafted.
  _tree_accepted: dict = dataclasses.field(init=False, repr=False, default_factory=dict)
  _tree_drafted: dict = dataclasses.field(init=False, repr=False, default_factory=dict)
  # Per (width, tree), faded sums of timed seconds and of the rounds they covered.
  _tree_seconds: dict = dataclasses.field(init=False, repr=False, default_factory=dict)
  _tree_rounds: dict = dataclasses.field(init=False, repr=False, default_factory=dict)
  # Per width: the last shape chosen, its streak, whether it was a probe, and the
  # tree-probe schedule.
  _last: dict = dataclasses.field(init=False, repr=False, default_factory=dict)
  _probe_interval: dict = dataclasses.field(init=False, repr=False, default_factory=dict)
  _since_probe: dict = dataclasses.field(init=False, repr=False, default_factory=dict)

  def __post_init__(self):
    owner = "ConcurrencyAwareController"
    if self.chains is None:
      self.chains = DraftLengthController(k_max=self.k_max)
    check(self.chains.k_max == self.k_max, owner, "chains.k_max", self.chains.k_max,
          f"equal to k_max={self.k_max}")
    check(isinstance(self.trees, tuple), owner, "trees", self.trees,
          "a tuple of trees, e.g. ((2, 2, 1), (3, 1, 1))")
    check_tree_menu(owner, self.trees, self.k_max)

  # --- what has been measured -------------------------------------------------------

  def chains_at(self, width: int) -> DraftLengthController:
    """The chain controller of ``width``: its own round times and exploration, the
    shared acceptance counts."""
    if not self.per_width:
      return self.chains
    if width not in self._by_width:
      chains = dataclasses.replace(self.chains)
      chains.accepted_Z, chains.reached_Z = self.chains.accepted_Z, self.chains.reached_Z
      self._by_width[width] = chains
    return self._by_width[width]

  def tree_tokens_per_round(self, tree: tuple[int, ...]) -> float | None:
    """Measured tokens per drafting slot-round of ``tree`` (None: never run)."""
    drafted = self._tree_drafted.get(tree, 0.0)
    return 1.0 + self._tree_accepted[tree] / drafted if drafted > 0 else None

  def tree_round_seconds(self, width: int, tree: tuple[int, ...]) -> float | None:
    rounds = self._tree_rounds.get((width, tree), 0.0)
    return self._tree_seconds[(width, tree)] / rounds if rounds > 0 else None

  def round_seconds(self) -> dict[int, dict[str, float]]:
    """Measured seconds per round, per width and shape label."""
    widths = sorted(set(self._by_width) | {w for w, _ in self._tree_seconds}, reverse=True)
    if not self.per_width:
      widths = [None]
    table = {}
    for width in widths:
      row = {shape_label(k): s for k, s in sorted(self.chains_at(width).round_seconds.items())}
      for tree in self.trees:
        seconds = self.tree_round_seconds(width, tree)
        if seconds is not None:
          row[shape_label(tree)] = seconds
      table[width if width is not None else "all"] = row
    return table

  def tree_expected_seconds(self, width: int, tree: tuple[int, ...],
                            remaining_tokens: Sequence[int] | None = None) -> float:
    """Like ``DraftLengthController.expected_seconds``, from the tree's measured tokens
    per round (as a chain of its depth with a constant acceptance near the end)."""
    tokens, seconds = self.tree_tokens_per_round(tree), self.tree_round_seconds(width, tree)
    if remaining_tokens is None:
      return seconds / tokens
    rate = equivalent_chain_rate(tokens, len(tree))
    return expected_rounds_to_finish(remaining_tokens, len(tree), (rate,)) * seconds

  # --- deciding ---------------------------------------------------------------------

  def choose(self, width: int, remaining_tokens: Sequence[int] | None = None) -> Shape:
    """The shape for the next batch of rounds at ``width`` live slots (see
    ``DraftLengthController.choose`` for remaining_tokens)."""
    chains = self.chains_at(width)
    k = chains.choose(remaining_tokens)
    exploring = not {0, 1, self.k_max} <= set(chains.round_seconds)
    if not self.trees or exploring or chains.probing:
      return self._decided(width, k, probe=chains.probing or exploring)
    untimed = [t for t in self.trees if self.tree_round_seconds(width, t) is None
               or self.tree_tokens_per_round(t) is None]
    if untimed:
      return self._decided(width, untimed[0], probe=True)
    if remaining_tokens is not None and not any(r > 0 for r in remaining_tokens):
      remaining_tokens = None
    chain_cost = chains.expected_seconds(k, remaining_tokens)
    costs = {t: self.tree_expected_seconds(width, t, remaining_tokens) for t in self.trees}
    best = min(costs, key=costs.__getitem__)
    if chain_cost >= chains.min_gain * costs[best]:
      self._probe_interval[width] = chains.explore_every
      self._since_probe[width] = 0
      return self._decided(width, best, probe=False)
    # A chain wins. The losing trees' measurements go stale as acceptance and the
    # tail's width change: re-try the best one at doubling intervals.
    self._since_probe[width] = self._since_probe.get(width, 0) + 1
    interval = self._probe_interval.setdefault(width, chains.explore_every)
    if self._since_probe[width] >= interval:
      self._since_probe[width] = 0
      self._probe_interval[width] = 2 * interval
      return self._decided(width, best, probe=True)
    return self._decided(width, k, probe=False)

  def _decided(self, width: int, shape: Shape, *, probe: bool) -> Shape:
    last, streak, _ = self._last.get(width, (None, 0, False))
    self._last[width] = (shape, streak + 1 if shape == last and not probe else 0, probe)
    return shape

  def decision_rounds(self, width: int, base: int) -> int:
    """Rounds to run for the shape just chosen at ``width``: chains as their width's
    controller says; a tree ``base``, doubled for each decision in a row that chose it
    (a probe runs ``base``)."""
    shape, streak, probe = self._last.get(width, (0, 0, False))
    if not isinstance(shape, tuple):
      return self.chains_at(width).decision_rounds(base)
    if probe:
      return base
    return base * min(2 ** streak, self.chains.max_batch_growth)

  def observe(self, width: int, shape: Shape, rounds: int, seconds: float | None,
              accepted_Z: np.ndarray, drafted_slot_rounds: int) -> None:
    """After ``rounds`` rounds of ``shape`` at ``width`` took ``seconds`` (None: not a
    clean timing, e.g. it included compiling); see ``DraftLengthController.observe``."""
    self.history.append((width, shape, rounds))
    if not isinstance(shape, tuple):
      self.chains_at(width).observe(shape, rounds, seconds, accepted_Z, drafted_slot_rounds)
      return
    if rounds <= 0:
      return
    keep = 1 - self.chains.smoothing
    if seconds is not None:
      key = (width, shape)
      self._tree_seconds[key] = keep * self._tree_seconds.get(key, 0.0) + seconds
      self._tree_rounds[key] = keep * self._tree_rounds.get(key, 0.0) + rounds
    if drafted_slot_rounds > 0:
      self._tree_accepted[shape] = (keep * self._tree_accepted.get(shape, 0.0)
                                    + float(np.sum(accepted_Z)))
      self._tree_drafted[shape] = keep * self._tree_drafted.get(shape, 0.0) + drafted_slot_rounds

  def schedule_by_width(self, first: int = 0) -> dict[int, dict[str, int]]:
    """Rounds run per width and shape label, over decisions from ``first`` on."""
    table: dict[int, dict[str, int]] = {}
    for width, shape, rounds in self.history[first:]:
      row = table.setdefault(width, {})
      row[shape_label(shape)] = row.get(shape_label(shape), 0) + rounds
    return dict(sorted(table.items(), reverse=True))
