"""The argument contract every paged-attention implementation checks."""

from __future__ import annotations

import jax

Array = jax.Array


def check_paged_attention_shapes(q_BxTxHxD: Array, k_pages_PxKxSxD: Array,
                                 v_pages_PxKxSxD: Array, page_table_BxM: Array,
                                 prefix_lengths_B: Array, k_new_BxLxKxD: Array,
                                 v_new_BxLxKxD: Array, new_mask_BxTxL: Array) -> None:
  """Raises ValueError naming the first argument whose shape disagrees with q and the
  pool. N, the new keys, is T or E + T (E scratch keys of shallower tree levels)."""
  batch, q_len, num_heads, head_dim = q_BxTxHxD.shape
  num_pages, num_kv_heads, page_size, _ = k_pages_PxKxSxD.shape
  new_keys = new_mask_BxTxL.shape[-1]
  new_shape = (batch, new_keys, num_kv_heads, head_dim)
  expected = (
      ("k_pages_PxKxSxD", k_pages_PxKxSxD.shape, (num_pages, num_kv_heads, page_size, head_dim)),
      ("v_pages_PxKxSxD", v_pages_PxKxSxD.shape, k_pages_PxKxSxD.shape),
      ("page_table_BxM", page_table_BxM.shape, (batch, page_table_BxM.shape[-1])),
      ("prefix_lengths_B", prefix_lengths_B.shape, (batch,)),
      ("new_mask_BxTxL", new_mask_BxTxL.shape, (batch, q_len, max(new_keys, q_len))),
      ("k_new_BxLxKxD", k_new_BxLxKxD.shape, new_shape),
      ("v_new_BxLxKxD", v_new_BxLxKxD.shape, new_shape),
  )
  for name, got, want in expected:
    if tuple(got) != tuple(want):
      raise ValueError(f"paged attention: {name} has shape {tuple(got)}, expected {tuple(want)} "
                       f"from q_BxTxHxD {q_BxTxHxD.shape} and k_pages_PxKxSxD "
                       f"{k_pages_PxKxSxD.shape}.")
  if num_heads % num_kv_heads:
    raise ValueError(f"paged attention: {num_heads} query heads are not a multiple of "
                     f"{num_kv_heads} KV heads.")
