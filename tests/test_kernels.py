"""The Pallas paged-attention kernels compute exactly what the pure-JAX reference does.

Both kernels (GPU/Triton and TPU/Mosaic) run in interpret mode (and, on a GPU or TPU
backend, the backend's kernel also compiled) on the cases
decoding meets: one query token, a chain or a tree of drafts (with the scratch keys of
shallower tree levels before the call's own), grouped query heads, page sizes 16 and
64, float32 and bfloat16, and in every case a ragged batch with an empty prefix, a
prefix ending mid-page and one filling its pages exactly, page tables in arbitrary
order that share a page, and trash entries. Each case compiles its own programs, so
the matrix is a covering design: every pair of levels of (groups, query tokens, page
size, dtype) appears in some row (test_the_matrix_covers_every_pair_of_levels).
"""

import itertools

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from specrl_jax import parallel
from specrl_jax.config import ConfigError
from specrl_jax.kernels import (SplitHeads, paged_attention, paged_attention_gpu_interpret,
                                paged_attention_tpu, paged_attention_tpu_interpret,
                                prefill_attention, resolve_attention)
from specrl_jax.kernels.dispatch import paged_attention_gpu_where_it_fits
from specrl_jax.kernels.paged_attention_gpu import paged_attention_gpu
from specrl_jax.kv.paged import PagedKV, paged_attention_reference
from specrl_jax.kv.pool import TRASH_PAGE
from specrl_jax.sampling.engine import EngineConfig

NUM_PAGES = 12
HEAD_DIM = 16
# Row 0: pages out of order, a page allocated past the prefix, a trash tail.
# Row 1: shares page 7 with row 0 (a GRPO group's prompt page), then trash.
# Row 2: every slot used.
PAGE_TABLE = np.array([[7, 3, 10, TRASH_PAGE],
                       [7, 5, TRASH_PAGE, TRASH_PAGE],
                       [2, 11, 4, 9]], np.int32)
KERNELS = {"gpu": paged_attention_gpu_interpret, "tpu": paged_attention_tpu_interpret}
# On an accelerator the same cases also run the kernel compiled for it.
if jax.default_backend() == "gpu":
  KERNELS["gpu_compiled"] = paged_attention_gpu
elif jax.default_backend() == "tpu":
  KERNELS["tpu_compiled"] = paged_attention_tpu


def causal_mask(q_len):
  return np.tril(np.ones((q_len, q_len), bool))


def ancestor_mask(parents):
  """mask[t, s]: node s is t itself or one of its ancestors."""
  mask = np.eye(len(parents), dtype=bool)
  for node, parent in enumerate(parents):
    while parent >= 0:
      mask[node, parent] = True
      parent = parents[parent]
  return mask


def tree_mask(q_len, seed=0):
  """A random draft tree's ancestor mask (node 0 is the root)."""
  rng = np.random.default_rng(seed)
  return ancestor_mask([-1] + [int(rng.integers(0, node)) for node in range(1, q_len)])


def with_scratch(mask_TxT, scratch, seed=0):
  """[T, E + T]: each query also sees a random subset of E earlier (scratch) keys."""
  rng = np.random.default_rng(seed)
  return np.concatenate([rng.random((mask_TxT.shape[0], scratch)) < 0.6, mask_TxT], axis=1)


def make_inputs(*, page_size, prefix_lengths, mask_TxN, num_kv_heads, groups,
                dtype=jnp.float32, seed=0):
  """Reference-signature arguments; the trash page holds huge values so reading it shows."""
  batch, (q_len, new_keys) = len(prefix_lengths), mask_TxN.shape
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.normal(size=shape).astype(np.float32)
  k_pages = normal(NUM_PAGES, num_kv_heads, page_size, HEAD_DIM)
  v_pages = normal(NUM_PAGES, num_kv_heads, page_size, HEAD_DIM)
  k_pages[TRASH_PAGE] = 50.0
  v_pages[TRASH_PAGE] = 1e4
  return (jnp.asarray(normal(batch, q_len, num_kv_heads * groups, HEAD_DIM), dtype),
          jnp.asarray(k_pages, dtype), jnp.asarray(v_pages, dtype),
          jnp.asarray(PAGE_TABLE[:batch]), jnp.asarray(prefix_lengths, jnp.int32),
          jnp.asarray(normal(batch, new_keys, num_kv_heads, HEAD_DIM), dtype),
          jnp.asarray(normal(batch, new_keys, num_kv_heads, HEAD_DIM), dtype),
          jnp.asarray(np.broadcast_to(mask_TxN, (batch, q_len, new_keys))))


def ragged_prefixes(page_size):
  """Empty, ending mid-page (row 1 owns 2 pages), filling all 4 pages exactly."""
  return (0, page_size + page_size // 2 + 1, 4 * page_size)


# (groups, query tokens, page size, dtype, new-key mask kind)
MATRIX = [
    (1, 1, 64, "float32", "decode"),
    (1, 4, 16, "float32", "chain"),
    (1, 16, 64, "bfloat16", "tree+scratch"),
    (4, 1, 16, "bfloat16", "decode+scratch"),
    (4, 4, 64, "bfloat16", "tree"),
    (4, 16, 16, "float32", "chain"),
    (8, 1, 16, "bfloat16", "decode"),
    (8, 4, 64, "float32", "tree+scratch"),
    (8, 16, 16, "float32", "tree"),
]
LEVELS = ((1, 4, 8), (1, 4, 16), (16, 64), ("float32", "bfloat16"))


def new_key_mask(kind, q_len):
  base = tree_mask(q_len, seed=q_len) if kind.startswith("tree") else causal_mask(q_len)
  return with_scratch(base, scratch=3, seed=q_len) if kind.endswith("scratch") else base


def test_the_matrix_covers_every_pair_of_levels():
  for first, second in itertools.combinations(range(4), 2):
    seen = {(row[first], row[second]) for row in MATRIX}
    missing = set(itertools.product(LEVELS[first], LEVELS[second])) - seen
    assert not missing, f"pairs of factors {first} and {second} never tested: {missing}"


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("groups,q_len,page_size,dtype,kind", MATRIX,
                         ids=["-".join(map(str, row)) for row in MATRIX])
def test_kernel_matches_reference(kernel, groups, q_len, page_size, dtype, kind):
  dtype = jnp.dtype(dtype)
  args = make_inputs(page_size=page_size, prefix_lengths=ragged_prefixes(page_size),
                     mask_TxN=new_key_mask(kind, q_len), num_kv_heads=2, groups=groups,
                     dtype=dtype, seed=q_len + groups)
  got = jax.jit(KERNELS[kernel])(*args)
  assert got.dtype == dtype
  chex.assert_shape(got, args[0].shape)
  tolerance = 1e-5 if dtype == jnp.float32 else 3e-2
  chex.assert_trees_all_close(got.astype(jnp.float32),
                              paged_attention_reference(*args).astype(jnp.float32),
                              atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("kernel", KERNELS)
def test_float32_queries_over_a_bfloat16_pool(kernel):
  # EngineConfig(kv_dtype="bfloat16") under a float32 model.
  q, k_pages, v_pages, *rest = make_inputs(page_size=16, prefix_lengths=ragged_prefixes(16),
                                           mask_TxN=tree_mask(4), num_kv_heads=2, groups=4)
  args = (q, k_pages.astype(jnp.bfloat16), v_pages.astype(jnp.bfloat16), *rest)
  got = KERNELS[kernel](*args)
  assert got.dtype == jnp.float32
  chex.assert_trees_all_close(got, paged_attention_reference(*args), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("pages_per_block", [1, 3])
def test_tpu_pages_per_block_does_not_change_the_result(pages_per_block):
  # 3 does not divide the 4 page-table slots: the last block is partly past the table.
  args = make_inputs(page_size=16, prefix_lengths=(33, 30, 61), mask_TxN=causal_mask(4),
                     num_kv_heads=2, groups=2, seed=1)
  got = paged_attention_tpu(*args, interpret=True, pages_per_block=pages_per_block)
  chex.assert_trees_all_close(got, paged_attention_reference(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
def test_stale_keys_past_the_prefix_are_never_seen(kernel):
  args = make_inputs(page_size=16, prefix_lengths=(22, 32, 0), mask_TxN=causal_mask(4),
                     num_kv_heads=2, groups=2, seed=3)
  q, k_pages, v_pages, page_table, prefix_lengths = args[:5]
  before = KERNELS[kernel](*args)
  # Overwrite every position no sequence may see: page 10 (row 0's positions 32..47,
  # it sees 22), the rest of page 3, and every page of row 2 (it sees nothing).
  stale_v = (v_pages.at[10].set(-7.0).at[3, :, 6:].set(-7.0)
             .at[jnp.array([2, 11, 4, 9])].set(-7.0))
  after = KERNELS[kernel](q, k_pages, stale_v, page_table, prefix_lengths, *args[5:])
  chex.assert_trees_all_close(after, before, atol=1e-6)


@pytest.mark.parametrize("kernel", KERNELS)
def test_query_that_sees_nothing_gets_zeros(kernel):
  # A padding query: empty prefix and an all-false mask row.
  mask_TxT = causal_mask(3)
  mask_TxT[0] = False
  args = make_inputs(page_size=16, prefix_lengths=(0, 5), mask_TxN=mask_TxT, num_kv_heads=1,
                     groups=2)
  got = KERNELS[kernel](*args)
  np.testing.assert_array_equal(np.asarray(got[0, 0]), 0.0)
  chex.assert_tree_all_finite(got)
  chex.assert_trees_all_close(got, paged_attention_reference(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
def test_plugs_into_paged_kv_as_its_attention_fn(kernel):
  q, k_pages, v_pages, page_table, prefix_lengths, k_new, v_new, mask = make_inputs(
      page_size=16, prefix_lengths=(22, 32, 0), mask_TxN=causal_mask(4), num_kv_heads=2,
      groups=4)
  positions = prefix_lengths[:, None] + jnp.arange(4)[None, :]
  backends = [PagedKV(k_pages=(k_pages,), v_pages=(v_pages,), page_table_BxM=page_table,
                      prefix_lengths_B=prefix_lengths, new_mask_BxTxT=mask,
                      write_positions_BxT=positions, attention_fn=attention_fn)
              for attention_fn in (paged_attention_reference, KERNELS[kernel])]
  (expected, expected_kv), (got, got_kv) = [kv.attend(0, q, k_new, v_new) for kv in backends]
  chex.assert_trees_all_close(got, expected, atol=1e-5, rtol=1e-5)
  chex.assert_trees_all_equal(got_kv.k_pages, expected_kv.k_pages)


def test_prefill_attention_matches_the_reference_on_prefill_masks():
  # Prefill: empty prefixes, causal over each prompt, its padding hidden from every row.
  lengths = np.array([5, 8, 1])
  valid_BxT = np.arange(8)[None, :] < lengths[:, None]
  mask_BxTxT = causal_mask(8)[None] & valid_BxT[:, None, :]
  args = list(make_inputs(page_size=16, prefix_lengths=(0, 0, 0), mask_TxN=causal_mask(8),
                          num_kv_heads=2, groups=4))
  args[7] = jnp.asarray(mask_BxTxT)
  got, expected = prefill_attention(*args), paged_attention_reference(*args)
  chex.assert_trees_all_close(got[valid_BxT], expected[valid_BxT], atol=1e-5, rtol=1e-5)


def test_attention_choices_resolve_per_backend():
  assert resolve_attention("auto", "cpu").decode is paged_attention_reference
  assert resolve_attention("auto", "gpu").decode is paged_attention_gpu_where_it_fits
  assert resolve_attention("auto", "tpu").decode is paged_attention_tpu
  assert resolve_attention("reference", "gpu").prefill is paged_attention_reference
  pallas_on_cpu = resolve_attention("pallas", "cpu")
  assert pallas_on_cpu.name == "pallas"
  assert pallas_on_cpu.decode is paged_attention_gpu_interpret
  assert pallas_on_cpu.prefill is prefill_attention
  # The same choice twice is the same function: PagedKV holds it statically, so a new
  # one per rollout would recompile every rollout.
  assert resolve_attention("pallas", "cpu") == pallas_on_cpu
  with pytest.raises(ConfigError, match="attention='triton'"):
    resolve_attention("triton")
  with pytest.raises(ConfigError, match="EngineConfig.attention='triton'.*'pallas'"):
    EngineConfig(attention="triton")


def test_dispatcher_uses_the_reference_on_cpu_and_the_kernel_on_request():
  args = make_inputs(page_size=16, prefix_lengths=(22, 32, 0), mask_TxN=causal_mask(1),
                     num_kv_heads=2, groups=1)
  expected = paged_attention_reference(*args)
  chex.assert_trees_all_equal(paged_attention(*args), expected)
  chex.assert_trees_all_close(paged_attention(*args, attention="pallas"), expected,
                              atol=1e-5, rtol=1e-5)


def test_inconsistent_shapes_are_rejected_by_name():
  args = list(make_inputs(page_size=16, prefix_lengths=(6, 8), mask_TxN=causal_mask(2),
                          num_kv_heads=2, groups=1))
  args[7] = args[7][:, :1]
  for kernel in KERNELS.values():
    with pytest.raises(ValueError, match="new_mask_BxTxL has shape"):
      kernel(*args)
  with pytest.raises(ConfigError, match="pages_per_block=0"):
    paged_attention_tpu(*make_inputs(page_size=16, prefix_lengths=(6,),
                                     mask_TxN=causal_mask(1), num_kv_heads=1, groups=1),
                        interpret=True, pages_per_block=0)
  # Compiled, Triton tensors are powers of two and its dots at least 16 wide.
  with pytest.raises(ValueError, match="page_size=4, head_dim=16"):
    paged_attention_gpu(*make_inputs(page_size=4, prefix_lengths=(6,),
                                     mask_TxN=causal_mask(1), num_kv_heads=1, groups=1))


def test_interpret_mode_takes_pages_the_triton_lowering_cannot():
  # The engine tests' toy models: page size 4 (head_dim 8 there).
  args = make_inputs(page_size=4, prefix_lengths=(6, 8, 0), mask_TxN=causal_mask(4),
                     num_kv_heads=2, groups=2)
  chex.assert_trees_all_close(paged_attention_gpu_interpret(*args),
                              paged_attention_reference(*args), atol=1e-5, rtol=1e-5)


def _primitive_names(jaxpr) -> set[str]:
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      names |= _primitive_names(sub)
  return names


@pytest.mark.parametrize("kernel", KERNELS)
def test_split_heads_runs_the_kernel_per_tensor_shard_and_matches_the_reference(kernel):
  mesh = parallel.make_mesh((1, 1, 2), devices=jax.devices()[:2])
  args = make_inputs(page_size=16, prefix_lengths=(22, 32, 0), mask_TxN=causal_mask(4),
                     num_kv_heads=2, groups=2)
  split = resolve_attention("pallas", "cpu", mesh=mesh).decode
  assert split == SplitHeads(paged_attention_gpu_interpret, mesh)
  split = SplitHeads(KERNELS[kernel], mesh)
  assert {"shard_map", "pallas_call"} <= _primitive_names(jax.make_jaxpr(split)(*args).jaxpr)
  chex.assert_trees_all_close(jax.jit(split)(*args), paged_attention_reference(*args),
                              atol=1e-5, rtol=1e-5)


def test_split_heads_takes_the_reference_when_the_kv_heads_do_not_divide():
  mesh = parallel.make_mesh((1, 1, 2), devices=jax.devices()[:2])
  args = make_inputs(page_size=16, prefix_lengths=(22, 32, 0), mask_TxN=causal_mask(1),
                     num_kv_heads=1, groups=2)
  split = SplitHeads(paged_attention_gpu_interpret, mesh)
  assert "pallas_call" not in _primitive_names(jax.make_jaxpr(split)(*args).jaxpr)
  chex.assert_trees_all_equal(split(*args), paged_attention_reference(*args))


def test_auto_falls_back_to_the_reference_with_one_warning_when_the_kernel_fails_to_compile(
    monkeypatch):
  """A TPU kernel compiled for this CPU fails for real (Mosaic needs a TPU): "auto"
  then decodes with the reference, warns once naming the kernel and the error, and
  says so in out.stats; the same shapes again do not warn twice."""
  import warnings
  import specrl_jax as sj
  from specrl_jax import testing
  target = testing.peaked_random_model(
      sj.ModelConfig(vocab_size=12, hidden_size=16, intermediate_size=32, num_layers=1,
                     num_heads=2, num_kv_heads=1, head_dim=8), seed=0)
  greedy = sj.SamplingParams(temperature=0.0, max_new_tokens=4)
  engine = EngineConfig(page_size=4)
  expected = sj.generate(target, [[1, 2, 3]], sampling=greedy, engine=engine)
  assert expected.stats["attention_fallback"] is None
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  with pytest.warns(RuntimeWarning, match=r'attention="auto": the Pallas kernel '
                    r"paged_attention_tpu: .*reference") as caught:
    out = sj.generate(target, [[1, 2, 3]], sampling=greedy, engine=engine)
  assert len([w for w in caught if "Pallas kernel" in str(w.message)]) == 1
  assert out.stats["attention"] == "reference"
  assert out.stats["attention_fallback"].startswith("paged_attention_tpu: ")
  np.testing.assert_array_equal(out.tokens, expected.tokens)
  with warnings.catch_warnings():
    warnings.simplefilter("error", RuntimeWarning)
    again = sj.generate(target, [[1, 2, 3]], sampling=greedy, engine=engine)
  assert again.stats["attention_fallback"] == out.stats["attention_fallback"]


def test_an_explicit_pallas_choice_is_never_replaced(monkeypatch):
  from specrl_jax.kernels.fallback import checked_attention
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  shapes = dict(num_heads=2, num_kv_heads=1, head_dim=8, page_size=4, dtype="float32")
  assert checked_attention("pallas", **shapes) == ("pallas", None)
  assert checked_attention("reference", **shapes) == ("reference", None)
