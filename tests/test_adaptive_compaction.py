"""Concurrency-aware adaptive speculation: the draft shape (chain length, plain
decoding or a tree of a small menu) is chosen per live width, and slot compaction
narrows the batch between decisions.

What must hold: each width keeps its own round times while acceptance, a property of the
drafter and the policy, is shared; in a world where a round's cost grows with its width
times its tokens (compute-bound) the full batch settles on short chains and the tail on
long ones, and a tree is run where it beats every chain; bad trees are refused by name;
a plain DraftLengthController still chooses one length for every width. In the engine:
greedy output is token-identical to plain decoding whatever shapes and widths are
chosen (draft model, stateless n-gram, fewer slots than requests, ragged prompts, stop
token); sampled output keeps the exact joint distribution with compaction and per-width
shape changes (chains, a tree, plain rounds) inside the sampled tokens, and every
log-prob is the full forward's; the stats say which shape ran how many rounds per width.
"""

import dataclasses

import jax
import numpy as np
import pytest

from specrl_jax import drafters, testing
from specrl_jax.config import ConfigError, SamplingParams, SpecConfig
from specrl_jax.sampling.engine import EngineConfig
from specrl_jax.speculative.adaptive import DraftLengthController
from specrl_jax.speculative.concurrency import (
    ConcurrencyAwareController, equivalent_chain_rate, shape_label,
)
from specrl_jax.speculative.expected import expected_tokens_per_round
from specrl_jax.speculative.generate import generate
from conftest import TINY_TARGET

CONFIG = TINY_TARGET
VOCAB = CONFIG.vocab_size
PROMPTS = [[5], [3, 10, 11], [9, 2, 6, 5], [1, 2, 3, 4, 5, 6, 7, 8],
           [11, 0, 1, 2, 4, 4, 9, 10, 1], [3, 10, 11], [1, 2, 3, 4, 5, 6, 7, 8], [7, 7]]
TREE = (2, 2, 1)


# --- the controller in a simulated world ------------------------------------------------

def drafted_tokens(shape) -> int:
  return sum(np.cumprod(shape)) if isinstance(shape, tuple) else shape


def simulate(controller, width, decisions, *, acceptance=0.8, tree_tokens=None,
             seconds=lambda width, tokens: 1e-3 + 1e-4 * width * tokens):
  """``decisions`` decisions at ``width`` in a world where a round costs ``seconds(width,
  tokens verified per slot)`` (compute-bound when it grows with width x tokens), chain
  drafts are accepted at a constant conditional rate and a tree emits ``tree_tokens``
  per round. Returns the choices."""
  choices = []
  for _ in range(decisions):
    shape = controller.choose(width)
    choices.append(shape)
    rounds = controller.decision_rounds(width, 8)
    accepted_Z = np.zeros(controller.k_max)
    if isinstance(shape, tuple):
      accepted_Z[0] = (tree_tokens - 1) * width * rounds
    else:
      accepted_Z[:shape] = width * rounds * acceptance ** np.arange(1, shape + 1)
    drafted = width * rounds if shape else 0
    controller.observe(width, shape, rounds,
                       rounds * seconds(width, 1 + drafted_tokens(shape)), accepted_Z, drafted)
  return choices


def test_each_width_times_its_own_rounds_and_all_share_one_acceptance():
  controller = ConcurrencyAwareController(k_max=4)
  simulate(controller, 8, 3)
  assert controller.chains_at(8).reached_Z[0] > 0
  np.testing.assert_array_equal(controller.chains_at(1).acceptance(),
                                controller.chains_at(8).acceptance())
  assert controller.chains_at(1).round_seconds == {}  # a width's times are its own
  assert set(controller.chains_at(8).round_seconds) == {4, 0, 1}  # longest, plain, shortest


def test_a_compute_bound_full_batch_drafts_short_and_its_tail_long():
  controller = ConcurrencyAwareController(k_max=4)
  full = simulate(controller, 64, 20)
  tail = simulate(controller, 1, 20)
  assert full[-1] <= 1 and tail[-1] == 4, (full, tail)
  schedule = controller.schedule_by_width()
  assert set(schedule) == {64, 1} and list(schedule) == [64, 1]  # widest first


def test_a_tree_runs_at_the_widths_where_it_beats_every_chain():
  # The tree's 8 drafts emit 4.2 tokens a round (a 4-chain, 1 + 0.8 + ... = 3.4): worth
  # its extra verified tokens when a round costs little more than its overhead.
  controller = ConcurrencyAwareController(k_max=4, trees=(TREE,))
  full = simulate(controller, 64, 20, tree_tokens=4.2)
  tail = simulate(controller, 1, 20, tree_tokens=4.2)
  assert TREE in tail[:8] and TREE in full[:8]  # tried at each width once chains are timed
  assert tail[-1] == TREE and full[-1] != TREE, (full, tail)
  assert controller.tree_tokens_per_round(TREE) == pytest.approx(4.2)
  assert shape_label(TREE) in controller.round_seconds()[1]


def test_a_losing_tree_is_tried_again_at_doubling_intervals():
  controller = ConcurrencyAwareController(k_max=4, trees=(TREE,),
                                          chains=DraftLengthController(k_max=4, explore_every=4))
  choices = simulate(controller, 64, 60, tree_tokens=1.5)
  tries = [i for i, c in enumerate(choices) if c == TREE]
  gaps = np.diff(tries)
  assert len(tries) >= 3 and np.all(gaps[1:] >= gaps[:-1]), tries


def test_a_tree_is_modelled_near_the_end_as_a_chain_emitting_as_many_tokens():
  rate = equivalent_chain_rate(2.5, 3)
  assert expected_tokens_per_round((rate,), 3) == pytest.approx(2.5, abs=1e-9)
  assert equivalent_chain_rate(9.0, 3) == pytest.approx(1.0, abs=1e-9)


def test_a_draft_length_controller_chooses_one_length_for_every_width(target, noisy_drafter):
  chains = DraftLengthController(k_max=2)
  out = generate(target, PROMPTS, sampling=SamplingParams(temperature=1.0, max_new_tokens=8),
                 drafter=noisy_drafter, engine=EngineConfig(page_size=4, compaction=True),
                 spec=SpecConfig(num_draft_tokens=2, adaptive=True, rounds_per_decision=1),
                 controller=chains)
  assert [k for k, _ in out.stats["draft_length_schedule"]] == [k for k, _ in chains.history]
  assert len(out.stats["draft_schedule_by_width"]) > 1  # it still compacted


@pytest.mark.parametrize("fields,fragment", [
    (dict(trees=((1, 1),)), "branch"),
    (dict(trees=((2, 2, 2, 2, 2),)), "depth of at most k_max=4"),
    (dict(trees=((2, 0),)), "positive children"),
    (dict(trees=(TREE, TREE)), "distinct"),
    (dict(chains=DraftLengthController(k_max=3)), "chains.k_max=3"),
])
def test_bad_controller_trees_are_refused_by_name(fields, fragment):
  with pytest.raises(ConfigError, match=fragment):
    ConcurrencyAwareController(k_max=4, **fields)


@pytest.mark.parametrize("fields,fragment", [
    (dict(adaptive_trees=((2, 1),)), "unless adaptive=True"),
    (dict(adaptive=True, num_draft_tokens=2, adaptive_trees=((2, 2, 1),)),
     "no deeper than num_draft_tokens=2"),
    (dict(adaptive=True, adaptive_trees=((1, 1),)), "branch"),
    (dict(adaptive=True, adaptive_trees=(2, 1)), "tuple of trees"),
])
def test_bad_adaptive_trees_are_refused_by_name(fields, fragment):
  with pytest.raises(ConfigError, match=f"SpecConfig.adaptive_trees.*{fragment}"):
    SpecConfig(**fields)


def test_a_controller_whose_menu_differs_from_the_spec_is_refused_before_compiling(
    target, noisy_drafter):
  spec = SpecConfig(num_draft_tokens=3, adaptive=True, adaptive_trees=(TREE,))
  with pytest.raises(ValueError, match=r"controller.trees=\(\) differ"):
    generate(target, PROMPTS, drafter=noisy_drafter, spec=spec,
             controller=ConcurrencyAwareController(k_max=3))


# --- the engine ------------------------------------------------------------------------

class ScriptedController(ConcurrencyAwareController):
  """Chooses the script's shapes in turn, whatever the width (then plain)."""

  def __init__(self, k_max, trees, script):
    super().__init__(k_max=k_max, trees=trees)
    self._script = list(script)

  def choose(self, width, remaining_tokens=None):
    shape = self._script.pop(0) if self._script else 0
    return self._decided(width, shape, probe=True)  # one base batch each




SCRIPT = [3, 0, TREE, 1, 2, TREE, 0, 3, 1, TREE, 2] * 4


# Widths (3, 2) and (8, 4): each width more compiles every shape again.
@pytest.mark.parametrize("drafter_name,num_slots,min_width", [("draft_model", 3, 2),
                                                              ("ngram", 0, 4)],
                         ids=["draft_model-3", "ngram-0"])
def test_greedy_output_is_plain_decoding_whatever_shapes_and_widths_run(
    target, noisy_drafter, drafter_name, num_slots, min_width):
  drafter = noisy_drafter if drafter_name == "draft_model" else drafters.NGram(n=2)
  plain_tokens = testing.greedy_reference(target, PROMPTS, 12)
  stop = plain_tokens[0][2]  # ends some responses early: the batch narrows
  sampling = SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=(stop,))
  plain = generate(target, PROMPTS, sampling=sampling, engine=EngineConfig(page_size=4))
  assert len(set(plain.lengths.tolist())) > 2
  out = generate(target, PROMPTS, sampling=sampling, drafter=drafter,
                 engine=EngineConfig(page_size=4, num_slots=num_slots, compaction=True,
                                     compaction_min_width=min_width),
                 spec=SpecConfig(num_draft_tokens=3, adaptive=True, rounds_per_decision=1,
                                 adaptive_trees=(TREE,)),
                 controller=ScriptedController(3, (TREE,), SCRIPT))
  np.testing.assert_array_equal(out.tokens, plain.tokens)
  np.testing.assert_array_equal(out.lengths, plain.lengths)
  by_width = out.stats["draft_schedule_by_width"]
  compaction = out.stats["compaction"]
  assert len(by_width) > 1 and set(by_width) <= set(compaction["widths"])
  assert sum(sum(row.values()) for row in by_width.values()) == out.stats["target_calls"]
  assert [sum(by_width.get(w, {}).values()) for w in compaction["widths"]] == \
      compaction["rounds_by_width"]


# One slot per request, so every sequence decodes while the batch narrows: the stop
# token ends most responses within a few tokens, and the script changes the shape every
# round, at every width.
NUM_SAMPLES = 8192
MAX_NEW_SAMPLED = 5  # with top-k 3 the joint of whole responses is enumerable (3^5)


def test_sampled_tokens_follow_the_exact_joint_distribution_while_shapes_and_widths_change(
    target, noisy_drafter):
  prompt = [1, 2, 3, 4, 5]
  sampling = SamplingParams(temperature=1.0, top_k=3, max_new_tokens=MAX_NEW_SAMPLED)
  marginals = testing.marginals_from_joint(
      testing.enumerate_sequence_distribution(target, prompt, sampling, 2), VOCAB)
  stop = int(np.argmax(marginals[0] + marginals[1]))
  sampling = dataclasses.replace(sampling, stop_token_ids=(stop,))
  trees = ((2, 1),)
  script = [2, (2, 1), 0, 1, (2, 1), 2, 0, 2, 1, (2, 1)]
  out = generate(target, [prompt] * NUM_SAMPLES, sampling=sampling, rng=jax.random.key(7),
                 drafter=noisy_drafter,
                 engine=EngineConfig(page_size=4, num_slots=NUM_SAMPLES, compaction=True,
                                     compaction_min_width=2048),
                 spec=SpecConfig(num_draft_tokens=2, adaptive=True, rounds_per_decision=1,
                                 adaptive_trees=trees),
                 controller=ScriptedController(2, trees, script))
  rounds = out.stats["compaction"]["rounds_by_width"]
  assert rounds[0] > 0 and sum(rounds[1:]) > 0, out.stats["compaction"]
  assert len(out.stats["draft_schedule_by_width"]) > 1
  shapes = {s for s, _ in out.stats["draft_length_schedule"]}
  assert {0, 1, 2, (2, 1)} <= shapes
  exact = testing.enumerate_sequence_distribution(target, prompt, sampling, MAX_NEW_SAMPLED)
  testing.assert_joint_matches(out.tokens, out.lengths, exact, name="adaptive+compaction")
  testing.assert_per_position_matches(out.tokens, testing.marginals_from_joint(exact, VOCAB),
                                      name="adaptive+compaction")
  np.testing.assert_allclose(
      out.logprobs[:256], testing.response_log_probs(
          target, [prompt] * 256, out.tokens[:256], out.lengths[:256], sampling), atol=1e-4)
