"""The draft shape chosen per round inside the compiled decode loop.

``ConcurrencyAwareController`` (``speculative.concurrency``) chooses between batches of
rounds on the host; an RL step is one compiled program, so here the same decision rule
runs traced, once per round: a small menu (plain decoding, chains of k = 1..K drafts,
at most two trees) shares one decode state built for the longest chain, and the decode
loop runs the chosen shape's round on it (``speculative.inloop_hook``: one inner loop
per run of rounds of a shape, so the page pool is not copied every round). Plain rounds
count nothing the rule reads, so a run of them asks it once (``plain_streak``) and
settles its bookkeeping after (``settle_plain``). Every shape's round is lossless on
the same state, so the output's distribution never depends on the choice.

The rule is the host controller's arithmetic: a chain of k drafts emits
1 + sum_{i<k} prod_{j<=i} a_j tokens per round from the per-position acceptance a
(``speculative.expected.expected_tokens_per_round``; position 0 a Laplace estimate,
each deeper one shrunk toward the one before it, ``expected.acceptance_estimates``), a
tree its measured tokens per drafting slot-round; each shape's expected tokens over its
round's seconds at the live width is its rate, and a drafting shape must beat plain
decoding by ``min_gain``. Round seconds per (shape, width) are measured
(``speculative.inloop_calibration``), never modelled: ``InLoopState.cost_SxW`` is an
input array. Exploration is the host controller's: each shape runs once at each width
before any choice, and a losing shape is re-tried at doubling intervals (the one that
ran longest ago), so an online drafter that improves is noticed.

``InLoopState`` is carried across RL steps (train state and checkpoints) so a resumed
run chooses exactly as the uninterrupted one. Shape glossary: S menu shapes, W widths
of slot compaction (widest first), K the longest chain, T trees.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specrl_jax.config import check, is_finite_number
from specrl_jax.speculative.concurrency import Shape, check_tree_menu, shape_label
from specrl_jax.speculative.expected import acceptance_estimates

Array = jax.Array
MAX_TREES = 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class InLoopConfig:
  """The in-loop controller's settings (static: part of the compiled program).

  k_max: the longest chain (the menu is plain, chains 1..k_max, then ``trees``).
  trees: at most two trees (children per depth), each no deeper than k_max.
  min_gain: a drafting shape must beat plain decoding's rate by this factor.
  explore_every: rounds at a width between re-tries of a losing shape at first; the
    interval doubles after each re-try while the same shape keeps winning.
  smoothing: at the end of each rollout, the weight of that rollout's acceptance counts
    among the carried ones (older rollouts fade, as the drafter and policy change).
  """
  k_max: int
  trees: tuple[tuple[int, ...], ...] = ()
  min_gain: float = 1.03
  explore_every: int = 16
  smoothing: float = 0.5

  def __post_init__(self):
    owner = "InLoopConfig"
    check(isinstance(self.k_max, int) and self.k_max >= 1, owner, "k_max", self.k_max,
          "an integer >= 1")
    check(isinstance(self.trees, tuple) and len(self.trees) <= MAX_TREES, owner, "trees",
          self.trees, f"a tuple of at most {MAX_TREES} trees, e.g. ((2, 2, 1),)")
    check_tree_menu(owner, self.trees, self.k_max)
    check(self.min_gain >= 1.0, owner, "min_gain", self.min_gain, "a number >= 1")
    check(isinstance(self.explore_every, int) and self.explore_every >= 1, owner,
          "explore_every", self.explore_every, "an integer >= 1")
    check(0 < self.smoothing <= 1, owner, "smoothing", self.smoothing, "in (0, 1]")

  @property
  def shapes(self) -> tuple[Shape, ...]:
    """The menu: 0 (plain), 1..k_max (chains), then the trees."""
    return tuple(range(self.k_max + 1)) + self.trees

  @property
  def labels(self) -> tuple[str, ...]:
    return tuple(shape_label(s) for s in self.shapes)

  def exploration_order(self) -> np.ndarray:
    """Which untried shape runs first: the longest chain (it measures every
    position's acceptance), the trees, plain decoding, then the shorter chains."""
    k, trees = self.k_max, len(self.trees)
    return np.array([k] + [k + 1 + t for t in range(trees)] + [0] + list(range(1, k)),
                    np.int32)


@flax.struct.dataclass
class InLoopState:
  """What the in-loop controller has measured and decided (device arrays).

  accepted_Z / reached_Z: faded counts, per chain position, of accepted drafts and of
    drafts reached (position i is reached by the rounds that accepted i - 1);
  tree_accepted_T / tree_drafted_T: per tree, faded accepted drafts and drafting
    slot-rounds (one unused entry when the menu has no tree);
  cost_SxW: measured seconds per round of each shape at each width;
  fixed_seconds: what a rollout spent outside its rounds when the table was measured
    (prefill, dispatch): left out when a rollout's own time refreshes the table;
  rounds_SxW: rounds each shape ran at each width, over the run; probes_W: of those,
    the exploration rounds; last_SxW: the round clock when the shape last ran there
    (-1: never); since_probe_W / interval_W / best_W: the re-try schedule of each
    width and the shape that won there last; clock: rounds decided so far;
  force: >= 0 runs that shape every round (calibration), -1 chooses.
  """
  accepted_Z: Array
  reached_Z: Array
  tree_accepted_T: Array
  tree_drafted_T: Array
  cost_SxW: Array
  fixed_seconds: Array
  rounds_SxW: Array
  probes_W: Array
  last_SxW: Array
  since_probe_W: Array
  interval_W: Array
  best_W: Array
  clock: Array
  force: Array

  @classmethod
  def initial(cls, config: InLoopConfig, cost_SxW, fixed_seconds: float = 0.0) -> "InLoopState":
    cost_SxW = np.asarray(cost_SxW, np.float32)
    shapes = len(config.shapes)
    check(cost_SxW.ndim == 2 and cost_SxW.shape[0] == shapes, "InLoopState", "cost_SxW",
          cost_SxW.shape, f"seconds per round shaped [{shapes} shapes, widths]")
    check(bool(np.all(np.isfinite(cost_SxW)) and np.all(cost_SxW > 0)), "InLoopState",
          "cost_SxW", cost_SxW.tolist(), "finite positive seconds per round")
    check(is_finite_number(fixed_seconds) and fixed_seconds >= 0, "InLoopState",
          "fixed_seconds", fixed_seconds, "finite seconds >= 0")
    widths = cost_SxW.shape[1]
    # One tree slot even without trees: checkpoints cannot hold zero-size arrays.
    k, trees = config.k_max, max(len(config.trees), 1)
    # A fresh array per field: a train state donated to its step may not hold one buffer
    # twice.
    zeros_W = lambda: jnp.zeros((widths,), jnp.int32)
    return cls(accepted_Z=jnp.zeros((k,), jnp.float32), reached_Z=jnp.zeros((k,), jnp.float32),
               tree_accepted_T=jnp.zeros((trees,), jnp.float32),
               tree_drafted_T=jnp.zeros((trees,), jnp.float32),
               cost_SxW=jnp.asarray(cost_SxW), fixed_seconds=jnp.float32(fixed_seconds),
               rounds_SxW=jnp.zeros((shapes, widths), jnp.int32),
               probes_W=zeros_W(), last_SxW=jnp.full((shapes, widths), -1, jnp.int32),
               since_probe_W=zeros_W(), interval_W=zeros_W() + config.explore_every,
               best_W=zeros_W(), clock=jnp.int32(0), force=jnp.int32(-1))


def acceptance_rates(accepted_Z: Array, reached_Z: Array) -> Array:
  """Per-position conditional acceptance (``expected.acceptance_estimates``, as the
  host controller's ``DraftLengthController.acceptance``)."""
  return jnp.stack(acceptance_estimates(accepted_Z, reached_Z))


def expected_tokens_S(config: InLoopConfig, state: InLoopState) -> Array:
  """Expected tokens per round of every shape: chains from the per-position rates, a
  tree from its measured tokens per drafting slot-round (before it has run, as a chain
  of its depth)."""
  rates_Z = acceptance_rates(state.accepted_Z, state.reached_Z)
  chains_K = 1.0 + jnp.cumsum(jnp.cumprod(rates_Z))
  trees = [jnp.where(state.tree_drafted_T[t] > 0,
                     1.0 + state.tree_accepted_T[t] / jnp.maximum(state.tree_drafted_T[t], 1e-9),
                     chains_K[len(tree) - 1]) for t, tree in enumerate(config.trees)]
  return jnp.concatenate([jnp.ones((1,)), chains_K, jnp.asarray(trees, jnp.float32).reshape(-1)])


def best_shape(config: InLoopConfig, state: InLoopState, width: int) -> Array:
  """The shape with the highest expected tokens per second at width index ``width``
  (plain decoding's rate counted ``min_gain`` times: drafting must beat it by that)."""
  rate_S = expected_tokens_S(config, state) / state.cost_SxW[:, width]
  rate_S = rate_S.at[0].multiply(config.min_gain)
  return jnp.argmax(rate_S).astype(jnp.int32)


def choose(config: InLoopConfig, state: InLoopState, width: int
           ) -> tuple[Array, Array, InLoopState]:
  """(shape index, whether it explores, the state with the re-try schedule advanced)
  for the next round at width index ``width`` (static)."""
  order = jnp.asarray(config.exploration_order())
  untried_S = state.rounds_SxW[:, width] == 0
  any_untried = jnp.any(untried_S)
  first_untried = order[jnp.argmax(untried_S[order])]
  best = best_shape(config, state, width)
  changed = best != state.best_W[width]
  interval = jnp.where(changed, config.explore_every, state.interval_W[width])
  since = jnp.where(changed, 0, state.since_probe_W[width]) + 1
  retry = ~any_untried & (since >= interval)
  # The losing shape that ran longest ago at this width.
  last_S = state.last_SxW[:, width].at[best].set(jnp.iinfo(jnp.int32).max)
  stale = jnp.argmin(last_S).astype(jnp.int32)
  shape = jnp.where(any_untried, first_untried, jnp.where(retry, stale, best))
  forced = state.force >= 0
  shape = jnp.where(forced, state.force, shape).astype(jnp.int32)
  explores = (any_untried | retry) & ~forced
  state = state.replace(
      best_W=jnp.where(any_untried | forced, state.best_W, state.best_W.at[width].set(best)),
      since_probe_W=state.since_probe_W.at[width].set(
          jnp.where(any_untried | forced, state.since_probe_W[width], jnp.where(retry, 0, since))),
      interval_W=state.interval_W.at[width].set(
          jnp.where(any_untried | forced, state.interval_W[width],
                    jnp.where(retry, 2 * interval, interval))))
  return shape, explores, state


def observe(config: InLoopConfig, state: InLoopState, width: int, shape: Array,
            explores: Array, accepted_Z: Array, drafting_slots: Array) -> InLoopState:
  """After a round of ``shape`` at width index ``width``: ``accepted_Z`` accepted
  drafts per position (summed over slots) of ``drafting_slots`` slot-rounds."""
  k = config.k_max
  depth_S = np.array([min(s, k) if not isinstance(s, tuple) else len(s)
                      for s in config.shapes])
  position_Z = jnp.arange(k)
  is_chain = (shape >= 1) & (shape <= k)
  # A chain of depth d reaches position 0 in every drafting slot-round, position i in
  # those that accepted i - 1 (``DraftLengthController.observe``).
  reached_Z = jnp.concatenate([drafting_slots[None].astype(jnp.float32),
                               accepted_Z[:-1].astype(jnp.float32)])
  in_chain_Z = is_chain & (position_Z < jnp.asarray(depth_S)[shape])
  slots_T = jnp.arange(state.tree_drafted_T.shape[0])
  tree_T = (slots_T + k + 1 == shape) & (slots_T < len(config.trees))
  drafted = drafting_slots.astype(jnp.float32)
  return state.replace(
      accepted_Z=state.accepted_Z + jnp.where(in_chain_Z, accepted_Z, 0),
      reached_Z=state.reached_Z + jnp.where(in_chain_Z, reached_Z, 0),
      tree_accepted_T=state.tree_accepted_T + jnp.where(tree_T, jnp.sum(accepted_Z), 0),
      tree_drafted_T=state.tree_drafted_T + jnp.where(tree_T, drafted, 0),
      rounds_SxW=state.rounds_SxW.at[shape, width].add(1),
      probes_W=state.probes_W.at[width].add(explores.astype(jnp.int32)),
      last_SxW=state.last_SxW.at[shape, width].set(state.clock),
      clock=state.clock + 1)


def plain_streak(config: InLoopConfig, state: InLoopState, width: int) -> Array:
  """How many plain rounds in a row ``choose`` picks at width index ``width`` from
  ``state``, where it has just picked plain: plain rounds count no acceptance, so the
  best shape stays and only the re-try schedule moves (one round when plain runs as an
  exploration; no end when pinned)."""
  _, explores, first = choose(config, state, width)
  steady = first.interval_W[width] - first.since_probe_W[width]
  never = jnp.iinfo(jnp.int32).max
  return jnp.where(state.force >= 0, never, jnp.where(explores, 1, steady)).astype(jnp.int32)


def settle_plain(config: InLoopConfig, state: InLoopState, width: int, rounds: Array
                 ) -> InLoopState:
  """The state after ``rounds`` (at most ``plain_streak``) plain rounds at width index
  ``width``: what ``choose`` before and ``observe`` after each of them leave."""
  shape, explores, first = choose(config, state, width)
  first = observe(config, first, width, shape, explores, jnp.zeros((config.k_max,), jnp.int32),
                  jnp.int32(0))
  more = jnp.maximum(rounds - 1, 0)
  # The rounds after the first: none explores; a pinned controller's schedule stands.
  after = first.replace(
      since_probe_W=first.since_probe_W.at[width].add(jnp.where(state.force >= 0, 0, more)),
      rounds_SxW=first.rounds_SxW.at[0, width].add(more),
      last_SxW=first.last_SxW.at[0, width].add(more), clock=first.clock + more)
  return jax.tree.map(lambda a, b: jnp.where(rounds > 0, a, b), after, state)


def fade(config: InLoopConfig, before: InLoopState, after: InLoopState) -> InLoopState:
  """The state a rollout hands to the next: its acceptance counts added to the
  carried ones, which fade by ``smoothing`` first."""
  keep = 1.0 - config.smoothing
  faded = lambda name: keep * getattr(before, name) + (getattr(after, name)
                                                       - getattr(before, name))
  return after.replace(**{name: faded(name) for name in
                          ("accepted_Z", "reached_Z", "tree_accepted_T", "tree_drafted_T")})


def merge_shards(before: InLoopState, per_shard: InLoopState) -> InLoopState:
  """One state from batch shards that each ran their own controller from ``before``
  (leading shard axis): counts summed, the re-try schedule of shard 0 kept."""
  summed = ("accepted_Z", "reached_Z", "tree_accepted_T", "tree_drafted_T", "rounds_SxW",
            "probes_W", "clock")
  first = jax.tree.map(lambda x: x[0], per_shard)
  return first.replace(**{name: getattr(before, name)
                          + jnp.sum(getattr(per_shard, name) - getattr(before, name)[None],
                                    axis=0) for name in summed})
