"""Adaptive speculation: the draft length (0 = plain decoding) is chosen between batches
of rounds from measured acceptance and round times, and output stays exactly the
target's distribution whatever lengths are chosen."""

import jax
import numpy as np
import pytest

from specrl_jax import drafters, testing
from specrl_jax.config import ConfigError, SamplingParams, SpecConfig
from specrl_jax.sampling.engine import EngineConfig
from specrl_jax.speculative.generate import generate
from specrl_jax.speculative.adaptive import DraftLengthController
from conftest import TINY_TARGET

TARGET_CONFIG = TINY_TARGET
VOCAB = TARGET_CONFIG.vocab_size


def observe_rounds(controller, k, *, seconds_per_round, acceptance, slots=8, rounds=8):
  """Feeds the controller what ``rounds`` rounds of length k with the given conditional
  per-position acceptance would report."""
  reached, accepted = slots * rounds, []
  for rate in acceptance[:k]:
    accepted.append(reached * rate)
    reached *= rate
  accepted_Z = np.zeros(controller.k_max)
  accepted_Z[:k] = accepted
  controller.observe(k, rounds, seconds_per_round * rounds, accepted_Z,
                     slots * rounds if k else 0)


# --- the controller -----------------------------------------------------------------

def run_controller(controller, decisions, *, seconds_per_round, acceptance, rounds=200):
  """Lets the controller decide ``decisions`` times in a world where a round of length k
  takes seconds_per_round(k) and drafts are accepted at the given conditional rates.
  Returns its choices."""
  choices = []
  for _ in range(decisions):
    k = controller.choose()
    choices.append(k)
    observe_rounds(controller, k, seconds_per_round=seconds_per_round(k),
                   acceptance=acceptance, rounds=rounds)
  return choices


def test_controller_measures_the_longest_draft_then_plain_then_the_shortest_then_the_best():
  # 0.9 acceptance at 4 ms + 1 ms per draft: the longest chain is the fastest.
  controller = DraftLengthController(k_max=4)
  choices = run_controller(controller, 4, seconds_per_round=lambda k: 0.004 + 0.001 * k,
                           acceptance=[0.9] * 4)
  assert choices == [4, 0, 1, 4]
  assert controller.round_seconds == {k: pytest.approx(0.004 + 0.001 * k) for k in (0, 1, 4)}


def test_a_batch_without_a_clean_timing_leaves_the_length_to_be_measured_again():
  # A length's first batch includes compiling it: its time says nothing about a round.
  controller = DraftLengthController(k_max=2)
  controller.observe(2, 8, None, np.array([40.0, 20.0]), 64)
  assert controller.round_seconds == {} and controller.reached_Z[0] == 64
  assert controller.choose() == 2


def test_controller_picks_the_length_with_most_tokens_per_second():
  # Rounds cost 4 ms + 1 ms per draft; the first two drafts are almost always accepted,
  # deeper ones rarely: k = 2 emits 2.85 tokens in 6 ms (k = 1: 1.95 in 5, k = 3: 2.99
  # in 7, the longest draft: 3.1 in 10).
  acceptance = [0.95, 0.95, 0.1, 0.1, 0.1, 0.1]
  controller = DraftLengthController(k_max=6)
  choices = run_controller(controller, 12, seconds_per_round=lambda k: 0.004 + 0.001 * k,
                           acceptance=acceptance)
  assert choices[:3] == [6, 0, 1] and controller.best_length() == 2
  # Settled on k = 2, apart from single batches of k = 3 now and then.
  assert choices[3:].count(2) >= 7 and set(choices[3:]) <= {2, 3}
  np.testing.assert_allclose(controller.acceptance()[:4], acceptance[:4], atol=0.02)


def test_controller_predicts_untried_lengths_from_the_acceptance_model():
  acceptance = [0.95, 0.95, 0.1, 0.1, 0.1, 0.1]
  controller = DraftLengthController(k_max=6)
  observe_rounds(controller, 6, seconds_per_round=0.010, acceptance=acceptance, rounds=500)
  observe_rounds(controller, 0, seconds_per_round=0.004, acceptance=[])
  assert controller.predicted_round_seconds(2) == pytest.approx(0.006)
  assert max(range(1, 7), key=controller.tokens_per_second) == 2


def test_untried_lengths_are_timed_on_the_drafting_lengths_line_not_through_plain():
  # A drafting round carries a fixed cost a plain step does not (8 ms + 1 ms per draft
  # vs 4 ms): k = 2 is predicted at 10 ms, not at the 8 ms of a line through plain.
  controller = DraftLengthController(k_max=4)
  for k, seconds in ((4, 0.012), (0, 0.004), (1, 0.009)):
    observe_rounds(controller, k, seconds_per_round=seconds, acceptance=[0.5] * 4)
  assert controller.predicted_round_seconds(2) == pytest.approx(0.010)
  assert controller.predicted_round_seconds(3) == pytest.approx(0.011)


def test_a_length_timed_once_on_a_noisy_batch_is_corrected_by_the_lengths_run_since():
  # Rounds cost 4 ms + 1 ms per draft. k = 1 was timed once, 8 rounds in a burst of
  # load (+60%); k = 2 and k = 3 have run 400 rounds each since. The prediction for
  # k = 1 follows the line they fix, not its own stale figure.
  controller = DraftLengthController(k_max=3)
  observe_rounds(controller, 1, seconds_per_round=1.6 * 0.005, acceptance=[0.5] * 3,
                 rounds=8)
  for k in (2, 3):
    observe_rounds(controller, k, seconds_per_round=0.004 + 0.001 * k, acceptance=[0.5] * 3,
                   rounds=400)
  assert controller.round_seconds[1] == pytest.approx(0.008)
  assert controller.predicted_round_seconds(1) == pytest.approx(0.005, rel=0.1)


def test_a_batch_cut_short_counts_by_its_rounds():
  # Every batch pays 20 ms of dispatch and read-back; a batch cut short by the end of
  # a rollout (1 round) must not count like a full one.
  controller = DraftLengthController(k_max=2)
  controller.observe(2, 63, 0.020 + 63 * 0.010, np.zeros(2), 8 * 63)
  controller.observe(2, 1, 0.020 + 0.010, np.zeros(2), 8)
  # The older batch weighs half (smoothing 0.5); a mean of the two batches' per-round
  # times would say 20 ms.
  assert controller.round_seconds[2] == pytest.approx(
      (0.5 * (0.020 + 0.630) + 0.030) / (0.5 * 63 + 1), rel=1e-6)
  assert controller.round_seconds[2] < 0.011


def test_a_length_that_keeps_winning_runs_in_ever_longer_batches():
  controller = DraftLengthController(k_max=3, max_batch_growth=4)
  sizes = []
  for _ in range(7):
    k = controller.choose()
    sizes.append(controller.decision_rounds(8))
    observe_rounds(controller, k, seconds_per_round=0.004 + 0.001 * k,
                   acceptance=[0.9] * 3, rounds=sizes[-1])
  # Three exploration batches, then the winner (k = 3) at 8, 16, 32 and at most 32 rounds.
  assert controller.history == [(3, 8), (0, 8), (1, 8), (3, 8), (3, 16), (3, 32), (3, 32)]
  assert sizes == [8, 8, 8, 8, 16, 32, 32]


def test_near_the_end_of_a_batch_the_controller_weighs_the_rounds_left_not_tokens_per_round():
  # 4 ms + 2 ms per draft, 0.9 acceptance: k = 3 emits the most tokens per second.
  controller = DraftLengthController(k_max=4)
  run_controller(controller, 3, seconds_per_round=lambda k: 0.004 + 0.002 * k,
                 acceptance=[0.9] * 4)
  assert controller.best_length() == 3
  assert controller.best_length(remaining_tokens=[400] * 8) == 3
  # Eight sequences two tokens from the end: a round of any length finishes a sequence
  # only if its first draft is accepted (and a batch of eight waits for the unluckiest),
  # so the cheapest round wins; two plain steps (8 ms) beat 1.57 expected k = 1 rounds.
  assert controller.expected_seconds(0, [2] * 8) == pytest.approx(0.008)
  assert controller.expected_seconds(1, [2] * 8) == pytest.approx(
      0.006 * (2 - 0.9 ** 8), rel=0.02)
  assert controller.best_length(remaining_tokens=[2] * 8) == 0
  # One sequence left with 5 tokens to go: a k = 4 round can finish it at once.
  assert controller.best_length(remaining_tokens=[5, 0, 0]) == 4


def test_a_length_settled_on_a_misleading_first_exploration_climbs_to_the_best():
  # The first batch of the longest chain was unlucky past the first draft (10% instead
  # of 90%): k = 1 looks best. Every length is 4 ms + 1 ms per draft; with 0.9
  # acceptance the longest chain (k = 4) is the fastest. A settled length measures no
  # position past its own, so only runs of its longer neighbour can show the error.
  controller = DraftLengthController(k_max=4, explore_every=8)
  seconds_per_round = lambda k: 0.004 + 0.001 * k
  observe_rounds(controller, 4, seconds_per_round=seconds_per_round(4),
                 acceptance=[0.9, 0.1, 0.1, 0.1], rounds=8)
  choices = run_controller(controller, 24, seconds_per_round=seconds_per_round,
                           acceptance=[0.9] * 4, rounds=8)
  assert choices[:3] == [0, 1, 1]
  assert choices[-6:].count(4) >= 5


def test_a_winning_length_runs_the_next_longer_for_one_base_batch_at_growing_intervals():
  # k = 2 wins clearly (4 ms + 1 ms per draft; the third draft is never accepted).
  controller = DraftLengthController(k_max=4, explore_every=8, max_batch_growth=8)
  choices, sizes = [], []
  for _ in range(40):
    k = controller.choose()
    choices.append(k)
    sizes.append(controller.decision_rounds(8))
    observe_rounds(controller, k, seconds_per_round=0.004 + 0.001 * k,
                   acceptance=[0.95, 0.95, 0.0, 0.0], rounds=sizes[-1])
  probes = [i for i, k in enumerate(choices) if i > 2 and k != 2]
  # After the exploration (4, 0, 1): probes of k = 3 after 2, 4, 8 and then every 8
  # decisions, each one base batch.
  assert [choices[i] for i in probes] == [3, 3, 3, 3, 3]
  assert np.diff(probes).tolist() == [4, 8, 8, 8]
  assert all(sizes[i] == 8 for i in probes)
  # The winner keeps its grown batches around a probe.
  assert sizes[probes[-1] + 1] == 64


def test_plain_decoding_that_wins_narrowly_re_measures_the_best_chain_soon():
  # k = 1 is truly 10% faster than plain decoding, but its one timed batch ran 20%
  # slow: plain decoding wins, by 9%. A close call re-measures k = 1 within a few
  # decisions rather than at the next longest-chain probe (16 decisions away).
  acceptance = [0.5, 0.1, 0.1]
  seconds_per_round = {0: 0.010, 1: 0.0136, 2: 0.016, 3: 0.018}
  controller = DraftLengthController(k_max=3)
  observe_rounds(controller, 3, seconds_per_round=seconds_per_round[3], acceptance=acceptance)
  observe_rounds(controller, 0, seconds_per_round=seconds_per_round[0], acceptance=acceptance)
  observe_rounds(controller, 1, seconds_per_round=1.2 * seconds_per_round[1],
                 acceptance=acceptance)
  assert controller.best_length() == 0
  choices = run_controller(controller, 8, seconds_per_round=seconds_per_round.__getitem__,
                           acceptance=acceptance, rounds=8)
  assert choices[:2] == [0, 1]
  assert controller.best_length() == 1 and choices[-4:].count(1) >= 3


def test_controller_falls_back_to_plain_decoding_when_speculation_loses():
  controller = DraftLengthController(k_max=3, explore_every=4)
  choices = run_controller(controller, 14, seconds_per_round=lambda k: 0.004 + 0.003 * k,
                           acceptance=[0.3] * 3, rounds=8)
  # After measuring every length: plain decoding, except for a periodic re-measurement
  # of the longest draft.
  later = choices[4:]
  assert later.count(0) >= 7 and set(later) <= {0, 3}


def test_a_drafter_that_stays_useless_is_probed_ever_less_often():
  controller = DraftLengthController(k_max=3, explore_every=4)
  choices = run_controller(controller, 40, seconds_per_round=lambda k: 0.004 + 0.003 * k,
                           acceptance=[0.3] * 3, rounds=8)
  probes = [i for i, k in enumerate(choices) if k == 3][1:]  # after the first measurement
  assert set(choices[3:]) == {0, 3}
  assert np.diff(probes).tolist() == [8, 16]  # every 4th, 8th, 16th plain decision


def test_controller_notices_a_drafter_that_improves():
  controller = DraftLengthController(k_max=3, explore_every=2)
  run_controller(controller, 4, seconds_per_round=lambda k: 0.004 + 0.002 * k,
                 acceptance=[0.1] * 3, rounds=50)
  # The drafter got good: the periodic re-measurements now accept almost everything.
  choices = run_controller(controller, 8, seconds_per_round=lambda k: 0.004 + 0.002 * k,
                           acceptance=[0.98] * 3, rounds=50)
  assert choices[-1] > 0


@pytest.mark.parametrize("field, value", [("k_max", 0), ("min_gain", 0.5), ("close_call", 0.9),
                                          ("explore_every", 1), ("smoothing", 0.0),
                                          ("max_batch_growth", 3)])
def test_controller_rejects_bad_settings(field, value):
  with pytest.raises(ConfigError, match=field):
    DraftLengthController(**{"k_max": 3, field: value})


def test_spec_config_rejects_adaptive_trees_and_bad_decision_interval():
  with pytest.raises(ConfigError, match="tree"):
    SpecConfig(tree=(2, 1), adaptive=True)
  with pytest.raises(ConfigError, match="rounds_per_decision"):
    SpecConfig(adaptive=True, rounds_per_decision=0)


# --- generation -----------------------------------------------------------------------



def test_adaptive_speculation_follows_the_exact_joint_distribution(target, noisy_drafter):
  # One round per decision: draft lengths change every round while sequences are in
  # flight, so a sequence's tokens come from rounds of different lengths.
  prompt = [1, 2, 3] + testing.greedy_reference(target, [[1, 2, 3]], 6)[0]
  sampling = SamplingParams(temperature=1.0, max_new_tokens=6, top_k=4)
  prompts = [prompt] * 20_000
  out = generate(target, prompts, sampling=sampling, rng=jax.random.key(0),
                 drafter=noisy_drafter,
                 spec=SpecConfig(num_draft_tokens=4, adaptive=True, rounds_per_decision=1),
                 engine=EngineConfig(page_size=4, num_slots=2048))
  exact = testing.enumerate_sequence_distribution(target, prompt, sampling, 3)
  testing.assert_joint_matches(out.tokens, out.lengths, exact, name="adaptive")
  testing.assert_per_position_matches(out.tokens, testing.marginals_from_joint(exact, VOCAB),
                                      name="adaptive")
  np.testing.assert_allclose(
      out.logprobs, testing.response_log_probs(target, prompts, out.tokens, out.lengths,
                                               sampling), atol=1e-4)
  lengths_used = {k for k, _ in out.stats["draft_length_schedule"]}
  assert 0 in lengths_used and 4 in lengths_used  # plain and the longest were both run
  assert set(out.stats["round_seconds_by_draft_length"]) == lengths_used


@pytest.mark.parametrize("drafter_name", ["draft_model", "ngram"])
def test_adaptive_greedy_output_is_identical_to_plain_greedy(target, noisy_drafter,
                                                             drafter_name):
  # The n-gram drafter keeps no state: its "off" rounds are plain decoding steps.
  drafter = noisy_drafter if drafter_name == "draft_model" else drafters.NGram(n=2)
  prompts = [[5], [3, 10, 11], [9, 2, 6, 5], [1, 2, 3, 4, 5, 6, 7, 8], [11, 0, 1, 2, 4]]
  sampling = SamplingParams(temperature=0.0, max_new_tokens=12)
  engine = EngineConfig(page_size=4, num_slots=2)  # slots are refilled mid-flight
  plain = generate(target, prompts, sampling=sampling, engine=engine)
  adaptive = generate(target, prompts, sampling=sampling, engine=engine,
                      drafter=drafter,
                      spec=SpecConfig(num_draft_tokens=3, adaptive=True,
                                      rounds_per_decision=2))
  np.testing.assert_array_equal(adaptive.tokens, plain.tokens)
  np.testing.assert_array_equal(adaptive.lengths, plain.lengths)


class ScriptedController(DraftLengthController):
  """Chooses the given lengths in turn (then plain), growing its batches as the real
  one does when a length repeats."""

  def __init__(self, k_max, script):
    super().__init__(k_max=k_max)
    self._script = list(script)

  def choose(self, remaining_tokens=None):
    return self._settle(self._script.pop(0) if self._script else 0)


def test_a_drafter_kept_in_step_through_plain_rounds_drafts_as_if_it_had_drafted_all_along(
    target):
  # The target drafting for itself, greedily, has every draft accepted, provided its
  # cache holds every emitted token: plain rounds after a drafting batch catch up on
  # its accepted drafts first, then feed one token per round. A token skipped would
  # leave a hole in the drafter's cache and its drafts would start to miss.
  prompts = [[5], [3, 10, 11], [9, 2, 6, 5], [1, 2, 3, 4, 5, 6, 7, 8], [11, 0, 1, 2, 4]]
  sampling = SamplingParams(temperature=0.0, max_new_tokens=24)
  engine = EngineConfig(page_size=4, num_slots=2)  # slots are refilled mid-flight
  plain = generate(target, prompts, sampling=sampling, engine=engine)
  # Every kind of switch: drafting to plain and back, longer to shorter chains.
  controller = ScriptedController(3, [3, 0, 0, 2, 0, 0, 0, 3, 1, 0, 3, 2, 1, 3, 3])
  out = generate(target, prompts, sampling=sampling, engine=engine,
                 drafter=drafters.DraftModel(target),
                 spec=SpecConfig(num_draft_tokens=3, adaptive=True, rounds_per_decision=2),
                 controller=controller)
  np.testing.assert_array_equal(out.tokens, plain.tokens)
  schedule = [k for k, _ in out.stats["draft_length_schedule"]]
  assert schedule[:4] == [3, 0, 0, 2]
  assert out.stats["per_position_acceptance"] == [1.0, 1.0, 1.0]


class Eagle3KeptInStepEveryRound(drafters.Eagle3):
  """EAGLE-3 that runs its layer in plain rounds too (the path of drafters that cannot
  catch up later): the reference for the one that sits them out."""
  catches_up = False


def test_a_hidden_state_drafter_that_sits_out_plain_rounds_drafts_exactly_as_one_kept_in_step(
    target):
  # Features of plain rounds are stored as they pass; the head's own cache over them is
  # computed when drafting resumes. Its drafts, and so what is accepted, must be those
  # of a head fed every round.
  prompts = [[5], [3, 10, 11], [9, 2, 6, 5], [1, 2, 3, 4, 5, 6, 7, 8], [11, 0, 1, 2, 4]]
  sampling = SamplingParams(temperature=0.0, max_new_tokens=24)
  engine = EngineConfig(page_size=4, num_slots=2)
  script = [3, 0, 0, 2, 0, 0, 0, 3, 1, 0, 3, 2, 1, 3, 3]
  outputs = {}
  for name, kind in (("sits_out", drafters.Eagle3), ("every_round", Eagle3KeptInStepEveryRound)):
    # Two draft tokens, the two the greedy target emits most: an untrained head then
    # drafts right often enough for a wrong cache to show.
    drafter = kind(target, target_layers=(0, 1, 1), draft_to_target=[1, 8], seed=3)
    outputs[name] = generate(
        target, prompts, sampling=sampling, engine=engine, drafter=drafter,
        spec=SpecConfig(num_draft_tokens=3, adaptive=True, rounds_per_decision=2),
        controller=ScriptedController(3, script))
  sits_out, every_round = outputs["sits_out"], outputs["every_round"]
  np.testing.assert_array_equal(sits_out.tokens, every_round.tokens)
  assert (sits_out.stats["draft_length_schedule"]
          == every_round.stats["draft_length_schedule"])
  assert sits_out.stats["target_calls"] == every_round.stats["target_calls"]
  np.testing.assert_allclose(sits_out.stats["per_position_acceptance"],
                             every_round.stats["per_position_acceptance"])
  assert 0 < sits_out.stats["per_position_acceptance"][0] < 1  # drafts that can miss


def test_a_controller_passed_to_every_call_carries_its_measurements_over(target, noisy_drafter):
  prompts = [[1, 2, 3], [4, 5]]
  sampling = SamplingParams(temperature=1.0, max_new_tokens=8)
  spec = SpecConfig(num_draft_tokens=2, adaptive=True, rounds_per_decision=2)
  controller = DraftLengthController(k_max=2)
  first = generate(target, prompts, sampling=sampling, drafter=noisy_drafter, spec=spec,
                   controller=controller)
  decisions = len(controller.history)
  second = generate(target, prompts, sampling=sampling, drafter=noisy_drafter, spec=spec,
                    controller=controller, rng=jax.random.key(1))
  assert first.stats["draft_length_schedule"] == controller.history[:decisions]
  assert second.stats["draft_length_schedule"] == controller.history[decisions:]
  assert controller.reached_Z[0] > 0  # acceptance was measured and kept
  with pytest.raises(ValueError, match="k_max=3"):
    generate(target, prompts, sampling=sampling, drafter=noisy_drafter, spec=spec,
             controller=DraftLengthController(k_max=3))
  with pytest.raises(ValueError, match="not adaptive"):
    generate(target, prompts, sampling=sampling, drafter=noisy_drafter,
             spec=SpecConfig(num_draft_tokens=2), controller=controller)


def test_a_controller_settled_on_plain_decoding_runs_whole_rollouts_as_plain_decoding(
    target, noisy_drafter):
  # Speculation was measured slower than plain decoding: a rollout is then plain
  # decoding's own program (no drafter state to prefill or keep), one decision, until a
  # probe of the longest chain is due.
  controller = DraftLengthController(k_max=2, explore_every=2)
  for k, seconds in ((2, 0.010), (0, 0.002), (1, 0.008)):
    observe_rounds(controller, k, seconds_per_round=seconds, acceptance=[0.2, 0.2])
  prompts = [[1, 2, 3], [4, 5]]
  sampling = SamplingParams(temperature=1.0, max_new_tokens=8)
  spec = SpecConfig(num_draft_tokens=2, adaptive=True, rounds_per_decision=2)
  plain = generate(target, prompts, sampling=sampling, rng=jax.random.key(4))
  first = generate(target, prompts, sampling=sampling, rng=jax.random.key(4),
                   drafter=noisy_drafter, spec=spec, controller=controller)
  np.testing.assert_array_equal(first.tokens, plain.tokens)
  np.testing.assert_array_equal(first.logprobs, plain.logprobs)
  assert first.stats["draft_length_schedule"] == [(0, plain.stats["target_calls"])]
  assert "drafter" not in first.stats
  second = generate(target, prompts, sampling=sampling, rng=jax.random.key(5),
                    drafter=noisy_drafter, spec=spec, controller=controller)
  assert second.stats["draft_length_schedule"][0] == (2, 2)  # the probe, one batch
