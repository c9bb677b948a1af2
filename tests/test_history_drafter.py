"""The rollout-history drafter proposes what earlier rollouts of the same prompt wrote,
and speculative decoding with it stays exactly lossless.

What must hold:
  - alone and with a learned fallback, chains and trees, sampled output follows the
    exact joint distribution of plain sampling (chi-square against an enumerated tiny
    target), with earlier rollouts, siblings in the slots and the in-loop table of
    finished rollouts all in play, and both sources proposing;
  - at temperature 0 the output is token-identical to plain greedy decoding, and once a
    prompt's rollouts are known every draft of a repeat is accepted;
  - a round proposes what a sibling ahead wrote, or a finished sibling whose slot was
    reused, or an earlier call's rollout, never another prompt's; matches too short
    defer to the fallback; per-source counters add up;
  - the one-pass matcher gives the n-gram drafter's q, and deeper tree levels extend
    their parents' matches exactly;
  - the store keeps each prompt's newest rollouts and the most recently updated
    prompts, in arrays whose size never changes, however long the run.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specrl_jax import drafters, testing
from specrl_jax.config import ConfigError, SamplingParams, SpecConfig
from specrl_jax.sampling.engine import EngineConfig
from specrl_jax.speculative.generate import generate
from specrl_jax.speculative.drafters.base import RoundInputs, TreeLevel
from specrl_jax.speculative.drafters.history import (SOURCE_FALLBACK, SOURCE_HISTORY,
                                                     SOURCE_NONE, History)
from specrl_jax.speculative.drafters.history_store import (HistoryConfig, HistoryStore,
                                                           prompt_key, prompt_keys)
from specrl_jax.speculative.drafters.matching import (extend_runs, longest_match_log_probs,
                                                      suffix_runs)
from specrl_jax.speculative.verify import Verdict
from conftest import TINY_TARGET

TARGET_CONFIG = TINY_TARGET
VOCAB = TARGET_CONFIG.vocab_size
NUM_SAMPLES = 20_000
MAX_NEW = 6
JOINT_LENGTH = 3
ENGINE = EngineConfig(page_size=4, num_slots=1024)
# A small bank (4 rollouts of the prompt) so that some contexts have no long match and
# the fallback gets its turn.
SMALL = dict(rollouts_per_prompt=4, rollout_tokens=24, siblings=2, finished_rollouts=8)


@dataclasses.dataclass(frozen=True)
class Run:
  tokens: np.ndarray
  lengths: np.ndarray
  draft_rounds: int
  per_position_acceptance: np.ndarray
  history: dict[str, float]  # the History drafter's per-source statistics


@dataclasses.dataclass(frozen=True)
class _Output:
  """What ``observe`` reads of a GenerateOutput."""
  tokens: np.ndarray
  lengths: np.ndarray


def run(model, prompts, *, sampling, drafter=None, spec=None, engine=ENGINE, seed=0) -> Run:
  out = generate(model, prompts, sampling=sampling, rng=jax.random.key(seed), drafter=drafter,
                 spec=spec, engine=engine)
  return Run(tokens=out.tokens, lengths=out.lengths,
             draft_rounds=out.stats.get("draft_rounds", 0),
             per_position_acceptance=np.asarray(out.stats["per_position_acceptance"]),
             history=out.stats.get("drafter", {}) if isinstance(drafter, History) else {})


@pytest.fixture(scope="module")
def fallback(noisy_drafter):
  return noisy_drafter


@pytest.fixture(scope="module")
def prompt(target):
  seed = [1, 2, 3]
  return seed + testing.greedy_reference(target, [seed], 4)[0]


@pytest.fixture(scope="module")
def earlier_rollouts(target, prompt):
  """An earlier epoch: 64 samples of the prompt's first tokens, drawn from the exact joint
  (no compiled program needed)."""
  exact = testing.enumerate_sequence_distribution(
      target, prompt, SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW), JOINT_LENGTH)
  outcomes = list(exact)
  probs = np.asarray([exact[o] for o in outcomes])
  picks = np.random.default_rng(7).choice(len(outcomes), 64, p=probs / probs.sum())
  tokens = np.full((64, MAX_NEW), -1, np.int32)
  lengths = np.zeros(64, np.int32)
  for row, pick in enumerate(picks):
    tokens[row, :len(outcomes[pick])] = outcomes[pick]
    lengths[row] = len(outcomes[pick])
  return [prompt] * 64, _Output(tokens, lengths)


# --- exactness: sampled output follows the target's joint distribution --------------

CELLS = {
    "alone-chain-sample": (dict(), SpecConfig(num_draft_tokens=3), dict(temperature=1.0)),
    "alone-tree-greedy-stop": (dict(max_match=3), SpecConfig(tree=(2, 2, 1), draft_mode="greedy"),
                               dict(temperature=0.6, top_k=4)),
    "fallback-tree-sample": (dict(min_match=3), SpecConfig(tree=(2, 2, 1)),
                             dict(temperature=1.0, top_p=0.9)),
}


@pytest.mark.parametrize("cell", list(CELLS))
def test_sampled_output_follows_the_exact_joint_distribution(cell, target, fallback, prompt,
                                                             earlier_rollouts):
  options, spec, warp = CELLS[cell]
  sampling = SamplingParams(max_new_tokens=MAX_NEW, **warp)
  exact = testing.enumerate_sequence_distribution(target, prompt, sampling, JOINT_LENGTH)
  if cell.endswith("stop"):
    marginals = testing.marginals_from_joint(exact, VOCAB)
    stop = int(np.argmin(np.abs(marginals[1] - 0.15)))
    sampling = dataclasses.replace(sampling, stop_token_ids=(stop,))
    exact = testing.enumerate_sequence_distribution(target, prompt, sampling, JOINT_LENGTH)
  drafter = History(fallback if cell.startswith("fallback") else None, **SMALL, **options)
  drafter.observe(*earlier_rollouts)

  out = run(target, [prompt] * NUM_SAMPLES, sampling=sampling, drafter=drafter, spec=spec)

  testing.assert_joint_matches(out.tokens, out.lengths, exact, name=cell)
  testing.assert_per_position_matches(out.tokens, testing.marginals_from_joint(exact, VOCAB),
                                      name=cell)
  # Both verification outcomes happened, and the history proposed (a fallback too).
  assert 0 < out.per_position_acceptance[0] < 1, cell
  assert out.history["history_rounds"] > 0, out.history
  if cell.startswith("fallback"):
    assert out.history["fallback_rounds"] > 0, out.history
    assert out.history["silent_rounds"] == 0, out.history
  assert (out.history["history_rounds"] + out.history["fallback_rounds"]
          + out.history["silent_rounds"]) == out.draft_rounds


# --- temperature 0: identical to plain greedy, repeats fully predicted ---------------

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16)
GREEDY_PROMPTS = [[5], [3, 10, 11], [9, 2, 6, 5], [1, 2, 3, 4, 5, 6, 7, 8], [3, 10, 11]]
GREEDY_ENGINE = EngineConfig(page_size=4, num_slots=3)
CHAIN = SpecConfig(num_draft_tokens=3)
LONG = dict(max_match=8, rollout_tokens=32)


@pytest.fixture(scope="module")
def greedy_reference(target):
  return np.asarray(testing.greedy_reference(target, GREEDY_PROMPTS, GREEDY.max_new_tokens))


@pytest.mark.parametrize("with_fallback", [False, True], ids=["alone", "fallback"])
def test_greedy_output_is_plain_greedy_and_known_prompts_are_fully_drafted(
    with_fallback, target, fallback, greedy_reference):
  drafter = History(fallback if with_fallback else None, min_match=2, **LONG)
  first = run(target, GREEDY_PROMPTS, sampling=GREEDY, drafter=drafter, spec=CHAIN,
              engine=GREEDY_ENGINE)
  np.testing.assert_array_equal(first.tokens, greedy_reference)
  drafter.observe(GREEDY_PROMPTS, first)

  again = run(target, GREEDY_PROMPTS, sampling=GREEDY, drafter=drafter, spec=CHAIN,
              engine=GREEDY_ENGINE)
  np.testing.assert_array_equal(again.tokens, greedy_reference)
  # Every round of every request drafts from the bank and every draft is accepted: the
  # 15 tokens after the first take ceil(15 / 4) = 4 rounds per request.
  rounds = 4 * len(GREEDY_PROMPTS)
  assert again.history["history_rounds"] == again.draft_rounds == rounds
  assert again.history["history_acceptance_length"] == 4.0
  assert again.history["fallback_rounds"] == 0


# --- which rollouts a round searches (one round on hand-made slot rows) -------------

PROMPT, OTHER_PROMPT = [1, 2, 3], [7, 3]
ROUND_SAMPLING = SamplingParams(temperature=1.0)


def round_inputs(rows, requests, active=None):
  """RoundInputs for slots holding (prompt, response) rows (None: a free, empty slot)."""
  history = np.full((len(rows), 16), -1, np.int32)
  prompt_lengths, cache_lengths = np.zeros(len(rows), np.int32), np.zeros(len(rows), np.int32)
  for slot, row in enumerate(rows):
    if row is not None:
      prompt, response = row
      history[slot, :len(prompt) + len(response)] = prompt + response
      prompt_lengths[slot] = len(prompt)
      cache_lengths[slot] = len(prompt) + len(response) - 1
  active = np.asarray(requests) >= 0 if active is None else np.asarray(active)
  return RoundInputs(last_token_N=history[np.arange(len(rows)), cache_lengths],
                     cache_lengths_N=cache_lengths, history_NxC=history, active_N=active,
                     prompt_lengths_N=prompt_lengths,
                     slot_request_N=np.asarray(requests, np.int32))


# One compiled program per call shape: eager dispatch would compile every small op.
@functools.partial(jax.jit, static_argnames="drafter")
def start_round(drafter, params, state, inputs):
  log_q, state, _, scratch = drafter.start(params, state, (), inputs, ROUND_SAMPLING,
                                           max_pending=4)
  return log_q, state, scratch


@functools.partial(jax.jit, static_argnames=("drafter", "depth"))
def extend_round(drafter, params, state, scratch, inputs, depth, tokens_NxW, paths_NxWxZ):
  width = tokens_NxW.shape[1]
  level = TreeLevel(depth=depth, tokens_NxW=tokens_NxW, paths_NxWxZ=paths_NxWxZ,
                    mask_WxJ=np.ones((width, width), bool), sampling=ROUND_SAMPLING)
  return drafter.extend(params, state, (), scratch, inputs, level)[0]


@functools.partial(jax.jit, static_argnames="drafter")
def finish_round(drafter, params, state, inputs, verdict):
  return drafter.finish(params, state, (), inputs, verdict, None)[0]


def root_tokens(log_q_NxV) -> list[list[int]]:
  """The tokens each slot's root q proposes."""
  return [np.flatnonzero(np.isfinite(row)).tolist() for row in np.asarray(log_q_NxV)]


def test_a_sibling_ahead_is_continued_and_other_prompts_are_never_read():
  drafter = History(max_match=2, siblings=2).bind(TARGET_CONFIG)
  inputs = round_inputs([(PROMPT, [4, 5, 6]), (PROMPT, [4]), (OTHER_PROMPT, [4, 9])],
                        requests=[0, 1, 2])
  log_q, state, scratch = start_round(drafter, drafter.params(), drafter.init_state(3), inputs)
  # Slot 1 ends in "3 4": its sibling continued with 5; the other prompt's "3 4 9" and
  # slot 1's own unfinished row propose nothing.
  # Nothing followed "5 6" or "4 9" anywhere: those slots propose nothing.
  assert root_tokens(log_q) == [[], [5], []]
  level_q = extend_round(drafter, drafter.params(), state, scratch, inputs, 1,
                         np.full((3, 1), 5, np.int32), np.full((3, 1, 1), 5, np.int32))
  assert root_tokens(level_q[:, 0])[1] == [6]
  np.testing.assert_array_equal(state.root_source_N, [SOURCE_NONE, SOURCE_HISTORY, SOURCE_NONE])


def test_a_finished_rollout_whose_slot_is_reused_is_kept_for_its_siblings():
  drafter = History(max_match=2, siblings=2).bind(TARGET_CONFIG)
  # Round 1: slot 0 serves request 0 (about to emit 6 and 7), slot 1 is free.
  first = round_inputs([(PROMPT, [4, 5]), None], requests=[0, -1])
  _, state, _ = start_round(drafter, drafter.params(), drafter.init_state(2), first)
  verdict = Verdict(path_NxZ=np.asarray([[1, -1], [-1, -1]], np.int32),
                    num_accepted_N=np.asarray([1, 0], np.int32),
                    tokens_NxE=np.asarray([[6, 7, 0], [0, 0, 0]], np.int32),
                    log_probs_NxE=np.zeros((2, 3), np.float32))
  state = finish_round(drafter, drafter.params(), state, first, verdict)
  # "4 5" had never been seen: a silent round.
  assert state.counters["silent_rounds"] == 1 and state.counters["history_rounds"] == 0
  # Round 2: request 0 ended; slot 0 now serves its sibling, request 1.
  second = round_inputs([(PROMPT, [4, 5]), None], requests=[1, -1])
  log_q, state, _ = start_round(drafter, drafter.params(), state, second)
  assert root_tokens(log_q)[0] == [6]
  assert int(state.finished.clock) == 1


def test_the_bank_holds_earlier_calls_and_the_fallback_covers_short_matches():
  fallback = drafters.NGram(n=1)
  drafter = History(fallback, max_match=3, min_match=2).bind(TARGET_CONFIG)
  assert drafter.known_fraction([PROMPT, OTHER_PROMPT]) == 0.0
  drafter.observe([PROMPT], _Output(np.asarray([[4, 8, 2]]), np.asarray([3])))
  assert drafter.known_fraction([PROMPT, OTHER_PROMPT, PROMPT]) == 0.5
  inputs = round_inputs([(PROMPT, [4]), (OTHER_PROMPT, [4, 9, 4])], requests=[0, 1])
  log_q, state, _ = start_round(drafter, drafter.params(), drafter.init_state(2), inputs)
  # Slot 0 continues "2 3 4" as the earlier rollout did; slot 1 matches one token only,
  # so its q is the fallback's (the n-gram's: "4" was followed by 9).
  assert root_tokens(log_q)[0] == [8]
  fallback_q, _, _ = start_round(fallback.bind(TARGET_CONFIG), (), (), inputs)
  np.testing.assert_array_equal(np.asarray(log_q)[1], np.asarray(fallback_q)[1])
  np.testing.assert_array_equal(state.root_source_N, [SOURCE_HISTORY, SOURCE_FALLBACK])


def largest_ngram_reference(history_NxC, lengths_N, context_NxWxL, vocab_size: int, max_n: int,
                            min_n: int):
  """The matcher's specification, one n at a time: log q [N, W, V] over the token that
  followed earlier occurrences of the context's last n tokens in the history, for the
  largest n in [min_n, max_n] that occurs.

  Occurrences are weighted by recency (1 + position / C) so the most recent
  continuation wins ties, as in serving engines' prompt-lookup drafting. Rows with no
  occurrence get -inf everywhere (nothing to propose).
  """
  num_slots, context = history_NxC.shape
  width = context_NxWxL.shape[1]
  log_q = jnp.full((num_slots, width, vocab_size), -jnp.inf)
  found_NxW = jnp.zeros((num_slots, width), bool)
  slot_NxWxC = jnp.broadcast_to(jnp.arange(num_slots)[:, None, None], (num_slots, width, context))
  node_NxWxC = jnp.broadcast_to(jnp.arange(width)[None, :, None], (num_slots, width, context))
  for n in range(max_n, min_n - 1, -1):
    starts = context - n
    windows_NxSxn = jnp.stack([history_NxC[:, i:i + starts] for i in range(n)], axis=-1)
    suffix_NxWxn = context_NxWxL[:, :, -n:]
    match_NxWxS = jnp.all(windows_NxSxn[:, None] == suffix_NxWxn[:, :, None], axis=-1)
    match_NxWxS &= jnp.all(suffix_NxWxn >= 0, axis=-1)[..., None]
    start_S = jnp.arange(starts)
    # The continuation must itself be in the history.
    match_NxWxS &= (start_S[None, None, :] + n) < lengths_N[:, None, None]
    weight_NxWxS = match_NxWxS * (1.0 + start_S / context)
    next_NxS = history_NxC[:, n:n + starts]
    counts = jnp.zeros((num_slots, width, vocab_size)).at[
        slot_NxWxC[..., :starts], node_NxWxC[..., :starts],
        jnp.broadcast_to(jnp.maximum(next_NxS, 0)[:, None], match_NxWxS.shape)].add(weight_NxWxS)
    total = jnp.sum(counts, axis=-1, keepdims=True)
    level_log_q = jnp.where(counts > 0, jnp.log(counts / jnp.where(total > 0, total, 1.0)),
                            -jnp.inf)
    use_NxW = ~found_NxW & (total[..., 0] > 0)
    log_q = jnp.where(use_NxW[..., None], level_log_q, log_q)
    found_NxW |= use_NxW
  return log_q


def test_the_matcher_proposes_the_continuations_of_the_largest_matching_ngram():
  # One pass over match lengths gives the q of trying n = max_n .. min_n in turn (one
  # slot's history, -1 past its length); a small alphabet makes long matches common.
  rng = np.random.default_rng(0)
  history = rng.integers(0, 4, (16, 40)).astype(np.int32)
  lengths = rng.integers(1, 41, 16).astype(np.int32)
  history[np.arange(40)[None, :] >= lengths[:, None]] = -1
  context = rng.integers(-1, 4, (16, 5, 6)).astype(np.int32)
  for max_n, min_n in [(1, 1), (3, 1), (6, 2)]:
    expected = jax.jit(largest_ngram_reference, static_argnums=(3, 4, 5))(
        history, lengths, context, 7, max_n, min_n)
    actual = jax.jit(longest_match_log_probs, static_argnums=(2, 3, 4))(history, context, 7,
                                                                        max_n, min_n)
    np.testing.assert_array_equal(np.isfinite(actual), np.isfinite(expected))
    np.testing.assert_allclose(np.exp(actual), np.exp(expected), atol=1e-6)
    assert np.isfinite(expected).any()


def test_deeper_tree_levels_extend_their_parents_matches():
  # Two parents with two children each: extending the parents' runs by the children's
  # tokens equals matching the children's whole contexts from scratch.
  rng = np.random.default_rng(1)
  sources = rng.integers(-1, 3, (8, 60)).astype(np.int32)
  parents = rng.integers(0, 3, (8, 2, 7)).astype(np.int32)
  children = rng.integers(0, 3, (8, 4)).astype(np.int32)
  contexts = np.concatenate([np.repeat(parents, 2, axis=1), children[..., None]], axis=-1)
  sources[:, 10:18] = contexts[:, 0]  # a run as long as the context, so the cap binds
  for max_n in (1, 4, 7):
    extended = extend_runs(sources, suffix_runs(sources, parents, max_n), children, max_n)
    np.testing.assert_array_equal(extended, suffix_runs(sources, contexts, max_n))
    assert np.asarray(extended).max() == max_n


# --- the store: newest rollouts, bounded memory -----------------------------------

def test_prompt_keys_agree_on_host_and_device():
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 50_000, rng.integers(1, 40)).tolist() for _ in range(64)]
  rows = np.full((len(prompts), 48), -1, np.int32)
  for row, prompt in zip(rows, prompts):
    row[:len(prompt)] = prompt
    row[len(prompt):len(prompt) + 3] = 7  # response tokens are not part of the key
  lengths = np.asarray([len(p) for p in prompts], np.int32)
  device = np.asarray(jax.jit(prompt_keys)(rows, lengths))
  np.testing.assert_array_equal(device, [prompt_key(p) for p in prompts])
  assert len(set(device.tolist())) == len(prompts)
  assert prompt_key([1, 2]) != prompt_key([1, 2, 0])


def test_the_store_keeps_the_newest_rollouts_of_each_prompt():
  store = HistoryStore(HistoryConfig(rollouts_per_prompt=3, rollout_tokens=12, max_match=2))
  for index in range(5):
    store.add([4, 5, 6], [index, index + 1])
  store.add([8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
  assert store.responses([4, 5, 6]) == [[2, 3], [3, 4], [4, 5]]
  # Prompt tail (1 token) + 10 response tokens + the empty end fill the 12 columns.
  assert store.responses([8]) == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
  assert store.responses([4, 5]) == []


def test_the_store_evicts_the_prompt_updated_longest_ago():
  store = HistoryStore(HistoryConfig(max_prompts=2, rollout_tokens=8, max_match=2))
  store.add([1], [10])
  store.add([2], [20])
  store.add([1], [11])  # prompt [1] is now the most recently updated
  store.add([3], [30])
  assert store.responses([2]) == []
  assert store.responses([1]) == [[10], [11]]
  assert store.responses([3]) == [[30]]
  assert len(store) == 2


def test_memory_stays_within_the_configured_bound_over_a_long_run():
  config = HistoryConfig(max_prompts=16, rollouts_per_prompt=4, rollout_tokens=24)
  drafter = History(config=config).bind(TARGET_CONFIG)
  bound = config.bank_bytes
  rng = np.random.default_rng(0)
  pool = [rng.integers(0, VOCAB, rng.integers(1, 10)).tolist() for _ in range(100)]
  for step in range(200):
    prompts = [pool[i] for i in rng.integers(0, len(pool), 8) for _ in range(4)]
    tokens = rng.integers(0, VOCAB, (len(prompts), 40)).astype(np.int32)
    lengths = rng.integers(1, 41, len(prompts)).astype(np.int32)
    drafter.observe(prompts, _Output(tokens, lengths))
    assert drafter.store.nbytes == bound
    assert len(drafter.store) <= config.max_prompts
  bank = drafter.params()["bank"]
  assert sum(x.nbytes for x in jax.tree.leaves(bank)) == bound
  # The last step's prompts are all held, with their newest rollouts.
  for prompt in prompts[-4:]:
    assert len(drafter.store.responses(prompt)) == config.rollouts_per_prompt


# --- bad inputs ---------------------------------------------------------------------

@pytest.mark.parametrize("fields,fragment", [
    (dict(min_match=5, max_match=4), "min_match=5"),
    (dict(rollout_tokens=4, max_match=4), "rollout_tokens=4"),
    (dict(max_prompts=0), "max_prompts=0"),
    (dict(siblings=-1), "siblings=-1"),
])
def test_malformed_configs_name_the_field(fields, fragment):
  with pytest.raises(ConfigError, match=fragment):
    HistoryConfig(**fields)


def test_short_matches_defer_to_a_fallback_by_default():
  assert History().config.min_match == 1
  assert History(drafters.NGram(n=2), max_match=12).config.min_match == 6


def test_unknown_options_and_mismatched_fallbacks_are_rejected(target):
  with pytest.raises(ConfigError, match="unknown option"):
    History(min_matches=3)
  other = testing.peaked_random_model(TARGET_CONFIG.replace(vocab_size=VOCAB + 1), seed=1)
  with pytest.raises(ConfigError, match="vocab_size"):
    History(drafters.DraftModel(other)).bind(target.config)
