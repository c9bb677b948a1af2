"""What ``sj.generate`` accepts, what it refuses, and that hostile-but-legal inputs
give correct results.

What must hold: every wrong argument fails on the host, before anything compiles, with
an error naming the argument and the bad value (nothing is coerced: a float prompt is
not truncated, a nested prompt not flattened); numpy integers and floats work wherever
Python numbers do; draft shapes that cannot compile in reasonable time are refused at
config time; every temperature > 0, however small, samples greedy's tokens with finite
log-probs, plainly and speculatively.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specrl_jax as sj
from specrl_jax import testing
from specrl_jax.config import ConfigError, SamplingParams, SpecConfig
from specrl_jax.sampling import programs
from specrl_jax.sampling.engine import EngineConfig
from specrl_jax.sampling.warp import warped_log_probs

VOCAB = 16
PROMPTS = [[1, 2, 3], [4, 5], [1, 2, 3]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


@pytest.fixture(scope="module")
def model():
  config = sj.ModelConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                          num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                          max_position_embeddings=32)
  return testing.peaked_random_model(config, seed=0)


@pytest.fixture(scope="module")
def greedy_tokens(model):
  return sj.generate(model, PROMPTS, sampling=GREEDY).tokens


# --- prompts ---------------------------------------------------------------------------

@pytest.mark.parametrize("prompts,fragment", [
    ([[1.7, 2.2]], r"prompts\[0\]\[0\]=1.7 \(float\) is not a token id"),
    ([[1, 2], [[3, 4], [5]]], r"prompts\[1\]\[0\]=\[3, 4\] \(list\) is not a token id"),
    ([[True, 2]], r"prompts\[0\]\[0\]=True \(bool\) is not a token id"),
    (["hello"], r"prompts\[0\]='hello' is a str: expected a list of token ids"),
    ([np.array([1.0, 2.0])], r"prompts\[0\] is an array of shape \(2,\) and dtype float64"),
    ([np.array([[1, 2]])], r"prompts\[0\] is an array of shape \(1, 2\)"),
    ([3], r"prompts\[0\]=3 is a int: expected a list of token ids"),
], ids=["floats", "nested_list", "bools", "string", "float_array", "2d_row", "bare_int"])
def test_prompts_that_are_not_flat_integer_sequences_are_refused_not_coerced(
    model, prompts, fragment):
  with pytest.raises(ValueError, match=fragment):
    sj.generate(model, prompts, sampling=GREEDY)


def test_numpy_integer_prompts_decode_exactly_like_python_lists(model, greedy_tokens):
  as_numpy = [np.array([1, 2, 3], np.int64), [np.int32(4), np.int64(5)],
              np.array([1, 2, 3], np.uint8)]
  np.testing.assert_array_equal(sj.generate(model, as_numpy, sampling=GREEDY).tokens,
                                greedy_tokens)
  rows = np.array([[1, 2, 3], [1, 2, 3]], np.int32)  # a 2-D array is a list of prompts
  np.testing.assert_array_equal(sj.generate(model, rows, sampling=GREEDY).tokens,
                                greedy_tokens[[0, 2]])


def test_stop_ids_outside_the_vocabulary_are_refused(model):
  sampling = SamplingParams(max_new_tokens=4, stop_token_ids=(2, VOCAB))
  with pytest.raises(ConfigError, match=rf"SamplingParams.stop_token_ids=\(2, {VOCAB}\).*"
                                        rf"id {VOCAB} is outside the model's vocabulary"):
    sj.generate(model, PROMPTS, sampling=sampling)


# --- numbers in configs ----------------------------------------------------------------

def test_numpy_scalars_are_accepted_as_numbers_and_stored_as_python_ones():
  from_numpy = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3),
                              top_p=np.float64(0.9), max_new_tokens=np.int32(4),
                              stop_token_ids=(np.int64(2),))
  plain = SamplingParams(temperature=0.5, top_k=3, top_p=0.9, max_new_tokens=4,
                         stop_token_ids=(2,))
  # A config is a static argument of compiled programs: equal values, one program.
  assert from_numpy == plain and hash(from_numpy) == hash(plain)
  assert type(from_numpy.temperature) is float and type(from_numpy.top_k) is int
  assert type(from_numpy.stop_token_ids[0]) is int
  assert SpecConfig(num_draft_tokens=np.int64(4), tree=(np.int32(2), 1)).tree == (2, 1)
  assert EngineConfig(num_slots=np.int64(2)) == EngineConfig(num_slots=2)
  assert sj.drafters.NGram(n=np.int64(4)) == sj.drafters.NGram(n=4)


@pytest.mark.parametrize("make,fragment", [
    (lambda: SamplingParams(top_k=True), "SamplingParams.top_k=True"),
    (lambda: SamplingParams(max_new_tokens=True), "SamplingParams.max_new_tokens=True"),
    (lambda: SamplingParams(stop_token_ids=(True,)), r"SamplingParams.stop_token_ids=\(True,\)"),
    (lambda: SamplingParams(temperature=True), "SamplingParams.temperature=True"),
    (lambda: SpecConfig(num_draft_tokens=True), "SpecConfig.num_draft_tokens=True"),
    (lambda: SpecConfig(tree=(2, True)), r"SpecConfig.tree=\(2, True\)"),
    (lambda: EngineConfig(num_slots=True), "EngineConfig.num_slots=True"),
    (lambda: sj.drafters.NGram(n=True), "NGram.n=True"),
], ids=["top_k", "max_new_tokens", "stop_ids", "temperature", "num_draft_tokens", "tree",
        "num_slots", "ngram_n"])
def test_bools_are_refused_where_numbers_are_meant(make, fragment):
  with pytest.raises(ConfigError, match=fragment):
    make()


@pytest.mark.parametrize("make,fragment", [
    (lambda: SamplingParams(temperature=math.inf), "SamplingParams.temperature=inf"),
    (lambda: SamplingParams(temperature=np.float32("nan")), r"SamplingParams.temperature=np.float32\(nan\)"),
    (lambda: SamplingParams(top_p=math.nan), "SamplingParams.top_p=nan"),
    (lambda: sj.ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                            num_heads=1, num_kv_heads=1, head_dim=8, rope_theta=math.inf),
     "ModelConfig.rope_theta=inf"),
], ids=["temperature_inf", "temperature_nan", "top_p_nan", "rope_theta_inf"])
def test_non_finite_floats_are_refused(make, fragment):
  with pytest.raises(ConfigError, match=fragment):
    make()


# --- rng, drafter, spec ----------------------------------------------------------------

def test_a_typed_key_and_its_raw_key_data_sample_the_same(model):
  sampling = SamplingParams(temperature=1.0, max_new_tokens=6)
  typed = sj.generate(model, PROMPTS, sampling=sampling, rng=jax.random.key(3))
  raw = sj.generate(model, PROMPTS, sampling=sampling, rng=jax.random.PRNGKey(3))
  np.testing.assert_array_equal(typed.tokens, raw.tokens)


@pytest.mark.parametrize("rng,fragment", [
    (0, r"rng=0 \(int\) is not a PRNG key"),
    ("seed", r"rng='seed' \(str\) is not a PRNG key"),
    (np.zeros(2, np.float32), r"rng has dtype float32 and shape \(2,\)"),
    (np.zeros(3, np.uint32), r"rng has dtype uint32 and shape \(3,\)"),
    (jax.random.split(jax.random.key(0), 2), r"rng is an array of \(2,\) keys"),
], ids=["int", "str", "float_data", "wrong_shape", "batch_of_keys"])
def test_anything_but_one_key_is_refused_as_rng(model, rng, fragment):
  with pytest.raises(ValueError, match=fragment):
    sj.generate(model, PROMPTS, sampling=GREEDY, rng=rng)


def test_a_transformer_passed_as_drafter_suggests_wrapping_it(model):
  with pytest.raises(ValueError, match=r"drafter is an sj.Transformer.*"
                                       r"sj.drafters.DraftModel\(model\)"):
    sj.generate(model, PROMPTS, sampling=GREEDY, drafter=model)
  with pytest.raises(ValueError, match=r"drafter='ngram' \(str\) is not a drafter"):
    sj.generate(model, PROMPTS, sampling=GREEDY, drafter="ngram")


@pytest.mark.parametrize("draft_mode", ["greedy", "sample"])
def test_a_tree_fan_out_above_the_vocabulary_is_refused(model, draft_mode):
  spec = SpecConfig(tree=(VOCAB + 1,), draft_mode=draft_mode)
  with pytest.raises(ConfigError, match=rf"SpecConfig.tree=\({VOCAB + 1},\).*"
                                        rf"at most vocab_size={VOCAB} children"):
    sj.generate(model, PROMPTS, sampling=GREEDY, drafter=sj.drafters.NGram(n=2), spec=spec)


# --- static bounds on what compiles ----------------------------------------------------

@pytest.mark.parametrize("make,fragment", [
    (lambda: SpecConfig(num_draft_tokens=17), "SpecConfig.num_draft_tokens=17.*at most 16"),
    (lambda: SpecConfig(num_draft_tokens=100, adaptive=True), "num_draft_tokens=100"),
    (lambda: SpecConfig(tree=(32, 32)), r"SpecConfig.tree=\(32, 32\).*at most 128 draft "
                                        r"nodes \(this one has 1056"),
    (lambda: SpecConfig(tree=(2,) * 7), r"at most 128 draft nodes \(this one has 254"),
    (lambda: SpecConfig(tree=(1,) * 17), "a depth of at most 16"),
    (lambda: sj.drafters.NGram(n=17), r"NGram.n=17 is invalid: expected an integer in "
                                      r"\[1, 16\]"),
    (lambda: sj.drafters.NGram(n=1000), "NGram.n=1000"),
], ids=["chain_17", "adaptive_100", "tree_32x32", "tree_254_nodes", "tree_depth_17",
        "ngram_17", "ngram_1000"])
def test_draft_shapes_beyond_the_compile_bounds_are_refused_at_config_time(make, fragment):
  with pytest.raises(ConfigError, match=fragment):
    make()


def test_draft_shapes_at_the_compile_bounds_are_accepted():
  assert SpecConfig(num_draft_tokens=16).depth == 16
  assert SpecConfig(tree=(2,) * 6).tree == (2,) * 6      # 126 nodes
  assert SpecConfig(tree=(1,) * 16).depth == 16
  assert sj.drafters.NGram(n=16).n == 16


# --- tiny temperatures -----------------------------------------------------------------

TINY = [1e-10, 1e-30, 1e-45]


@pytest.mark.parametrize("temperature", TINY)
def test_the_warp_keeps_the_top_token_finite_at_tiny_temperatures_under_jit(temperature):
  logits_NxV = 30.0 * jax.random.normal(jax.random.key(0), (4, VOCAB))
  sampling = SamplingParams(temperature=temperature, top_p=0.9)
  log_probs = jax.jit(warped_log_probs, static_argnames="params")(logits_NxV, sampling)
  top_N = jnp.argmax(logits_NxV, axis=-1)
  np.testing.assert_array_equal(jnp.take_along_axis(log_probs, top_N[:, None], 1), 0.0)
  assert not jnp.isnan(log_probs).any() and (log_probs <= 0).all()


@pytest.mark.parametrize("drafter", [None, sj.drafters.NGram(n=2)], ids=["plain", "ngram"])
@pytest.mark.parametrize("temperature", TINY)
def test_tiny_temperatures_sample_greedy_tokens_with_finite_log_probs(
    model, greedy_tokens, temperature, drafter):
  sampling = SamplingParams(temperature=temperature, max_new_tokens=GREEDY.max_new_tokens)
  spec = SpecConfig(num_draft_tokens=2) if drafter is not None else None
  out = sj.generate(model, PROMPTS, sampling=sampling, rng=jax.random.key(1),
                    drafter=drafter, spec=spec)
  np.testing.assert_array_equal(out.tokens, greedy_tokens)
  emitted = out.logprobs[out.tokens >= 0]
  assert np.isfinite(emitted).all() and (emitted <= 0).all(), out.logprobs


# --- compiled programs -----------------------------------------------------------------

def test_bucket_sizes_round_up_by_at_most_half():
  for size in range(1, 2000):
    assert size <= programs.bucket(size) <= max(2, 1.5 * size)
  assert [programs.bucket(n) for n in (1, 2, 3, 5, 7, 13, 100)] == [1, 2, 3, 6, 8, 16, 128]


def test_bucketing_shapes_changes_no_token_log_prob_or_statistic(model):
  prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10], [11]]  # 5 requests and prompts -> 6
  run = dict(sampling=SamplingParams(temperature=1.0, max_new_tokens=6),
             rng=jax.random.key(5), drafter=sj.drafters.NGram(n=2),
             spec=SpecConfig(num_draft_tokens=2))
  exact = sj.generate(model, prompts, engine=EngineConfig(bucket_shapes=False), **run)
  padded = sj.generate(model, prompts, **run)
  np.testing.assert_array_equal(padded.tokens, exact.tokens)
  # Equal to float32 rounding: XLA may vectorize a padded batch's reductions otherwise
  # (7e-7 apart on one CPU of this workplace, bit-identical on another).
  np.testing.assert_allclose(padded.logprobs, exact.logprobs, rtol=1e-6, atol=2e-6)
  np.testing.assert_array_equal(padded.lengths, exact.lengths)
  timing = ("seconds", "tokens_per_second", "program_cache", "request_rounds")
  assert ({k: v for k, v in padded.stats.items() if k not in timing}
          == {k: v for k, v in exact.stats.items() if k not in timing})
  np.testing.assert_array_equal(padded.stats["request_rounds"], exact.stats["request_rounds"])


def test_the_program_cache_keeps_at_most_its_size_least_recently_used_out(model):
  try:
    programs.set_program_cache_size(1)
    before = programs.program_cache_info()
    assert before["programs"] <= 1
    sj.generate(model, PROMPTS, sampling=GREEDY)
    out = sj.generate(model, [[1, 2, 3, 4] * 5], sampling=GREEDY)  # another prompt bucket
    after = out.stats["program_cache"]
    assert after["programs"] == 1 and after["max_programs"] == 1
    assert after["evictions"] > before["evictions"]
    with pytest.raises(ValueError, match="max_programs=0 is invalid"):
      programs.set_program_cache_size(0)
  finally:
    programs.set_program_cache_size(programs.DEFAULT_MAX_PROGRAMS)


def test_the_program_cache_evicts_past_its_size_when_the_process_nears_the_map_limit(
    model, monkeypatch):
  # A process past vm.max_map_count dies on its next allocation; each executable holds
  # about a thousand maps, so the cache gives programs up before that, newest kept.
  greedy = SamplingParams(temperature=0.0, max_new_tokens=5)  # programs no other test has
  sj.generate(model, PROMPTS, sampling=greedy)
  monkeypatch.setattr(programs, "MAP_LIMIT_SHARE", 0.0)
  out = sj.generate(model, [[1, 2, 3, 4] * 5], sampling=greedy)
  assert out.stats["program_cache"]["programs"] == 1
  assert out.stats["program_cache"]["max_programs"] == programs.DEFAULT_MAX_PROGRAMS
