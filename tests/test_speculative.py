"""Speculative decoding is lossless: with any drafter and any verification mode the
emitted tokens follow exactly the distribution of plain decoding.

The target is a tiny random model with peaked distributions that depend strongly on
context, so mistakes in the joint or tree bookkeeping (not only in one position's
marginal) show up. Each sampled configuration draws 20,000 sequences in one call and
checks them against the exactly enumerated joint distribution of plain sampling:
  - chains with sampled drafts (draft_mode "sample") and point-mass drafts ("greedy"),
  - trees with deterministic children ("greedy") and children sampled without
    replacement ("sample"),
with a small draft model, a noisy copy of the target and an n-gram drafter, at two
temperatures, with and without top-k / top-p, with and without stop tokens, for
k in {1, 3, 5}. Each configuration compiles its own program, so the default suite runs
a covering design (every pair of factor levels appears); the full cross product is
marked slow. At temperature 0 speculative output is token-identical to plain greedy.
"""

import dataclasses
import itertools

import jax
import numpy as np
import pytest
from flax import nnx

from specrl_jax import drafters, testing
from specrl_jax.config import ConfigError, ModelConfig, SamplingParams, SpecConfig
from specrl_jax.models.transformer import Transformer
from specrl_jax.sampling.engine import EngineConfig
from specrl_jax.speculative.generate import generate
from specrl_jax.speculative.topology import TreeTopology

VOCAB = 12
NUM_SAMPLES = 20_000
MAX_NEW = 6        # tokens sampled per sequence (several rounds of bookkeeping)
JOINT_LENGTH = 3   # the joint over all vocabularies is enumerable for this many tokens
ENGINE = EngineConfig(page_size=4, num_slots=4096)

TARGET_CONFIG = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                            num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
SMALL_DRAFT_CONFIG = ModelConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                 num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8)

# Trees with k levels, so k bounds the accepted drafts as for a chain of k.
TREES = {1: (3,), 3: (2, 2, 1), 5: (2, 1, 1, 1, 1)}
MODES = ("chain_sample", "chain_greedy", "tree_greedy", "tree_sample")
WARPS = {"none": {}, "top_k": dict(top_k=3), "top_p": dict(top_p=0.8),
         "top_k_top_p": dict(top_k=4, top_p=0.9)}


@pytest.fixture(scope="module")
def target():
  return testing.peaked_random_model(TARGET_CONFIG, seed=0)


@pytest.fixture(scope="module")
def drafter_zoo(target):
  return {
      # Unrelated weights and a different shape: mostly rejected drafts.
      "small_model": drafters.DraftModel(testing.peaked_random_model(SMALL_DRAFT_CONFIG, seed=1)),
      # Agrees with the target often but not always: long accepted runs and rejections.
      "noisy_target": drafters.DraftModel(testing.perturbed_model(target, seed=2, noise=0.3)),
      "ngram": drafters.NGram(n=2),
      "target_itself": drafters.DraftModel(target),
  }


@pytest.fixture(scope="module")
def prompt(target):
  """A seed followed by the target's own greedy continuation: it repeats itself, so the
  n-gram drafter finds matches whose continuations the target finds likely."""
  seed = [1, 2, 3]
  return seed + testing.greedy_reference(target, [seed], 6)[0]


def spec_for(mode: str, k: int) -> SpecConfig:
  shape, draft_mode = mode.split("_")
  if shape == "chain":
    return SpecConfig(num_draft_tokens=k, draft_mode=draft_mode)
  return SpecConfig(tree=TREES[k], draft_mode=draft_mode)


@dataclasses.dataclass(frozen=True)
class Cell:
  """One sampled configuration of the matrix."""
  mode: str
  k: int
  drafter: str
  temperature: float
  warp: str
  stop: bool

  def __str__(self):
    return (f"{self.mode}-k{self.k}-{self.drafter}-t{self.temperature}-{self.warp}"
            f"{'-stop' if self.stop else ''}")


# A covering design: every pair of levels of the six factors (4 modes, 3 k, 3 drafters,
# 2 temperatures, 3 warps, stop token or not) appears in at least one row
# (test_the_covering_design_covers_every_pair_of_levels checks it).
COVERING = [
    Cell("chain_sample", 1, "noisy_target", 0.6, "top_k", False),
    Cell("chain_sample", 3, "small_model", 1.0, "top_p", True),
    Cell("chain_sample", 5, "ngram", 0.6, "none", False),
    Cell("chain_greedy", 1, "ngram", 0.6, "top_p", False),
    Cell("chain_greedy", 3, "noisy_target", 1.0, "none", False),
    Cell("chain_greedy", 5, "small_model", 1.0, "top_k", True),
    Cell("tree_greedy", 1, "ngram", 1.0, "top_p", True),
    Cell("tree_greedy", 3, "small_model", 0.6, "none", False),
    Cell("tree_greedy", 5, "noisy_target", 1.0, "top_k", False),
    Cell("tree_sample", 1, "small_model", 1.0, "none", True),
    Cell("tree_sample", 3, "ngram", 1.0, "top_k", False),
    Cell("tree_sample", 5, "noisy_target", 0.6, "top_p", True),
]
FACTOR_LEVELS = {"mode": MODES, "k": (1, 3, 5),
                 "drafter": ("small_model", "noisy_target", "ngram"),
                 "temperature": (0.6, 1.0), "warp": ("none", "top_k", "top_p"),
                 "stop": (False, True)}

# The full cross product of the factors: 4 modes x 3 k x (small draft model,
# n-gram) x 2 temperatures x (top-k and top-p both off / both on), no stop token.
# 96 compiled programs, about 20 minutes on two cores: marked slow.
FULL_CROSS = [Cell(mode, k, drafter, temperature, warp, False)
              for mode, k, drafter, temperature, warp in itertools.product(
                  MODES, (1, 3, 5), ("small_model", "ngram"), (0.6, 1.0),
                  ("none", "top_k_top_p"))]


def test_the_covering_design_covers_every_pair_of_levels():
  names = list(FACTOR_LEVELS)
  for first, second in itertools.combinations(names, 2):
    seen = {(getattr(cell, first), getattr(cell, second)) for cell in COVERING}
    missing = set(itertools.product(FACTOR_LEVELS[first], FACTOR_LEVELS[second])) - seen
    assert not missing, f"pairs of ({first}, {second}) never tested: {sorted(missing)}"


def stop_token_for(target, prompt, sampling: SamplingParams) -> int:
  """A token of moderate probability at the second position, so that stops happen both
  at the first draft positions and inside accepted runs."""
  marginals = testing.marginals_from_joint(
      testing.enumerate_sequence_distribution(target, prompt, sampling, 2), VOCAB)
  return int(np.argmin(np.abs(marginals[1] - 0.15)))


def assert_sane_stats(stats, depth: int):
  """acceptance_length in [1, k + 1]; acceptance can only fall with depth (a draft is
  accepted only after its parent was)."""
  assert 1.0 <= stats["acceptance_length"] <= depth + 1
  per_position = np.asarray(stats["per_position_acceptance"])
  assert per_position.shape == (depth,)
  assert ((0 <= per_position) & (per_position <= 1)).all()
  assert (np.diff(per_position) <= 1e-12).all()
  assert stats["acceptance_length"] == pytest.approx(1 + per_position.sum())


def check_cell(cell: Cell, target, drafter_zoo, prompt):
  sampling = SamplingParams(temperature=cell.temperature, max_new_tokens=MAX_NEW,
                            **WARPS[cell.warp])
  if cell.stop:
    sampling = dataclasses.replace(
        sampling, stop_token_ids=(stop_token_for(target, prompt, sampling),))
  prompts = [prompt] * NUM_SAMPLES
  out = generate(target, prompts, sampling=sampling, rng=jax.random.key(0),
                 drafter=drafter_zoo[cell.drafter], spec=spec_for(cell.mode, cell.k),
                 engine=ENGINE)
  name = str(cell)

  exact = testing.enumerate_sequence_distribution(target, prompt, sampling, JOINT_LENGTH)
  testing.assert_joint_matches(out.tokens, out.lengths, exact, name=name)
  testing.assert_per_position_matches(out.tokens, testing.marginals_from_joint(exact, VOCAB),
                                      name=name)
  if cell.warp == "top_k":
    # Three tokens per step: the joint of the whole response is small enough to test.
    full = testing.enumerate_sequence_distribution(target, prompt, sampling, MAX_NEW)
    testing.assert_joint_matches(out.tokens, out.lengths, full, name=name)
  # Every emitted token's reported log-prob is the full-forward one given everything
  # before it: KV committed after accepted runs and rejections is right in every round.
  np.testing.assert_allclose(
      out.logprobs, testing.response_log_probs(target, prompts, out.tokens, out.lengths,
                                               sampling), atol=1e-4, err_msg=name)
  assert_sane_stats(out.stats, cell.k)
  # Drafts were accepted and rejected: both branches of verification were exercised.
  per_position = np.asarray(out.stats["per_position_acceptance"])
  assert 0 < per_position[0] < 1, name


@pytest.mark.parametrize("cell", COVERING, ids=str)
def test_sampled_speculation_follows_the_exact_joint_distribution(cell, target, drafter_zoo,
                                                                  prompt):
  check_cell(cell, target, drafter_zoo, prompt)


@pytest.mark.slow
@pytest.mark.parametrize("cell", FULL_CROSS, ids=str)
def test_full_cross_product_follows_the_exact_joint_distribution(cell, target, drafter_zoo,
                                                                 prompt):
  check_cell(cell, target, drafter_zoo, prompt)


# "pallas": prefill through jax.nn.dot_product_attention, verification through the paged
# kernel, in interpret mode on CPU. That runs the kernel's (slot, KV head) grid one
# program at a time, so this case drafts with the n-gram drafter (no attention of its
# own) on 256 slots; the greedy identity test below runs a drafting model through it.
BUDGET_CASES = {"reference": ("noisy_target", ENGINE),
                "pallas": ("ngram", dataclasses.replace(ENGINE, num_slots=256,
                                                        attention="pallas"))}


@pytest.mark.parametrize("attention", BUDGET_CASES)
def test_drafts_longer_than_the_remaining_budget_are_truncated_exactly(target, drafter_zoo,
                                                                       prompt, attention):
  # Two new tokens, five drafts per round: the round must stop at the budget without
  # changing the distribution of what it emits.
  drafter, engine = BUDGET_CASES[attention]
  sampling = SamplingParams(temperature=1.0, max_new_tokens=2)
  prompts = [prompt] * NUM_SAMPLES
  out = generate(target, prompts, sampling=sampling, rng=jax.random.key(1),
                 drafter=drafter_zoo[drafter], spec=SpecConfig(num_draft_tokens=5),
                 engine=engine)
  assert (out.lengths == 2).all()
  # Drafts were accepted and rejected: verification's attention decided both.
  assert 0 < out.stats["per_position_acceptance"][0] < 1
  exact = testing.enumerate_sequence_distribution(target, prompt, sampling, 2)
  testing.assert_joint_matches(out.tokens, out.lengths, exact)
  np.testing.assert_allclose(
      out.logprobs, testing.response_log_probs(target, prompts, out.tokens, out.lengths,
                                               sampling), atol=1e-4)


# --- temperature 0: token-identical to plain greedy ---------------------------------

GREEDY_PROMPTS = [[5], [3, 10, 11], [9, 2, 6, 5], [1, 2, 3, 4, 5, 6, 7, 8],
                  [11, 0, 1, 2, 4, 4, 9, 10, 1], [3, 10, 11], [1, 2, 3, 4, 5, 6, 7, 8]]
GREEDY_MAX_NEW = 12
GREEDY_ENGINE = EngineConfig(page_size=4, num_slots=3)  # fewer slots than requests
GREEDY_K = 5
GREEDY_CASES = [
    ("small_model", SpecConfig(num_draft_tokens=1)),
    ("small_model", SpecConfig(tree=(2, 2, 1))),
    ("noisy_target", SpecConfig(tree=(3, 1))),  # its chain: the budget test below
    ("ngram", SpecConfig(num_draft_tokens=5)),
    ("ngram", SpecConfig(tree=(2, 2))),
]


@pytest.fixture(scope="module")
def greedy_stop_token(target) -> int:
  """A token greedy decoding emits at the first draft positions of some responses (so
  with the target drafting for itself it stops inside an accepted run) and never in
  others (so responses end at different rounds and slots are refilled mid-flight)."""
  responses = testing.greedy_reference(target, GREEDY_PROMPTS, GREEDY_MAX_NEW)

  def rows_with(token):
    return sum(token in response for response in responses)

  candidates = [t for t in range(VOCAB) if 0 < rows_with(t) < len(responses)
                and any(token == t and t not in r[:i] for r in responses
                        for i, token in enumerate(r[1:GREEDY_K], start=1))]
  return max(candidates, key=rows_with)


@pytest.fixture(scope="module")
def greedy_plain(target, greedy_stop_token):
  sampling = SamplingParams(temperature=0.0, max_new_tokens=GREEDY_MAX_NEW,
                            stop_token_ids=(greedy_stop_token,))
  out = generate(target, GREEDY_PROMPTS, sampling=sampling, engine=GREEDY_ENGINE)
  expected = testing.greedy_reference(target, GREEDY_PROMPTS, GREEDY_MAX_NEW,
                                      (greedy_stop_token,))
  assert [row[:n].tolist() for row, n in zip(out.tokens, out.lengths)] == expected
  assert len(set(out.lengths.tolist())) > 1
  return out


@pytest.mark.parametrize("drafter,spec", GREEDY_CASES,
                         ids=[f"{d}-{s.tree or s.num_draft_tokens}" for d, s in GREEDY_CASES])
def test_greedy_speculation_is_token_identical_to_plain_greedy(
    target, drafter_zoo, greedy_plain, greedy_stop_token, drafter, spec):
  sampling = SamplingParams(temperature=0.0, max_new_tokens=GREEDY_MAX_NEW,
                            stop_token_ids=(greedy_stop_token,))
  out = generate(target, GREEDY_PROMPTS, sampling=sampling, drafter=drafter_zoo[drafter],
                 spec=spec, engine=GREEDY_ENGINE)
  np.testing.assert_array_equal(out.tokens, greedy_plain.tokens)
  np.testing.assert_array_equal(out.lengths, greedy_plain.lengths)
  np.testing.assert_array_equal(out.logprobs, greedy_plain.logprobs)
  assert_sane_stats(out.stats, spec.depth)


def test_the_target_drafting_for_itself_accepts_everything_and_stops_inside_runs(
    target, drafter_zoo, greedy_plain, greedy_stop_token):
  # At temperature 0 the target proposes exactly what it will emit, so each round
  # accepts all k drafts: the stop token, emitted at a draft position, must end the
  # response right there although the round accepted the drafts after it.
  sampling = SamplingParams(temperature=0.0, max_new_tokens=GREEDY_MAX_NEW,
                            stop_token_ids=(greedy_stop_token,))
  out = generate(target, GREEDY_PROMPTS, sampling=sampling,
                 drafter=drafter_zoo["target_itself"],
                 spec=SpecConfig(num_draft_tokens=GREEDY_K), engine=GREEDY_ENGINE)
  np.testing.assert_array_equal(out.tokens, greedy_plain.tokens)
  assert out.stats["acceptance_length"] == GREEDY_K + 1
  assert out.stats["per_position_acceptance"] == [1.0] * GREEDY_K
  assert out.stats["target_calls"] < greedy_plain.stats["target_calls"] / 2
  # Each round emits k + 1 tokens until the response ends (the first came with admission).
  np.testing.assert_array_equal(out.stats["request_rounds"],
                                -(-(out.lengths - 1) // (GREEDY_K + 1)))
  # Round r emits positions 1 + (k + 1) r .. (k + 1)(r + 1); all but the last are drafts.
  stop_positions = out.lengths[out.tokens[np.arange(len(out.tokens)), out.lengths - 1]
                               == greedy_stop_token] - 1
  assert any(p % (GREEDY_K + 1) != 0 for p in stop_positions)


@pytest.mark.parametrize("spec", [SpecConfig(num_draft_tokens=3), SpecConfig(tree=(2, 2, 1))],
                         ids=["chain3", "tree221"])
def test_with_the_pallas_kernel_greedy_speculation_is_token_identical(
    target, drafter_zoo, greedy_plain, greedy_stop_token, spec):
  # The tree's drafting attends to scratch keys of shallower levels: the kernel takes
  # those too. Page size 16: each sequence's prefix ends mid-page, then crosses one.
  sampling = SamplingParams(temperature=0.0, max_new_tokens=GREEDY_MAX_NEW,
                            stop_token_ids=(greedy_stop_token,))
  engine = dataclasses.replace(GREEDY_ENGINE, page_size=16, attention="pallas")
  out = generate(target, GREEDY_PROMPTS, sampling=sampling, drafter=drafter_zoo["small_model"],
                 spec=spec, engine=engine)
  np.testing.assert_array_equal(out.tokens, greedy_plain.tokens)
  np.testing.assert_array_equal(out.lengths, greedy_plain.lengths)
  np.testing.assert_allclose(out.logprobs, greedy_plain.logprobs, atol=1e-5)


def test_greedy_drafts_longer_than_the_budget_match_plain_greedy(target, drafter_zoo,
                                                                 greedy_plain,
                                                                 greedy_stop_token):
  sampling = SamplingParams(temperature=0.0, max_new_tokens=2,
                            stop_token_ids=(greedy_stop_token,))
  out = generate(target, GREEDY_PROMPTS, sampling=sampling, drafter=drafter_zoo["noisy_target"],
                 spec=SpecConfig(num_draft_tokens=5), engine=GREEDY_ENGINE)
  np.testing.assert_array_equal(out.tokens, greedy_plain.tokens[:, :2])


@pytest.mark.parametrize("drafter", ["target_itself", "noisy_target"])
def test_drafts_committed_past_the_context_leave_no_trace(target, drafter_zoo, drafter):
  # Prompts that fill their bucket leave room for exactly the budget (3 tokens) in the
  # 3-page context; a round accepting 5 drafts commits keys past it, to the trash
  # page. Two slots for six requests: pages are released and reused meanwhile.
  prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 2, 6, 5, 1, 0, 3, 3], [4, 4, 4, 4, 4, 4, 4, 4],
             [11, 10, 9, 8, 7, 6, 5, 4], [2, 7, 1, 8, 2, 8, 1, 8], [3, 1, 4, 1, 5, 9, 2, 6]]
  engine = EngineConfig(page_size=4, prompt_bucket=4, num_slots=2)
  spec = SpecConfig(num_draft_tokens=5)
  greedy = generate(target, prompts, sampling=SamplingParams(temperature=0.0, max_new_tokens=3),
                    drafter=drafter_zoo[drafter], spec=spec, engine=engine)
  assert greedy.tokens.tolist() == testing.greedy_reference(target, prompts, 3)
  sampling = SamplingParams(temperature=1.0, max_new_tokens=3)
  sampled = generate(target, prompts, sampling=sampling, rng=jax.random.key(3),
                     drafter=drafter_zoo[drafter], spec=spec, engine=engine)
  np.testing.assert_allclose(
      sampled.logprobs, testing.response_log_probs(target, prompts, sampled.tokens,
                                                   sampled.lengths, sampling), atol=1e-4)


# --- errors ------------------------------------------------------------------------

def test_a_draft_model_with_another_vocabulary_is_rejected(target):
  # Only the config matters: an abstract model (shapes, no weights) is enough.
  other = nnx.eval_shape(lambda: Transformer(SMALL_DRAFT_CONFIG.replace(vocab_size=VOCAB + 1),
                                             rngs=nnx.Rngs(0)))
  with pytest.raises(ConfigError, match=f"vocab_size={VOCAB + 1}.*vocab_size={VOCAB}"):
    generate(target, [[1, 2]], drafter=drafters.DraftModel(other), spec=SpecConfig())


@pytest.mark.parametrize("fields,fragment", [
    (dict(tree=()), r"tree=\(\)"),
    (dict(tree=(2, 0)), r"tree=\(2, 0\)"),
    (dict(tree=[2, 2]), r"tree=\[2, 2\]"),
    (dict(tree=(2, True)), r"tree=\(2, True\)"),
    (dict(num_draft_tokens=0), "num_draft_tokens=0"),
    (dict(draft_mode="beam"), "draft_mode='beam'"),
])
def test_malformed_spec_configs_name_the_field(fields, fragment):
  with pytest.raises(ConfigError, match=f"SpecConfig.{fragment}"):
    SpecConfig(**fields)


def test_a_malformed_topology_is_rejected():
  with pytest.raises(ConfigError, match=r"tree=\(\)"):
    SpecConfig(tree=())
  with pytest.raises(ConfigError, match=r"tree=\(2, 0\)"):
    TreeTopology((2, 0))
  # The empty topology is the engine's own "draft nothing" round (adaptive speculation).
  assert TreeTopology(()).depth == 0


def test_spec_without_a_drafter_is_an_error(target):
  with pytest.raises(ValueError, match="spec was given without a drafter"):
    generate(target, [[1, 2]], spec=SpecConfig(num_draft_tokens=3))
