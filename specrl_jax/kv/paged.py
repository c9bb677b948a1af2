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
from specrl_jax.models.attention import MASK_VALUE

Array = jax.Array


def page_size_of(pages_PxKxSxD: Array) -> int:
  return pages_PxKxSxD.shape[2]


def gather_prefix(pages_PxKxSxD: Array, page_table_BxM: Array) -> Array:
  """All pages of each sequence laid end to end: [B, M * S, KV, D] (tests, debugging)."""
  batch, max_pages = page_table_BxM.shape
  _, heads, page_size, dim = pages_PxKxSxD.shape
  pages_BxMxKxSxD = pages_PxKxSxD[page_table_BxM]
  return pages_BxMxKxSxD.transpose(0, 1, 3, 2, 4).reshape(batch, max_pages * page_size,
                                                          heads, dim)


def paged_attention_reference(q_BxTxHxD: Array, k_pages_PxKxSxD: Array,
                              v_pages_PxKxSxD: Array, page_table_BxM: Array,
                              prefix_lengths_B: Array, k_new_BxTxKxD: Array,
                              v_new_BxTxKxD: Array, new_mask_BxTxT: Array) -> Array:
  """Pure-JAX paged attention. [B, T, H, D]; a query row that sees no key gives zeros.

  Scores are computed page by page against the gathered pages and against the new
  tokens separately, then normalised by one softmax over both. The page dots batch over
  (sequence x page, KV head) with the R = T * groups query rows of a head as the
  matrix rows: the gathered [B * M, KV, S, D] pages are then already in the layout a
  batched matmul reads, whereas a dense [B, context, KV, D] view (or concatenating the
  new keys onto it) costs a relayout of every key and value per layer, which on CPU
  took longer than the dots themselves.
  """
  batch, q_len, num_heads, head_dim = q_BxTxHxD.shape
  num_kv_heads, page_size = k_pages_PxKxSxD.shape[1], k_pages_PxKxSxD.shape[2]
  max_pages = page_table_BxM.shape[1]
  groups = num_heads // num_kv_heads
  rows = q_len * groups
  dtype = q_BxTxHxD.dtype
  # Query rows of one KV head, ordered (group, token).
  q_BxKxRxD = (q_BxTxHxD * head_dim ** -0.5).reshape(
      batch, q_len, num_kv_heads, groups, head_dim).transpose(0, 2, 3, 1, 4).reshape(
          batch, num_kv_heads, rows, head_dim)
  pages_n = page_table_BxM.reshape(-1)
  k_nxKxSxD = k_pages_PxKxSxD[pages_n].astype(dtype)
  v_nxKxSxD = v_pages_PxKxSxD[pages_n]
  q_nxKxRxD = jnp.broadcast_to(q_BxKxRxD[:, None], (batch, max_pages) + q_BxKxRxD.shape[1:]
                               ).reshape((batch * max_pages,) + q_BxKxRxD.shape[1:])
  prefix_BxMxKxRxS = jnp.einsum("nkrd,nksd->nkrs", q_nxKxRxD, k_nxKxSxD,
                                preferred_element_type=jnp.float32).reshape(
                                    batch, max_pages, num_kv_heads, rows, page_size)
  position_MxS = jnp.arange(max_pages * page_size).reshape(max_pages, page_size)
  visible_BxMxS = position_MxS[None] < prefix_lengths_B[:, None, None]
  prefix_BxMxKxRxS = jnp.where(visible_BxMxS[:, :, None, None, :], prefix_BxMxKxRxS,
                               MASK_VALUE)
  new_BxKxRxT = jnp.einsum("bkrd,btkd->bkrt", q_BxKxRxD, k_new_BxTxKxD.astype(dtype),
                           preferred_element_type=jnp.float32)
  new_visible_BxTxT = new_mask_BxTxT.astype(bool)
  new_keys = new_visible_BxTxT.shape[-1]  # T, or E + T with scratch keys before them
  new_visible_BxRxT = jnp.broadcast_to(new_visible_BxTxT[:, None],
                                       (batch, groups, q_len, new_keys)).reshape(
                                           batch, rows, new_keys)
  new_BxKxRxT = jnp.where(new_visible_BxRxT[:, None], new_BxKxRxT, MASK_VALUE)

  max_BxKxR = jnp.maximum(prefix_BxMxKxRxS.max(axis=(1, 4)), new_BxKxRxT.max(axis=-1))
  prefix_weights = jnp.exp(prefix_BxMxKxRxS - max_BxKxR[:, None, ..., None])
  new_weights = jnp.exp(new_BxKxRxT - max_BxKxR[..., None])
  total_BxKxR = prefix_weights.sum(axis=(1, 4)) + new_weights.sum(axis=-1)
  value_dtype = v_pages_PxKxSxD.dtype
  out_BxKxRxD = jnp.einsum(
      "nkrs,nksd->nkrd",
      prefix_weights.reshape(batch * max_pages, num_kv_heads, rows, page_size).astype(value_dtype),
      v_nxKxSxD, preferred_element_type=jnp.float32).reshape(
          batch, max_pages, num_kv_heads, rows, head_dim).sum(axis=1)
  out_BxKxRxD += jnp.einsum("bkrt,btkd->bkrd", new_weights.astype(value_dtype),
                            v_new_BxTxKxD.astype(value_dtype), preferred_element_type=jnp.float32)
  # A padding query sees no key: its weights are all exp(0) of the mask value; zero it.
  sees_anything_BxR = ((prefix_lengths_B > 0)[:, None]
                       | jnp.any(new_visible_BxRxT, axis=-1))
  out_BxKxRxD = jnp.where(sees_anything_BxR[:, None, :, None],
                          out_BxKxRxD / total_BxKxR[..., None], 0.0)
  return (out_BxKxRxD.reshape(batch, num_kv_heads, groups, q_len, head_dim)
          .transpose(0, 3, 1, 2, 4).reshape(batch, q_len, num_heads, head_dim).astype(dtype))


AttentionFn = Callable[..., Array]


def page_slots(page_table_BxM: Array, positions_BxT: Array, page_size: int
               ) -> tuple[Array, Array]:
  """(page, offset) of each cache position; negative positions, and positions past the
  page table's capacity, map to the trash page. (A round may commit accepted drafts
  past a sequence's token budget; they were not emitted, so their keys and values
  are never read, and the context need not be sized for them.)"""
  capacity = page_table_BxM.shape[1] * page_size
  valid = (positions_BxT >= 0) & (positions_BxT < capacity)
  safe = jnp.where(valid, positions_BxT, 0)
  page_BxT = jnp.take_along_axis(page_table_BxM, safe // page_size, axis=1)
  return jnp.where(valid, page_BxT, TRASH_PAGE), jnp.where(valid, safe % page_size, 0)


def write_pages(pages_PxKxSxD: Array, page_table_BxM: Array, positions_BxT: Array,
                values_BxTxKxD: Array) -> Array:
  """Scatters values to cache positions; negative positions go to the trash page."""
  page_BxT, offset_BxT = page_slots(page_table_BxM, positions_BxT, page_size_of(pages_PxKxSxD))
  head_K = jnp.arange(pages_PxKxSxD.shape[1])
  return pages_PxKxSxD.at[page_BxT[..., None], head_K, offset_BxT[..., None]].set(
      values_BxTxKxD.astype(pages_PxKxSxD.dtype))


def read_pages(pages_PxKxSxD: Array, page_table_BxM: Array, positions_BxT: Array) -> Array:
  """Values at cache positions [B, T, KV, D] (the trash page's for negative positions)."""
  page_BxT, offset_BxT = page_slots(page_table_BxM, positions_BxT, page_size_of(pages_PxKxSxD))
  head_K = jnp.arange(pages_PxKxSxD.shape[1])
  return pages_PxKxSxD[page_BxT[..., None], head_K, offset_BxT[..., None]]


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

  k_pages / v_pages: per layer [P, KV, S, D]: head-major within a page, so a page's
    keys for one head are contiguous (what the dots and a TPU kernel want to read).
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
  # What a prefill call (empty prefixes, causal new-token masks) attends with instead;
  # None: attention_fn.
  prefill_attention_fn: AttentionFn | None = flax.struct.field(pytree_node=False,
                                                               default=None)

  def attend(self, layer, q_BxTxHxD, k_BxTxKxD, v_BxTxKxD):
    k_visible, v_visible = k_BxTxKxD, v_BxTxKxD
    if self.scratch_k:
      # Scratch and stash are indexed in call order: the i-th layer this forward visits.
      visit = len(self.new_k)
      k_visible = jnp.concatenate([self.scratch_k[visit], k_BxTxKxD], axis=1)
      v_visible = jnp.concatenate([self.scratch_v[visit], v_BxTxKxD], axis=1)
    kv = self
    if self.stash:
      kv = self.replace(new_k=self.new_k + (k_BxTxKxD,), new_v=self.new_v + (v_BxTxKxD,))
    else:
      # Write first, then read the written pages: the new positions are at or past the
      # prefix lengths, so attention masks them there (it sees the new tokens through
      # k_visible). Reading before writing would let XLA schedule the write first and
      # copy the whole page array, twice per layer and round (an optimization barrier
      # does not prevent it on CPU); this order is a data dependence it keeps.
      kv = self.replace(
          k_pages=_replace_at(self.k_pages, layer, write_pages(
              self.k_pages[layer], self.page_table_BxM, self.write_positions_BxT, k_BxTxKxD)),
          v_pages=_replace_at(self.v_pages, layer, write_pages(
              self.v_pages[layer], self.page_table_BxM, self.write_positions_BxT, v_BxTxKxD)))
    out = self.attention_fn(q_BxTxHxD, kv.k_pages[layer], kv.v_pages[layer],
                            self.page_table_BxM, self.prefix_lengths_B, k_visible,
                            v_visible, self.new_mask_BxTxT)
    return out, kv

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
  """Empty K and V page arrays [P, KV, S, D], one per (num_kv_heads, head_dim) entry."""
  shapes = [(num_pages, heads, page_size, dim) for heads, dim in layer_shapes]
  return (tuple(jnp.zeros(shape, dtype) for shape in shapes),
          tuple(jnp.zeros(shape, dtype) for shape in shapes))
