"""Slot compaction: once few sequences are live, the engine continues them in narrower
compiled programs, and nothing a request decodes changes.

What must hold: the widths are the slot count then powers of two down to the minimum;
greedy output, plain and speculative (a drafter with its own KV cache, and one without
state), is token-identical with and without compaction, with one slot per request,
fewer slots than requests (continuous and static batching), ragged prompts and a stop
token; sampled outputs keep the exact joint distribution when compaction happens
between the sampled tokens; every reported log-prob is the full-forward one (the
gathered page-table rows point at the right pages); the stats say how many rounds ran
at each width and with how many live slots; bad options are refused by name.
"""

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specrl_jax import drafters, parallel, testing
from specrl_jax.config import ConfigError, SamplingParams, SpecConfig
from specrl_jax.sampling.compaction import stage_widths
from specrl_jax.sampling.engine import EngineConfig
from specrl_jax.speculative.drafters.base import Drafter
from specrl_jax.speculative.drafters.history import History
from specrl_jax.speculative.generate import generate
from conftest import TINY_TARGET

CONFIG = TINY_TARGET
VOCAB = CONFIG.vocab_size
# Ragged: one token, within a page of 4, exactly a page, across pages, and repeats.
PROMPTS = [[5], [3, 10, 11], [9, 2, 6, 5], [1, 2, 3, 4, 5, 6, 7, 8],
           [11, 0, 1, 2, 4, 4, 9, 10, 1], [3, 10, 11], [1, 2, 3, 4, 5, 6, 7, 8]]
MAX_NEW = 12
ENGINES = {
    "slot_per_request": EngineConfig(page_size=4, compaction=True),
    "3_slots_continuous": EngineConfig(page_size=4, num_slots=3, compaction=True),
    "3_slots_static": EngineConfig(page_size=4, num_slots=3, continuous_batching=False,
                                   compaction=True),
}




@pytest.fixture(scope="module")
def stop_token(target) -> int:
  """A token greedy decoding emits in some responses but not all: lengths are ragged
  and sequences end at different rounds, so the batch narrows mid-rollout."""
  responses = testing.greedy_reference(target, PROMPTS, MAX_NEW)
  rows = collections.Counter(t for response in responses for t in set(response))
  return [t for t, count in rows.most_common() if count < len(PROMPTS)][0]


@pytest.fixture(scope="module")
def greedy_plain(target, stop_token):
  sampling = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW,
                            stop_token_ids=(stop_token,))
  out = generate(target, PROMPTS, sampling=sampling, engine=EngineConfig(page_size=4))
  assert len(set(out.lengths.tolist())) > 2
  return out


def test_widths_are_the_slot_count_then_powers_of_two_down_to_the_minimum():
  assert stage_widths(8, 1) == (8, 4, 2, 1)
  assert stage_widths(12, 2) == (12, 8, 4, 2)
  assert stage_widths(3, 1) == (3, 2, 1)
  assert stage_widths(1, 1) == (1,)
  assert stage_widths(64, 16) == (64, 32, 16)
  assert stage_widths(8, 0) == (8,)  # compaction off


def assert_compacted(out, num_slots):
  """Rounds ran at the full width and at narrower ones, and the counts add up."""
  stats = out.stats
  compaction = stats["compaction"]
  assert compaction["widths"][0] == num_slots
  rounds = compaction["rounds_by_width"]
  assert sum(rounds) == stats["target_calls"] == sum(stats["rounds_by_live"])
  assert sum(r > 0 for r in rounds[1:]) >= 1, compaction
  assert 0 < compaction["tail_round_share"] < 1
  assert len(compaction["seconds_by_width"]) == len(rounds)
  # Every token was emitted at some width; the narrower ones emitted the tail's.
  assert sum(compaction["tokens_by_width"]) == int(out.lengths.sum())
  assert all(t > 0 for t, r in zip(compaction["tokens_by_width"], rounds) if r)
  assert 0 <= compaction["tail_time_share"] <= 1
  # Up to every slot live, but never more slots than requests (padding is never live).
  assert len(stats["rounds_by_live"]) == min(num_slots, len(stats["request_rounds"])) + 1


@pytest.mark.parametrize("engine", ENGINES.values(), ids=ENGINES.keys())
def test_greedy_plain_decoding_with_compaction_is_token_identical(target, stop_token,
                                                                  greedy_plain, engine):
  sampling = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW,
                            stop_token_ids=(stop_token,))
  out = generate(target, PROMPTS, sampling=sampling, engine=engine)
  np.testing.assert_array_equal(out.tokens, greedy_plain.tokens)
  np.testing.assert_array_equal(out.lengths, greedy_plain.lengths)
  np.testing.assert_array_equal(out.stats["request_rounds"], out.lengths - 1)
  assert_compacted(out, engine.num_slots or 8)  # 7 requests: 8 slots once bucketed


@pytest.mark.parametrize("drafter,spec", [
    ("noisy", SpecConfig(num_draft_tokens=3)),   # its own KV cache: per-slot state
    ("ngram", SpecConfig(tree=(2, 2))),          # no state
    ("history", SpecConfig(num_draft_tokens=3)),  # per-slot rows and a cached fallback
], ids=["draft_model-chain3", "ngram-tree22", "history-fallback-chain3"])
def test_greedy_speculation_with_compaction_is_token_identical(target, noisy_drafter, stop_token,
                                                               greedy_plain, drafter, spec):
  sampling = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW,
                            stop_token_ids=(stop_token,))
  chosen = {"noisy": noisy_drafter, "ngram": drafters.NGram(n=2),
            "history": History(noisy_drafter, min_match=2, siblings=2)}[drafter]
  engine = ENGINES["3_slots_continuous"]
  out = generate(target, PROMPTS, sampling=sampling, drafter=chosen, spec=spec, engine=engine)
  np.testing.assert_array_equal(out.tokens, greedy_plain.tokens)
  np.testing.assert_array_equal(out.logprobs, greedy_plain.logprobs)
  assert_compacted(out, 3)
  assert out.stats["acceptance_length"] > 1


def test_batch_shards_compact_on_their_own_and_decode_what_one_device_decodes(
    target, stop_token, greedy_plain):
  # Two shards of (4, 3) requests, each compacting inside one compiled program.
  sampling = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW,
                            stop_token_ids=(stop_token,))
  mesh = parallel.make_mesh((2, 1, 1), devices=jax.devices()[:2])
  out = generate(target, PROMPTS, sampling=sampling, engine=ENGINES["slot_per_request"],
                 mesh=mesh)
  np.testing.assert_array_equal(out.tokens, greedy_plain.tokens)
  rounds = out.stats["compaction"]["rounds_by_width"]
  assert out.stats["compaction"]["widths"] == [4, 2, 1]
  assert sum(rounds) == out.stats["target_calls"] and sum(rounds[1:]) > 0


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_sampled_log_probs_with_compaction_are_the_full_forward_ones(target, noisy_drafter,
                                                                     speculative):
  # Any gathered page-table row or cache length out of place would change a token's
  # context, and with it its log-prob under the full forward.
  sampling = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, stop_token_ids=(7,))
  engine = EngineConfig(page_size=4, num_slots=4, compaction=True)
  prompts = PROMPTS * 3
  kwargs = dict(drafter=noisy_drafter, spec=SpecConfig(num_draft_tokens=2)) if speculative else {}
  out = generate(target, prompts, sampling=sampling, rng=jax.random.key(4), engine=engine,
                 **kwargs)
  assert_compacted(out, 4)
  np.testing.assert_allclose(
      out.logprobs, testing.response_log_probs(target, prompts, out.tokens, out.lengths,
                                               sampling), atol=1e-4)


# --- sampled distributions ----------------------------------------------------------

# One slot per request, so every sequence decodes while the batch narrows: the stop
# token ends most responses within a few tokens and the live slots halve and halve again
# between the sampled tokens of the others.
NUM_SAMPLES = 8192
MAX_NEW_SAMPLED = 5  # with top-k 3 the joint of whole responses is enumerable (3^5)


def likely_early_stop(target, prompt, sampling) -> int:
  marginals = testing.marginals_from_joint(
      testing.enumerate_sequence_distribution(target, prompt, sampling, 2), VOCAB)
  return int(np.argmax(marginals[0] + marginals[1]))


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_sampled_tokens_follow_the_exact_joint_distribution_while_compacting(
    target, noisy_drafter, speculative):
  prompt = [1, 2, 3, 4, 5]  # a partly filled second page
  sampling = SamplingParams(temperature=1.0, top_k=3, max_new_tokens=MAX_NEW_SAMPLED)
  sampling = dataclasses.replace(sampling,
                                 stop_token_ids=(likely_early_stop(target, prompt, sampling),))
  engine = EngineConfig(page_size=4, num_slots=NUM_SAMPLES, compaction=True,
                        compaction_min_width=2048)
  kwargs = (dict(drafter=noisy_drafter, spec=SpecConfig(num_draft_tokens=2, draft_mode="sample"))
            if speculative else {})
  out = generate(target, [prompt] * NUM_SAMPLES, sampling=sampling, rng=jax.random.key(5),
                 engine=engine, **kwargs)
  rounds = out.stats["compaction"]["rounds_by_width"]
  assert rounds[0] > 0 and sum(rounds[1:]) > 0, out.stats["compaction"]  # narrowed mid-response
  exact = testing.enumerate_sequence_distribution(target, prompt, sampling, MAX_NEW_SAMPLED)
  testing.assert_joint_matches(out.tokens, out.lengths, exact)
  testing.assert_per_position_matches(out.tokens, testing.marginals_from_joint(exact, VOCAB))
  if speculative:
    assert 0 < out.stats["per_position_acceptance"][0] < 1


# --- options and drafters -------------------------------------------------------------

@pytest.mark.parametrize("fields,fragment", [
    (dict(compaction=1), "compaction=1"),
    (dict(compaction_min_width=3), "compaction_min_width=3"),
    (dict(compaction_min_width=0), "compaction_min_width=0"),
])
def test_bad_compaction_options_name_the_field(fields, fragment):
  with pytest.raises(ConfigError, match=f"EngineConfig.{fragment}"):
    EngineConfig(**fields)


def test_the_history_drafter_keeps_the_rollouts_of_the_slots_compaction_drops():
  drafter = History(max_match=2, siblings=2).bind(CONFIG)
  state = drafter.init_state(4)
  # Slots 0 and 3 stay; 1 served request 1 (ended), 2 never served one.
  state = state.replace(request_N=jnp.asarray([3, 1, -1, 2]),
                        keys_N=jnp.asarray([7, 8, 0, 9], jnp.uint32),
                        rows_NxL=jnp.arange(4)[:, None] + jnp.zeros_like(state.rows_NxL))
  narrow = drafter.compact_state(state, jnp.asarray([0, 3]))
  np.testing.assert_array_equal(narrow.request_N, [3, 2])
  np.testing.assert_array_equal(narrow.keys_N, [7, 9])
  np.testing.assert_array_equal(narrow.rows_NxL[:, 0], [0, 3])
  # Slot 1's finished rollout stays searchable by its siblings; slot 2 never had one.
  kept_U = np.asarray(narrow.finished.stamps_U) >= 0
  assert kept_U.sum() == 1
  assert np.asarray(narrow.finished.keys_U)[kept_U].tolist() == [8]
  assert (np.asarray(narrow.finished.rows_UxL)[kept_U] == 1).all()


class _SlotCounter(Drafter):
  """A drafter with per-slot state that does not say how to compact it."""

  def init_state(self, num_slots):
    return {"seen_N": np.zeros((num_slots,), np.int32)}

  def start(self, params, state, kv, inputs, sampling, max_pending):
    raise AssertionError("never drafts: compaction is refused first")

  def extend(self, *args):
    raise AssertionError("never drafts")


def test_a_drafter_with_per_slot_state_and_no_compact_state_is_refused(target):
  with pytest.raises(NotImplementedError, match="_SlotCounter.*compact_state.*compaction=False"):
    _SlotCounter().compact_state({"seen_N": np.zeros(4)}, np.arange(2))
