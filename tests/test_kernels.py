"""The Pallas paged-attention kernel computes exactly what the pure-JAX reference does.

Runs the kernel in interpret mode on CPU. Shapes are tiny (page size 4, head_dim 16)
but cover what decoding meets: one query token or a chain / tree of drafts, grouped
query heads, prefixes that are empty, end mid-page or exactly at a page boundary,
ragged batches, page tables in arbitrary order that share pages, and trash entries.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import paged_attention, paged_attention_pallas
from specrl_jax.config import ConfigError
from specrl_jax.kv.paged import PagedKV, paged_attention_reference
from specrl_jax.kv.pool import TRASH_PAGE

NUM_PAGES = 12
PAGE_SIZE = 4
HEAD_DIM = 16
# Row 0: pages out of order, a page allocated past the prefix, a trash tail.
# Row 1: shares page 7 with row 0 (a GRPO group's prompt page), then trash.
# Row 2: every slot used.
PAGE_TABLE = np.array([[7, 3, 10, TRASH_PAGE],
                       [7, 5, TRASH_PAGE, TRASH_PAGE],
                       [2, 11, 4, 9]], np.int32)
# Parent of each node of a 7-node draft tree (node 0 is the root).
TREE_PARENTS = (-1, 0, 0, 1, 1, 2, 3)

pallas_interpret = functools.partial(paged_attention_pallas, interpret=True)


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


def make_inputs(*, prefix_lengths, mask_TxT, num_kv_heads, groups, dtype=jnp.float32, seed=0):
  """Reference-signature arguments; the trash page holds huge values so reading it shows."""
  batch, q_len = len(prefix_lengths), mask_TxT.shape[0]
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.normal(size=shape).astype(np.float32)
  k_pages = normal(NUM_PAGES, num_kv_heads, PAGE_SIZE, HEAD_DIM)
  v_pages = normal(NUM_PAGES, num_kv_heads, PAGE_SIZE, HEAD_DIM)
  k_pages[TRASH_PAGE] = 50.0
  v_pages[TRASH_PAGE] = 1e4
  return (jnp.asarray(normal(batch, q_len, num_kv_heads * groups, HEAD_DIM), dtype),
          jnp.asarray(k_pages, dtype), jnp.asarray(v_pages, dtype),
          jnp.asarray(PAGE_TABLE[:batch]), jnp.asarray(prefix_lengths, jnp.int32),
          jnp.asarray(normal(batch, q_len, num_kv_heads, HEAD_DIM), dtype),
          jnp.asarray(normal(batch, q_len, num_kv_heads, HEAD_DIM), dtype),
          jnp.asarray(np.broadcast_to(mask_TxT, (batch, q_len, q_len))))


CASES = {
    # name: (prefix lengths per sequence, new-token mask, KV heads, groups)
    "decode_one_sequence_mid_page": ((6,), causal_mask(1), 2, 1),
    "decode_ragged_gqa4": ((6, 8, 0), causal_mask(1), 2, 4),
    "decode_page_boundaries": ((12, 4, 16), causal_mask(1), 1, 4),
    "chain4_ragged": ((6, 8, 0), causal_mask(4), 2, 1),
    "chain4_ragged_gqa4": ((5, 8, 13), causal_mask(4), 2, 4),
    "tree7_ragged": ((6, 8, 0), ancestor_mask(TREE_PARENTS), 2, 1),
    "tree7_ragged_gqa4": ((12, 1, 16), ancestor_mask(TREE_PARENTS), 1, 4),
    "chain4_one_sequence_empty_prefix": ((0,), causal_mask(4), 2, 4),
}


@pytest.mark.parametrize("name", CASES)
def test_kernel_matches_reference_float32(name):
  prefix_lengths, mask_TxT, num_kv_heads, groups = CASES[name]
  args = make_inputs(prefix_lengths=prefix_lengths, mask_TxT=mask_TxT,
                     num_kv_heads=num_kv_heads, groups=groups)
  expected = paged_attention_reference(*args)
  got = jax.jit(pallas_interpret)(*args)
  chex.assert_shape(got, args[0].shape)
  chex.assert_trees_all_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pages_per_block", [1, 2, 3, 4])
def test_pages_per_block_does_not_change_the_result(pages_per_block):
  # 3 does not divide the 4 page-table slots: the last block is partly past the table.
  args = make_inputs(prefix_lengths=(9, 8, 15), mask_TxT=causal_mask(4), num_kv_heads=2,
                     groups=2, seed=1)
  got = pallas_interpret(*args, pages_per_block=pages_per_block)
  chex.assert_trees_all_close(got, paged_attention_reference(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mask_TxT", [causal_mask(1), ancestor_mask(TREE_PARENTS)],
                         ids=["decode", "tree7"])
def test_kernel_matches_reference_bfloat16(mask_TxT):
  args = make_inputs(prefix_lengths=(6, 8, 0), mask_TxT=mask_TxT, num_kv_heads=2, groups=4,
                     dtype=jnp.bfloat16, seed=2)
  got = pallas_interpret(*args)
  assert got.dtype == jnp.bfloat16
  chex.assert_trees_all_close(got.astype(jnp.float32),
                              paged_attention_reference(*args).astype(jnp.float32),
                              atol=3e-2, rtol=3e-2)


def test_stale_keys_past_the_prefix_are_never_seen():
  args = make_inputs(prefix_lengths=(6, 8, 0), mask_TxT=causal_mask(4), num_kv_heads=2,
                     groups=2, seed=3)
  q, k_pages, v_pages, page_table, prefix_lengths = args[:5]
  before = pallas_interpret(*args)
  # Overwrite every position no sequence may see (page 10 holds row 0's positions 8..11,
  # row 0 sees 6; row 2 sees nothing of its pages).
  stale_v = v_pages.at[10].set(-7.0).at[3, :, 2:].set(-7.0).at[jnp.array([2, 11, 4, 9])].set(-7.0)
  after = pallas_interpret(q, k_pages, stale_v, page_table, prefix_lengths, *args[5:])
  chex.assert_trees_all_close(after, before, atol=1e-6)


def test_query_that_sees_nothing_gets_zeros():
  # A padding query: empty prefix and an all-false mask row. The reference spreads its
  # weight over every key there; the kernel returns zeros, finite either way.
  mask_TxT = causal_mask(3)
  mask_TxT[0] = False
  args = make_inputs(prefix_lengths=(0, 5), mask_TxT=mask_TxT, num_kv_heads=1, groups=2)
  got = pallas_interpret(*args)
  np.testing.assert_array_equal(np.asarray(got[0, 0]), 0.0)
  chex.assert_tree_all_finite(got)
  chex.assert_trees_all_close(got[:, 1:], paged_attention_reference(*args)[:, 1:],
                              atol=1e-5, rtol=1e-5)


def test_plugs_into_paged_kv_as_its_attention_fn():
  q, k_pages, v_pages, page_table, prefix_lengths, k_new, v_new, mask = make_inputs(
      prefix_lengths=(6, 8, 0), mask_TxT=causal_mask(4), num_kv_heads=2, groups=4)
  positions = prefix_lengths[:, None] + jnp.arange(4)[None, :]
  backends = [PagedKV(k_pages=(k_pages,), v_pages=(v_pages,), page_table_BxM=page_table,
                      prefix_lengths_B=prefix_lengths, new_mask_BxTxT=mask,
                      write_positions_BxT=positions, attention_fn=attention_fn)
              for attention_fn in (paged_attention_reference, pallas_interpret)]
  (expected, expected_kv), (got, got_kv) = [kv.attend(0, q, k_new, v_new) for kv in backends]
  chex.assert_trees_all_close(got, expected, atol=1e-5, rtol=1e-5)
  chex.assert_trees_all_equal(got_kv.k_pages, expected_kv.k_pages)


def test_dispatcher_uses_the_reference_on_cpu_and_the_kernel_on_request():
  args = make_inputs(prefix_lengths=(6, 8, 0), mask_TxT=causal_mask(1), num_kv_heads=2,
                     groups=1)
  expected = paged_attention_reference(*args)
  chex.assert_trees_all_equal(paged_attention(*args), expected)
  chex.assert_trees_all_close(paged_attention(*args, implementation="pallas"), expected,
                              atol=1e-5, rtol=1e-5)
  with pytest.raises(ConfigError, match="implementation='triton'"):
    paged_attention(*args, implementation="triton")


def test_inconsistent_shapes_are_rejected_by_name():
  args = list(make_inputs(prefix_lengths=(6, 8), mask_TxT=causal_mask(2), num_kv_heads=2,
                          groups=1))
  args[7] = args[7][:, :1]
  with pytest.raises(ValueError, match="new_mask_BxTxT has shape"):
    pallas_interpret(*args)
  with pytest.raises(ConfigError, match="pages_per_block=0"):
    pallas_interpret(*make_inputs(prefix_lengths=(6,), mask_TxT=causal_mask(1),
                                  num_kv_heads=1, groups=1), pages_per_block=0)
