"""The paged KV backend the transformer attends through while decoding.

Each call sees two kinds of keys: the sequence's *prefix* already committed to pages
(visible to every query of the call), and the call's *new* tokens, visible according
to ``new_mask_BxTxT`` (causal for prefill and chains, ancestor-only for trees). New
keys/values are either written to their cache positions right away (prefill, plain
decode) or stashed so that only the accepted ones are committed after verification:
rejected draft tokens never touch the cache.
"""

from __future__ import annotations

from typing import Callable

import flax.struct
import jax
import jax.numpy as jnp

from specrl_jax.kv.pool import TRASH_PAGE
from specrl_jax.models.attention import grouped_attention

Array = jax.Array


def gather_prefix(pages_PxSxKxD: Array, page_table_BxM: Array) -> Array:
  """All pages of each sequence laid end to end: [B, M * S, KV, D]."""
  batch, max_pages = page_table_BxM.shape
  _, page_size, heads, dim = pages_PxSxKxD.shape
  return pages_PxSxKxD[page_table_BxM].reshape(batch, max_pages * page_size, heads, dim)


def paged_attention_reference(q_BxTxHxD: Array, k_pages_PxSxKxD: Array,
                              v_pages_PxSxKxD: Array, page_table_BxM: Array,
                              prefix_lengths_B: Array, k_new_BxTxKxD: Array,
                              v_new_BxTxKxD: Array, new_mask_BxTxT: Array) -> Array:
  """Pure-JAX paged attention (gather, then dense masked attention). [B, T, H, D]."""
  k_prefix = gather_prefix(k_pages_PxSxKxD, page_table_BxM)
  v_prefix = gather_prefix(v_pages_PxSxKxD, page_table_BxM)
  context = k_prefix.shape[1]
  batch, q_len = q_BxTxHxD.shape[:2]
  prefix_mask_BxC = jnp.arange(context)[None, :] < prefix_lengths_B[:, None]
  mask_BxTxS = jnp.concatenate(
      [jnp.broadcast_to(prefix_mask_BxC[:, None, :], (batch, q_len, context)),
       new_mask_BxTxT.astype(bool)], axis=-1)
  k_all = jnp.concatenate([k_prefix, k_new_BxTxKxD.astype(k_prefix.dtype)], axis=1)
  v_all = jnp.concatenate([v_prefix, v_new_BxTxKxD.astype(v_prefix.dtype)], axis=1)
  return grouped_attention(q_BxTxHxD, k_all, v_all, mask_BxTxS)


AttentionFn = Callable[..., Array]


def write_pages(pages_PxSxKxD: Array, page_table_BxM: Array, positions_BxT: Array,
                values_BxTxKxD: Array) -> Array:
  """Scatters values to cache positions; negative positions go to the trash page."""
  page_size = pages_PxSxKxD.shape[1]
  valid = positions_BxT >= 0
  safe = jnp.where(valid, positions_BxT, 0)
  page_BxT = jnp.take_along_axis(page_table_BxM, safe // page_size, axis=1)
  page_BxT = jnp.where(valid, page_BxT, TRASH_PAGE)
  offset_BxT = jnp.where(valid, safe % page_size, 0)
  return pages_PxSxKxD.at[page_BxT, offset_BxT].set(values_BxTxKxD.astype(pages_PxSxKxD.dtype))


@flax.struct.dataclass
class LayerOffset:
  """A view of a PagedKV whose layer i is the underlying layer i + offset.

  Lets a drafter keep its own layers in the same pages (and page table) as the target:
  allocation, prefix sharing and release then happen once for both models.
  """
  inner: "PagedKV"
  offset: int = flax.struct.field(pytree_node=False, default=0)

  def attend(self, layer, q_BxTxHxD, k_BxTxKxD, v_BxTxKxD):
    out, inner = self.inner.attend(layer + self.offset, q_BxTxHxD, k_BxTxKxD, v_BxTxKxD)
    return out, self.replace(inner=inner)


@flax.struct.dataclass
class PagedKV:
  """KVBackend over per-layer page pools.

  k_pages / v_pages: per layer [P, S, KV, D].
  page_table_BxM: page ids of each sequence (TRASH_PAGE where unused).
  prefix_lengths_B: committed tokens each query may see.
  new_mask_BxTxT: which of this call's tokens each query may see.
  write_positions_BxT: cache position for each new token; -1 = never store it.
  stash: keep new k/v in ``new_k`` / ``new_v`` for ``commit`` instead of writing now.
  """
  k_pages: tuple[Array, ...]
  v_pages: tuple[Array, ...]
  page_table_BxM: Array
  prefix_lengths_B: Array
  new_mask_BxTxT: Array
  write_positions_BxT: Array
  new_k: tuple[Array, ...] = ()
  new_v: tuple[Array, ...] = ()
  # Keys/values of earlier, uncommitted tokens this call's queries may also see (the
  # shallower levels of a draft tree), placed before the call's own new tokens: then
  # new_mask_BxTxT is [B, T, E + T].
  scratch_k: tuple[Array, ...] = ()
  scratch_v: tuple[Array, ...] = ()
  stash: bool = flax.struct.field(pytree_node=False, default=False)
  attention_fn: AttentionFn = flax.struct.field(pytree_node=False,
                                                default=paged_attention_reference)

  def attend(self, layer, q_BxTxHxD, k_BxTxKxD, v_BxTxKxD):
    k_visible, v_visible = k_BxTxKxD, v_BxTxKxD
    if self.scratch_k:
      # Scratch and stash are indexed in call order: the i-th layer this forward visits.
      visit = len(self.new_k)
      k_visible = jnp.concatenate([self.scratch_k[visit], k_BxTxKxD], axis=1)
      v_visible = jnp.concatenate([self.scratch_v[visit], v_BxTxKxD], axis=1)
    out = self.attention_fn(q_BxTxHxD, self.k_pages[layer], self.v_pages[layer],
                            self.page_table_BxM, self.prefix_lengths_B, k_visible,
                            v_visible, self.new_mask_BxTxT)
    if self.stash:
      return out, self.replace(new_k=self.new_k + (k_BxTxKxD,), new_v=self.new_v + (v_BxTxKxD,))
    # Order the in-place write after the read: without this data dependence XLA copies
    # the whole page array to keep the pre-write version alive for the gather.
    out, k_layer, v_layer = jax.lax.optimization_barrier(
        (out, self.k_pages[layer], self.v_pages[layer]))
    k_pages = _replace_at(self.k_pages, layer, write_pages(
        k_layer, self.page_table_BxM, self.write_positions_BxT, k_BxTxKxD))
    v_pages = _replace_at(self.v_pages, layer, write_pages(
        v_layer, self.page_table_BxM, self.write_positions_BxT, v_BxTxKxD))
    return out, self.replace(k_pages=k_pages, v_pages=v_pages)

  def commit(self, source_index_BxT: Array, positions_BxT: Array,
             first_layer: int = 0) -> "PagedKV":
    """Writes stashed k/v of new token ``source_index_BxT[b, j]`` to cache position
    ``positions_BxT[b, j]`` (negative = skip) for the stashed layers, which start at
    ``first_layer``; clears the stash."""
    k_pages, v_pages = list(self.k_pages), list(self.v_pages)
    for visit, (k_new, v_new) in enumerate(zip(self.new_k, self.new_v)):
      layer = first_layer + visit
      k_sel = jnp.take_along_axis(k_new, source_index_BxT[..., None, None], axis=1)
      v_sel = jnp.take_along_axis(v_new, source_index_BxT[..., None, None], axis=1)
      k_pages[layer] = write_pages(k_pages[layer], self.page_table_BxM, positions_BxT, k_sel)
      v_pages[layer] = write_pages(v_pages[layer], self.page_table_BxM, positions_BxT, v_sel)
    return self.replace(k_pages=tuple(k_pages), v_pages=tuple(v_pages), new_k=(), new_v=())


def _replace_at(items: tuple, index: int, value) -> tuple:
  return items[:index] + (value,) + items[index + 1:]


def init_pages(layer_shapes: tuple[tuple[int, int], ...], num_pages: int, page_size: int,
               dtype) -> tuple[tuple[Array, ...], tuple[Array, ...]]:
  """Empty K and V page arrays, one per (num_kv_heads, head_dim) entry."""
  shapes = [(num_pages, page_size, heads, dim) for heads, dim in layer_shapes]
  return (tuple(jnp.zeros(shape, dtype) for shape in shapes),
          tuple(jnp.zeros(shape, dtype) for shape in shapes))
