"""Rollouts beyond one device and float32: on a ("data", "fsdp", "tensor") mesh the
weights and KV pages are split over "tensor" and the requests over the batch axes, and
with a bfloat16 target speculative decoding stays exactly lossless with respect to
that bfloat16 target.

Greedy decoding on every mesh emits the tokens of one device; sampled speculative
decoding on a tensor-parallel mesh and with bf16 weights, activations and KV pages
follows the exactly enumerated joint distribution of its target.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from specrl_jax import drafters, parallel, testing
from specrl_jax.config import ModelConfig, SamplingParams, SpecConfig
from specrl_jax.sampling import rollout as rollout_programs, sharded
from specrl_jax.models.transformer import Transformer
from specrl_jax.sampling.engine import EngineConfig
from specrl_jax.speculative.generate import generate, prepare
from specrl_jax.sampling.memory import tree_bytes

VOCAB = 12
# Four KV heads, so a 4-way tensor axis splits the pages too.
TARGET = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=8, num_kv_heads=4, head_dim=8)
DRAFT = TARGET.replace(num_layers=1)
PROMPTS = [[5], [3, 10, 11], [9, 2, 6, 5], [1, 2, 3, 4, 5, 6, 7, 8], [11, 0, 1, 2, 4],
           [3, 10, 11], [7, 7]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)
ENGINE = EngineConfig(page_size=4, num_slots=3)   # fewer slots than requests
MESHES = [(1, 1, 1), (1, 1, 2), (1, 1, 4), (2, 1, 4)]
NUM_SAMPLES = 20_000
JOINT_LENGTH = 3


def mesh_of(shape):
  return parallel.make_mesh(shape, devices=jax.devices()[:int(np.prod(shape))])


@pytest.fixture(scope="module")
def target():
  return testing.peaked_random_model(TARGET, seed=0)


@pytest.fixture(scope="module")
def draft(target):
  return drafters.DraftModel(testing.perturbed_model(target, seed=2, noise=0.3))


@pytest.fixture(scope="module")
def greedy_tokens(target):
  out = generate(target, PROMPTS, sampling=GREEDY, engine=ENGINE)
  assert [row[:n].tolist() for row, n in zip(out.tokens, out.lengths)] == (
      testing.greedy_reference(target, PROMPTS, GREEDY.max_new_tokens))
  return out.tokens


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_greedy_tokens_are_those_of_one_device_on_every_mesh(shape, target, draft,
                                                             greedy_tokens):
  mesh = mesh_of(shape)
  plain = generate(target, PROMPTS, sampling=GREEDY, engine=ENGINE, mesh=mesh)
  np.testing.assert_array_equal(plain.tokens, greedy_tokens)
  speculative = generate(target, PROMPTS, sampling=GREEDY, engine=ENGINE, mesh=mesh,
                         drafter=draft, spec=SpecConfig(num_draft_tokens=3))
  np.testing.assert_array_equal(speculative.tokens, greedy_tokens)
  assert speculative.stats["acceptance_length"] > 1
  # The draft model is as wide as the target: split like it where there is a tensor axis.
  assert speculative.stats["drafter_sharding"] == ("tensor" if shape[2] > 1 else "replicated")


def test_a_small_drafter_is_replicated(target):
  tiny = testing.peaked_random_model(
      ModelConfig(vocab_size=VOCAB, hidden_size=8, intermediate_size=8, num_layers=1,
                  num_heads=1, num_kv_heads=1, head_dim=8), seed=4)
  out = generate(target, PROMPTS[:2], sampling=GREEDY, mesh=mesh_of((1, 1, 2)),
                 drafter=drafters.DraftModel(tiny), spec=SpecConfig(num_draft_tokens=2))
  assert out.stats["drafter_sharding"] == "replicated"


def test_each_of_four_tensor_shards_holds_a_quarter_of_the_weights_and_pages(target):
  mesh = mesh_of((1, 1, 4))
  inputs, layout, *_ = prepare(TARGET, PROMPTS, GREEDY, ENGINE)
  graphdef, params = nnx.split(target)
  params = sharded.place_weights(params, mesh)
  inputs, rng = sharded.replicate(mesh, (inputs, jax.random.key(0)))
  state, _ = rollout_programs.start(graphdef, params, (), inputs, rng, sampling=GREEDY,
                                   layout=layout)

  def bytes_on(device, tree):
    return sum(shard.data.nbytes for leaf in jax.tree.leaves(tree)
               for shard in leaf.addressable_shards if shard.device == device)

  pages = (state.kv.k_pages, state.kv.v_pages)
  for device in mesh.devices.flat:
    # Norm scales are replicated: a little over a quarter.
    assert 0.25 <= bytes_on(device, params) / tree_bytes(params, per_device=False) < 0.27
    assert bytes_on(device, pages) / tree_bytes(pages, per_device=False) == pytest.approx(0.25)


def test_adaptive_speculation_refuses_batch_shards_with_a_clear_error(target, draft):
  with pytest.raises(ValueError, match="adaptive speculation runs on meshes without batch"):
    generate(target, PROMPTS, sampling=GREEDY, mesh=mesh_of((2, 1, 1)), drafter=draft,
             spec=SpecConfig(num_draft_tokens=2, adaptive=True))


def test_adaptive_speculation_runs_on_a_tensor_parallel_mesh(target, draft, greedy_tokens):
  out = generate(target, PROMPTS, sampling=GREEDY, engine=ENGINE, mesh=mesh_of((1, 1, 2)),
                 drafter=draft, spec=SpecConfig(num_draft_tokens=2, adaptive=True))
  np.testing.assert_array_equal(out.tokens, greedy_tokens)


def joint_check(target, drafter, spec, *, mesh=None, engine=None, seed=0):
  sampling = SamplingParams(temperature=1.0, max_new_tokens=4)
  prompt = [1, 2, 3]
  out = generate(target, [prompt] * NUM_SAMPLES, sampling=sampling, rng=jax.random.key(seed),
                 drafter=drafter, spec=spec, mesh=mesh,
                 engine=engine or EngineConfig(page_size=4, num_slots=4096))
  exact = testing.enumerate_sequence_distribution(target, prompt, sampling, JOINT_LENGTH)
  testing.assert_joint_matches(out.tokens, out.lengths, exact, name=str(spec))
  testing.assert_per_position_matches(out.tokens, testing.marginals_from_joint(exact, VOCAB),
                                      name=str(spec))
  assert 0 < out.stats["per_position_acceptance"][0] < 1
  return out


def test_speculation_on_a_tensor_parallel_mesh_follows_the_exact_joint(target, draft):
  joint_check(target, draft, SpecConfig(num_draft_tokens=3), mesh=mesh_of((1, 1, 2)))


@pytest.mark.slow(reason="interpret-mode kernels at 20,000 samples take minutes on CPU; the "
                        "fast suite covers them by greedy identity on (1,1,2) and (1,1,4) "
                        "and the per-shard kernel == reference test in test_kernels.py")
def test_speculation_with_the_kernels_split_over_tensor_shards_follows_the_exact_joint(
    target, draft):
  joint_check(target, draft, SpecConfig(num_draft_tokens=3), mesh=mesh_of((1, 1, 2)),
              engine=EngineConfig(page_size=4, num_slots=4096, attention="pallas"))


# --- bfloat16 ----------------------------------------------------------------------

BF16 = TARGET.replace(param_dtype="bfloat16", dtype="bfloat16")


@pytest.fixture(scope="module")
def bf16_target():
  return testing.peaked_random_model(BF16, seed=0)


def test_a_bf16_target_keeps_bf16_weights_activations_and_pages(bf16_target):
  inputs, layout, *_ = prepare(BF16, PROMPTS, GREEDY, ENGINE)
  assert layout.kv_dtype == "bfloat16"
  graphdef, params = nnx.split(bf16_target)
  assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
  state, _ = rollout_programs.start(graphdef, params, (), inputs, jax.random.key(0),
                                   sampling=GREEDY, layout=layout)
  assert state.kv.k_pages[0].dtype == jnp.bfloat16
  out = generate(bf16_target, PROMPTS, sampling=SamplingParams(max_new_tokens=4))
  assert out.logprobs.dtype == np.float32 and np.all(out.logprobs <= 0)
  f32_pages = prepare(BF16, PROMPTS, GREEDY,
                                      EngineConfig(kv_dtype="float32"))[1]
  assert f32_pages.kv_dtype == "float32"


# bf16 changes the numbers verification reads, not its code: the sampled tree keeps that
# in the fast suite (a chain is verified as a tree of width 1); chains and greedy trees
# are proved exact in float32 by test_speculative's covering design.
BF16_ALSO_COVERED = pytest.mark.slow(
    reason="bf16 sampled-tree joint test runs in the fast suite; chain and greedy-tree "
           "verification are covered in float32 by test_speculative, bf16 greedy drafts by "
           "test_bf16_greedy_speculation_equals_bf16_greedy_plain")


@pytest.mark.parametrize("spec", [
    pytest.param(SpecConfig(num_draft_tokens=3), marks=BF16_ALSO_COVERED),
    pytest.param(SpecConfig(tree=(2, 2, 1), draft_mode="greedy"), marks=BF16_ALSO_COVERED),
    SpecConfig(tree=(2, 1, 1), draft_mode="sample")], ids=str)
def test_bf16_speculation_follows_the_bf16_targets_exact_joint(spec, bf16_target):
  draft = drafters.DraftModel(testing.perturbed_model(bf16_target, seed=2, noise=0.3))
  joint_check(bf16_target, draft, spec)


def test_bf16_greedy_speculation_equals_bf16_greedy_plain(bf16_target):
  draft = drafters.DraftModel(testing.perturbed_model(bf16_target, seed=2, noise=0.3))
  plain = generate(bf16_target, PROMPTS, sampling=GREEDY, engine=ENGINE)
  for spec in (SpecConfig(num_draft_tokens=3), SpecConfig(tree=(2, 2, 1))):
    speculative = generate(bf16_target, PROMPTS, sampling=GREEDY, engine=ENGINE,
                           drafter=draft, spec=spec)
    np.testing.assert_array_equal(speculative.tokens, plain.tokens)


KERNELS = EngineConfig(page_size=4, num_slots=3, attention="pallas")


@pytest.mark.parametrize("shape", [(1, 1, 2), (1, 1, 4)], ids=lambda s: "x".join(map(str, s)))
def test_the_kernels_split_over_tensor_shards_decode_the_references_greedy_tokens(
    shape, target, draft, greedy_tokens):
  """attention="pallas" on a tensor-parallel mesh runs the kernel (interpret mode on
  CPU) once per head shard; plain and speculative greedy tokens are the reference's."""
  mesh = mesh_of(shape)
  plain = generate(target, PROMPTS, sampling=GREEDY, engine=KERNELS, mesh=mesh)
  np.testing.assert_array_equal(plain.tokens, greedy_tokens)
  speculative = generate(target, PROMPTS, sampling=GREEDY, engine=KERNELS, mesh=mesh,
                         drafter=draft, spec=SpecConfig(num_draft_tokens=3))
  np.testing.assert_array_equal(speculative.tokens, greedy_tokens)


def test_one_rule_replicates_a_small_drafter_and_splits_one_like_the_target():
  """``generate``, the sync RL step (on traced weights) and the async weight push all
  place the drafter by ``sharded.rollout_shardings``: at most a tenth of the target's
  bytes, or a mesh without a tensor axis, replicated; otherwise split like the target."""
  abstract = lambda config: nnx.state(nnx.eval_shape(
      lambda: Transformer(config, rngs=nnx.Rngs(0))))
  target_params = abstract(TARGET.replace(num_layers=16))
  small, large = abstract(DRAFT), abstract(TARGET)
  mesh = mesh_of((1, 1, 2))
  assert sharded.drafter_placement(small, target_params, mesh) == "replicated"
  assert sharded.drafter_placement(large, target_params, mesh) == "tensor"
  assert sharded.drafter_placement(large, target_params, mesh_of((1, 1, 1))) == "replicated"
  _, drafter_shardings, _ = sharded.rollout_shardings(target_params, large, mesh)
  q_proj = drafter_shardings["layers"][0]["attn"]["q_proj"]
  assert q_proj.get_value().spec[1] == "tensor"

