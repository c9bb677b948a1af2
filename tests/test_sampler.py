"""The paged sampler (plain decoding) against full-forward references.

What must hold: greedy output is what a loop recomputing the whole forward each step
produces; every reported log-prob is the full-forward warped log-prob of the emitted
token (ragged prompts, across page boundaries, with and without continuous batching,
with fewer slots than requests); identical prompts share pages without changing
anything; sampled tokens follow the exactly enumerated warped distribution; stop
tokens end sequences; drafters read each slot's prompt and emitted tokens, kept after
the slot is freed; bad inputs fail with errors that say what to change.
"""

import collections

import jax
import numpy as np
import pytest
from flax import nnx

from specrl_jax import testing
from specrl_jax.config import ConfigError, ModelConfig, SamplingParams
from specrl_jax.sampling import rollout as stages
from specrl_jax.sampling.engine import EngineConfig, is_done
from specrl_jax.sampling.plan import plan_for_prompts
from specrl_jax.speculative.generate import PagePoolExhaustedError, generate

VOCAB = 16
CONTEXT = 64
# Ragged prompts: one token, shorter / equal / longer than a page of 4, and repeats of
# a page-aligned prompt and of one with a partly filled last page (prefix sharing).
PROMPTS = [[5], [3, 14, 15], [9, 2, 6, 5], [3, 5, 8, 9, 7], [1, 2, 3, 4, 5, 6, 7, 8],
           [11, 0, 13, 2, 4, 4, 12, 10, 1], [3, 14, 15], [1, 2, 3, 4, 5, 6, 7, 8],
           [11, 0, 13, 2, 4, 4, 12, 10, 1]]
MAX_NEW = 10
ENGINES = {
    "slot_per_request": EngineConfig(page_size=4),
    "3_slots_continuous": EngineConfig(page_size=4, num_slots=3),
    "3_slots_static": EngineConfig(page_size=4, num_slots=3, continuous_batching=False),
}


@pytest.fixture(scope="module")
def model():
  config = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=CONTEXT)
  return testing.peaked_random_model(config, seed=0)


@pytest.fixture(scope="module")
def greedy_stop_token(model) -> int:
  """A token greedy decoding emits for some prompts but not all, so responses end at
  different steps and freed slots get refilled mid-flight."""
  responses = testing.greedy_reference(model, PROMPTS, MAX_NEW)
  in_rows = collections.Counter(t for response in responses for t in set(response))
  partial = [t for t, rows in in_rows.most_common() if rows < len(PROMPTS)]
  return partial[0]


def assert_well_formed(out, num_requests: int, max_new_tokens: int, stops=()):
  """tokens -1 exactly after each length; a stop token, if any, is the last token."""
  assert out.tokens.shape == out.logprobs.shape == (num_requests, max_new_tokens)
  assert out.tokens.dtype == np.int32 and out.lengths.dtype == np.int32
  for row, length in zip(out.tokens, out.lengths):
    assert 1 <= length <= max_new_tokens
    assert (row[:length] >= 0).all() and (row[length:] == -1).all()
    stopped = np.isin(row[:length], stops)
    assert not stopped[:-1].any(), f"a stop token inside a response: {row}"
    assert stopped[-1] or length == max_new_tokens
  np.testing.assert_array_equal(out.logprobs[out.tokens < 0], 0.0)


@pytest.mark.parametrize("engine", ENGINES.values(), ids=ENGINES.keys())
def test_greedy_equals_a_loop_that_recomputes_the_full_forward(model, greedy_stop_token, engine):
  sampling = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW,
                            stop_token_ids=(greedy_stop_token,))
  out = generate(model, PROMPTS, sampling=sampling, engine=engine)
  expected = testing.greedy_reference(model, PROMPTS, MAX_NEW, (greedy_stop_token,))
  assert [row[:n].tolist() for row, n in zip(out.tokens, out.lengths)] == expected
  assert len(set(out.lengths.tolist())) > 1  # the stop token made lengths ragged
  assert_well_formed(out, len(PROMPTS), MAX_NEW, (greedy_stop_token,))
  np.testing.assert_array_equal(out.logprobs[out.tokens >= 0], 0.0)  # log 1
  # The first token comes with admission, then one per round the request decodes in.
  np.testing.assert_array_equal(out.stats["request_rounds"], out.lengths - 1)
  if engine.num_slots == 0:  # all decode from the first round: the longest sets the count
    assert out.stats["target_calls"] == out.stats["request_rounds"].max()


@pytest.mark.parametrize("engine", ENGINES.values(), ids=ENGINES.keys())
def test_log_probs_at_temperature_one_equal_the_full_forward_log_softmax(model, engine):
  sampling = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, stop_token_ids=(7,))
  out = generate(model, PROMPTS, sampling=sampling, rng=jax.random.key(1), engine=engine)
  assert_well_formed(out, len(PROMPTS), MAX_NEW, (7,))
  expected = testing.response_log_probs(model, PROMPTS, out.tokens, out.lengths, sampling)
  np.testing.assert_allclose(out.logprobs, expected, atol=1e-4)
  # Temperature 1 without top-k / top-p is the plain log-softmax of the model.
  plain = testing.response_log_probs(model, PROMPTS, out.tokens, out.lengths, SamplingParams())
  np.testing.assert_allclose(out.logprobs, plain, atol=1e-4)


def test_identical_prompts_share_pages_and_decode_like_distinct_prompts(model):
  # Eight samples of a 16-token prompt (4 pages of 4) need 1 trash + 4 shared prompt
  # pages + 1 page each for their responses = 13 pages; eight distinct prompts of the
  # same length would need 41. A pool of 16 pages therefore only fits when shared.
  sampling = SamplingParams(temperature=0.0, max_new_tokens=4)
  engine = EngineConfig(page_size=4, num_slots=8, num_pages=16)
  prompt = [int(t) for t in np.random.default_rng(0).integers(0, VOCAB, 16)]
  out = generate(model, [prompt] * 8, sampling=sampling, engine=engine)
  expected = testing.greedy_reference(model, [prompt], 4)[0]
  assert out.tokens.tolist() == [expected] * 8

  distinct = [[(t + shift) % VOCAB for t in prompt] for shift in range(8)]
  with pytest.raises(PagePoolExhaustedError, match="num_pages"):
    generate(model, distinct, sampling=sampling, engine=engine)


def test_running_out_of_pages_while_decoding_names_num_pages(model):
  # One page holds the prompt, but the response needs three more.
  with pytest.raises(PagePoolExhaustedError, match=r"3 pages .*EngineConfig\.num_pages"):
    generate(model, [[1, 2, 3, 4]], sampling=SamplingParams(max_new_tokens=12),
             engine=EngineConfig(page_size=4, num_pages=3))


# --- sampled distributions --------------------------------------------------------

DISTRIBUTION_PROMPT = [2, 7, 1, 8]
NUM_SAMPLES = 12_000


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=1.0, max_new_tokens=3),
    SamplingParams(temperature=0.8, top_k=4, max_new_tokens=3),
    SamplingParams(temperature=1.0, top_p=0.8, max_new_tokens=3),
], ids=["temperature_1", "top_k", "top_p"])
def test_samples_follow_the_exact_warped_joint_distribution(model, sampling):
  exact = testing.enumerate_sequence_distribution(model, DISTRIBUTION_PROMPT, sampling, 3)
  prompts = [DISTRIBUTION_PROMPT] * NUM_SAMPLES
  out = generate(model, prompts, sampling=sampling, rng=jax.random.key(2),
                 engine=EngineConfig(page_size=4, num_slots=2048))
  testing.assert_joint_matches(out.tokens, out.lengths, exact)
  testing.assert_per_position_matches(out.tokens, testing.marginals_from_joint(exact, VOCAB))
  np.testing.assert_allclose(
      out.logprobs, testing.response_log_probs(model, prompts, out.tokens, out.lengths, sampling),
      atol=1e-4)


def test_stop_tokens_end_sampled_sequences_with_the_exact_distribution(model):
  without_stop = SamplingParams(temperature=1.0, max_new_tokens=4)
  marginals = testing.marginals_from_joint(
      testing.enumerate_sequence_distribution(model, DISTRIBUTION_PROMPT, without_stop, 2), VOCAB)
  stop = int(np.argmax(marginals[1]))  # a likely second token: many sequences stop early
  sampling = SamplingParams(temperature=1.0, max_new_tokens=4, stop_token_ids=(stop,))
  exact = testing.enumerate_sequence_distribution(model, DISTRIBUTION_PROMPT, sampling, 4)
  out = generate(model, [DISTRIBUTION_PROMPT] * NUM_SAMPLES, sampling=sampling,
                 rng=jax.random.key(3), engine=EngineConfig(page_size=4, num_slots=2048))
  assert_well_formed(out, NUM_SAMPLES, 4, (stop,))
  assert (out.lengths < 4).mean() > 0.1
  testing.assert_joint_matches(out.tokens, out.lengths, exact)


def test_the_same_key_reproduces_a_sample_and_another_key_does_not(model):
  sampling = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, stop_token_ids=(7,))
  engine = ENGINES["3_slots_continuous"]
  first = generate(model, PROMPTS, sampling=sampling, rng=jax.random.key(1), engine=engine)
  again = generate(model, PROMPTS, sampling=sampling, rng=jax.random.key(1), engine=engine)
  other = generate(model, PROMPTS, sampling=sampling, rng=jax.random.key(2), engine=engine)
  np.testing.assert_array_equal(first.tokens, again.tokens)
  assert (first.tokens != other.tokens).any()


# --- errors ------------------------------------------------------------------------

@pytest.mark.parametrize("prompts,fragment", [
    ([], "non-empty list"),
    ([[1, 2], []], r"prompts\[1\] is empty"),
    ([[1, VOCAB]], f"token id {VOCAB} outside the vocabulary \\[0, {VOCAB}\\)"),
    ([[-1, 2]], "token id -1 outside the vocabulary"),
    ([[1] * (CONTEXT - 4)], f"exceeds the model's context of {CONTEXT}"),
], ids=["no_prompts", "empty_prompt", "token_too_large", "negative_token", "too_long"])
def test_bad_prompts_are_rejected_before_compiling(model, prompts, fragment):
  with pytest.raises(ValueError, match=fragment):
    generate(model, prompts, sampling=SamplingParams(max_new_tokens=8))


@pytest.mark.parametrize("fields,fragment", [
    (dict(temperature=-0.5), "temperature=-0.5"),
    (dict(top_k=-1), "top_k=-1"),
    (dict(top_p=0.0), "top_p=0.0"),
    (dict(top_p=1.5), "top_p=1.5"),
    (dict(max_new_tokens=0), "max_new_tokens=0"),
    (dict(stop_token_ids=[2]), r"stop_token_ids=\[2\]"),
    (dict(stop_token_ids=(-3,)), r"stop_token_ids=\(-3,\)"),
])
def test_bad_sampling_params_name_the_field(fields, fragment):
  with pytest.raises(ConfigError, match=f"SamplingParams.{fragment}"):
    SamplingParams(**fields)


@pytest.mark.parametrize("fields,fragment", [
    (dict(num_slots=-1), "num_slots=-1"),
    (dict(page_size=0), "page_size=0"),
    (dict(num_pages=1), "num_pages=1"),
])
def test_bad_engine_config_names_the_field(fields, fragment):
  with pytest.raises(ConfigError, match=f"EngineConfig.{fragment}"):
    EngineConfig(**fields)


def test_drafters_read_each_slot_prompt_then_its_emitted_tokens_and_a_freed_slot_keeps_them(
    model):
  """``DecodeState.history_NxC``, checked after every round of a continuously batched
  rollout: a slot shows its request's prompt, then the tokens emitted so far (a prefix
  of the final response), then -1; a freed slot still shows its last, whole rollout (the
  history drafter reads finished siblings there) until it takes the next request."""
  sampling = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW)
  graphdef, params = nnx.split(model)
  plan, inputs, _ = plan_for_prompts(model.config, PROMPTS, sampling=sampling,
                                     engine=EngineConfig(page_size=4, num_slots=3),
                                     rounds=None, mesh=None)
  tokens_UxT, lengths_U, prompt_of_request_R, _ = jax.device_get(inputs)
  state, prompts = stages.start(graphdef, params, (), inputs, jax.random.key(3),
                                 sampling=sampling, layout=plan.layout)
  snapshots = []
  while not bool(is_done(state, len(PROMPTS))):
    state, _ = stages.continue_stage(graphdef, params, (), state, prompts, np.int32(1),
                                      stage=0, sampling=sampling, layout=plan.layout)
    snapshots.append(jax.device_get((state.history_NxC, state.history_request_N,
                                     state.slot_request_N)))
    assert len(snapshots) < 100
  final_RxL = jax.device_get(state.out_tokens_RxL)

  freed = 0
  for history_NxC, history_request_N, slot_request_N in snapshots:
    for row_C, request, serving in zip(history_NxC, history_request_N, slot_request_N):
      if request < 0:
        assert (row_C == -1).all()
        continue
      prompt_index = prompt_of_request_R[request]
      prompt = tokens_UxT[prompt_index][:lengths_U[prompt_index]]
      np.testing.assert_array_equal(row_C[:len(prompt)], prompt)
      response = row_C[len(prompt):]
      emitted = int((response >= 0).sum())
      assert emitted >= 1 and (response[emitted:] == -1).all()
      np.testing.assert_array_equal(response[:emitted], final_RxL[request][:emitted])
      if serving < 0:
        freed += 1
        whole = final_RxL[request][final_RxL[request] >= 0]
        np.testing.assert_array_equal(response[:emitted], whole)
  assert freed, "no round saw a freed slot: the test shows nothing of it"
