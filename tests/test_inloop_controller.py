"""The in-loop controller's decision rule, traced (speculative.inloop): every shape is
tried once per width first (the longest chain, then the trees, plain decoding, the
shorter chains); then the shape with the most expected tokens per measured second
wins, plain decoding unless a drafting shape beats it by min_gain; a losing shape is
re-tried at doubling intervals; acceptance is counted per position as the host
controller counts it, and a thinly reached position is estimated near the one before
it, as the host controller estimates it; a forced shape (calibration) always runs. The
refresh from a rollout's own time rescales only the cells it ran; bad menus and cost
tables are refused by name. Calibration times each shape after an untimed first pass
and never lets a narrower width cost more per round than a wider one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specrl_jax.config import ConfigError
from specrl_jax.speculative.adaptive import DraftLengthController
from specrl_jax.speculative.expected import expected_tokens_per_round
from specrl_jax.speculative.inloop import (
    InLoopConfig, InLoopState, acceptance_rates, best_shape, choose, expected_tokens_S, observe,
    plain_streak, settle_plain,
)
from specrl_jax.sampling.results import GenerateOutput
from specrl_jax.speculative.inloop_calibration import refresh, time_shapes

CONFIG = InLoopConfig(k_max=3, trees=((2, 1),), explore_every=2)
SHAPES = len(CONFIG.shapes)  # plain, k1, k2, k3, tree 2x1
ONE_WIDTH = np.ones((SHAPES, 1), np.float32)


@jax.jit
def _step(state, accepted_Z, drafting):
  """One round at width 0: choose, then observe what the world says."""
  shape, explores, state = choose(CONFIG, state, 0)
  return shape, explores, observe(CONFIG, state, 0, shape, explores, accepted_Z, drafting)


def _run(state, rounds, acceptance=0.9, slots=4):
  """Rounds in a world where each drafted position is accepted by a share of slots."""
  shapes, probes = [], []
  for _ in range(rounds):
    accepted = jnp.asarray([slots * acceptance ** (i + 1) for i in range(3)], jnp.float32)
    shape, explores, state = _step(state, accepted, jnp.int32(slots))
    shapes.append(int(shape))
    probes.append(bool(explores))
  return shapes, probes, state


def test_every_shape_is_tried_once_first_longest_chain_then_trees_plain_and_shorter():
  shapes, probes, _ = _run(InLoopState.initial(CONFIG, ONE_WIDTH), SHAPES)
  assert shapes == [3, 4, 0, 1, 2] and all(probes)


def test_a_cheap_accurate_drafter_wins_with_the_longest_chain_a_costly_one_loses_to_plain():
  state = InLoopState.initial(CONFIG, ONE_WIDTH).replace(
      accepted_Z=jnp.asarray([90.0, 80.0, 70.0]), reached_Z=jnp.asarray([100.0, 90.0, 80.0]))
  assert int(best_shape(CONFIG, state, 0)) == 3
  # Drafting rounds costing 4x a plain one cannot pay for at most ~3.4 tokens per round.
  costly = state.replace(cost_SxW=jnp.asarray([[1.0], [4.0], [4.0], [4.0], [4.0]]))
  assert int(best_shape(CONFIG, costly, 0)) == 0
  tokens = np.asarray(expected_tokens_S(CONFIG, state))
  rates = tuple(np.asarray(acceptance_rates(state.accepted_Z, state.reached_Z)))
  np.testing.assert_allclose(tokens[1:4], [expected_tokens_per_round(rates, k)
                                            for k in (1, 2, 3)], rtol=1e-6)


def test_plain_decoding_wins_a_near_tie_by_min_gain():
  state = InLoopState.initial(CONFIG, ONE_WIDTH).replace(
      accepted_Z=jnp.asarray([1.0, 0.0, 0.0]), reached_Z=jnp.asarray([100.0, 1.0, 0.0]),
      cost_SxW=jnp.asarray([[1.0], [1.015], [2.0], [3.0], [3.0]]))
  # k = 1 emits ~1.02 tokens per round at 1.015x the cost: within min_gain of plain.
  assert int(best_shape(CONFIG, state, 0)) == 0


def test_a_losing_shape_is_re_tried_at_doubling_intervals():
  shapes, probes, state = _run(InLoopState.initial(CONFIG, ONE_WIDTH), 40)
  after = np.flatnonzero(probes[SHAPES:])  # the rounds that re-tried a loser
  gaps = np.diff(after)
  assert len(after) >= 3 and list(gaps[:3]) == [4, 8, 16][:len(gaps[:3])]
  winner = max(set(shapes[SHAPES:]), key=shapes[SHAPES:].count)
  assert all(shapes[SHAPES + i] != winner for i in after)
  assert int(state.probes_W[0]) == SHAPES + len(after)
  assert int(state.rounds_SxW.sum()) == 40 and int(state.clock) == 40


def test_acceptance_is_counted_per_position_reached_as_the_host_controller_counts_it():
  state = InLoopState.initial(CONFIG, ONE_WIDTH)
  state = observe(CONFIG, state, 0, jnp.int32(2), jnp.bool_(False),
                  jnp.asarray([3, 1, 0], jnp.int32), jnp.int32(4))
  # A chain of 2: position 0 reached by 4 slot-rounds, position 1 by the 3 accepting it.
  np.testing.assert_array_equal(state.accepted_Z, [3, 1, 0])
  np.testing.assert_array_equal(state.reached_Z, [4, 3, 0])
  state = observe(CONFIG, state, 0, jnp.int32(4), jnp.bool_(False),
                  jnp.asarray([2, 1, 0], jnp.int32), jnp.int32(4))
  np.testing.assert_array_equal(state.tree_accepted_T, [3])   # trees: their own counts
  np.testing.assert_array_equal(state.tree_drafted_T, [4])
  np.testing.assert_array_equal(state.accepted_Z, [3, 1, 0])


def test_a_thinly_reached_position_is_estimated_near_the_one_before_it_not_near_one_half():
  # Position 2 was reached in half a round (faded exploration counts) and accepted there.
  accepted_Z, reached_Z = np.array([80.0, 62.0, 0.4]), np.array([100.0, 81.0, 0.5])
  rates = np.asarray(acceptance_rates(jnp.asarray(accepted_Z), jnp.asarray(reached_Z)))
  np.testing.assert_allclose(rates[:2], [81 / 102, (62 + 2 * 81 / 102) / 83], rtol=1e-6)
  assert abs(rates[2] - rates[1]) < 0.02 and rates[2] > 0.7
  # The estimate is continuous in the counts: never reached, a position repeats the one
  # before; reached 1e-3 times, it moves by less than 1e-3.
  never = np.asarray(acceptance_rates(jnp.asarray(accepted_Z * [1, 1, 0]),
                                      jnp.asarray(reached_Z * [1, 1, 0])))
  barely = np.asarray(acceptance_rates(jnp.asarray([80.0, 62.0, 0.0]),
                                       jnp.asarray([100.0, 81.0, 1e-3])))
  assert never[2] == never[1] and abs(barely[2] - never[2]) < 1e-3
  # Many rounds outweigh the prior.
  many = np.asarray(acceptance_rates(jnp.asarray([80.0, 62.0, 3000.0]),
                                     jnp.asarray([100.0, 81.0, 10000.0])))
  assert abs(many[2] - 0.3) < 1e-3
  host = DraftLengthController(k_max=3)
  host.accepted_Z, host.reached_Z = accepted_Z, reached_Z
  np.testing.assert_allclose(host.acceptance(), rates, rtol=1e-6)


def test_a_forced_shape_always_runs_and_explores_nothing():
  state = InLoopState.initial(CONFIG, ONE_WIDTH).replace(force=jnp.int32(1))
  shapes, probes, _ = _run(state, 6)
  assert shapes == [1] * 6 and not any(probes)


def _plain_choosing_state(case: str) -> InLoopState:
  """A state whose next round is plain decoding, for each reason the rule has."""
  tried = InLoopState.initial(CONFIG, ONE_WIDTH).replace(
      accepted_Z=jnp.asarray([90.0, 80.0, 70.0]), reached_Z=jnp.asarray([100.0, 90.0, 80.0]),
      rounds_SxW=jnp.ones((SHAPES, 1), jnp.int32), clock=jnp.int32(5),
      last_SxW=jnp.asarray([[0], [1], [2], [4], [3]], jnp.int32),  # plain ran longest ago
      interval_W=jnp.asarray([8], jnp.int32), since_probe_W=jnp.asarray([3], jnp.int32))
  costly = jnp.asarray([[1.0], [4.0], [4.0], [4.0], [4.0]])
  return {"plain_wins": tried.replace(cost_SxW=costly),            # 4 rounds to the re-try
          "pinned": tried.replace(force=jnp.int32(0)),               # k = 3 would win
          "re_tried": tried.replace(best_W=jnp.asarray([3], jnp.int32),
                                    since_probe_W=jnp.asarray([7], jnp.int32)),
          "untried": tried.replace(rounds_SxW=jnp.asarray([[0], [0], [0], [1], [1]], jnp.int32)),
          }[case]


@pytest.mark.parametrize("case,streak", [("plain_wins", 4), ("pinned", 2**31 - 1),
                                         ("re_tried", 1), ("untried", 1)])
def test_plain_rounds_run_as_a_streak_that_settles_as_asking_before_each_round_would(case,
                                                                                     streak):
  """Plain rounds count no acceptance: the decode loop asks the rule once how many follow
  (plain_streak) and settles their bookkeeping after them (settle_plain)."""
  state = _plain_choosing_state(case)
  assert int(plain_streak(CONFIG, state, 0)) == streak
  settle = jax.jit(settle_plain, static_argnums=(0, 2))
  asked, zeros = state, jnp.zeros((3,), jnp.int32)
  for rounds in range(min(streak, 6) + 1):
    jax.tree.map(np.testing.assert_array_equal, settle(CONFIG, state, 0, jnp.int32(rounds)),
                 asked)
    shape, _, asked = _step(asked, zeros, jnp.int32(0))
    assert (int(shape) == 0) == (rounds < streak)  # the streak's rounds, then another shape


def test_a_refresh_rescales_the_cells_a_rollout_ran_by_their_share_only():
  cost = np.array([[1.0, 0.5], [2.0, 1.0]], np.float32)
  rounds = np.array([[10, 0], [0, 0]])
  # 10 plain rounds at width 0 predicted 10 s; they took 20 s beyond the fixed 1 s.
  new = refresh(cost, 1.0, rounds, 21.0, weight=1.0)
  np.testing.assert_allclose(new, [[2.0, 0.5], [2.0, 1.0]], rtol=1e-6)
  np.testing.assert_allclose(refresh(cost, 1.0, np.zeros((2, 2)), 5.0), cost)


def test_calibration_skips_each_shapes_first_pass_and_caps_narrow_widths_by_wider_ones():
  """A stage's first run pays one-time costs; the narrow stages see a handful of rounds."""
  config = InLoopConfig(k_max=1)  # plain, k1
  passes = []

  def run(controller, rng):  # a rollout at widths (4, 2): its stages' seconds and rounds
    first = len(passes) < 2
    passes.append(int(controller.force))
    seconds_W = [10.0, 9.0] if first else [1.0 + int(controller.force), 0.6]
    stats = {"seconds": sum(seconds_W), "compaction": {
        "widths": [4, 2], "seconds_by_width": seconds_W, "rounds_by_width": [10, 2]}}
    return GenerateOutput(tokens=np.zeros((1, 1)), lengths=np.ones(1), logprobs=np.zeros((1, 1)),
                          stats=stats)

  calibration = time_shapes(run, config, (4, 2), rng=jax.random.key(0), repeats=1)
  assert passes == [0, 1, 0, 1]  # an untimed pass, then the timed one
  # plain 0.1 s a round at width 4, 0.3 measured at width 2 over 2 rounds: capped to 0.1.
  np.testing.assert_allclose(calibration.cost_SxW, [[0.1, 0.1], [0.2, 0.2]], rtol=1e-6)


@pytest.mark.parametrize("fields,fragment", [
    (dict(k_max=2, trees=((2, 1), (3, 1), (2, 2))), "at most 2 trees"),
    (dict(k_max=2, trees=((2, 2, 1),)), "depth of at most k_max=2"),
    (dict(k_max=2, trees=((1, 1),)), "branches somewhere"),
    (dict(k_max=0), "k_max"),
    (dict(k_max=2, smoothing=0.0), "smoothing"),
])
def test_bad_menus_are_refused_by_name(fields, fragment):
  with pytest.raises(ConfigError, match=fragment):
    InLoopConfig(**fields)


def test_a_cost_table_that_is_not_measured_seconds_is_refused():
  with pytest.raises(ConfigError, match="finite positive seconds"):
    InLoopState.initial(CONFIG, np.zeros((SHAPES, 2)))
  with pytest.raises(ConfigError, match="5 shapes"):
    InLoopState.initial(CONFIG, np.ones((3, 2)))
