"""A page pool with reference counts, allocated and released inside jit.

Pages are the unit of KV storage. A sequence's page table lists the pages holding
its tokens in order; pages can be shared (the prompt pages of a GRPO group are
written once and referenced by every sample), so each page carries a reference count
and returns to the free stack only when the count reaches zero.

Page 0 is a permanent "trash" page: it is never handed out, unused page-table entries
point to it, and writes that must go nowhere (padding, finished slots) land there. That
keeps every scatter unconditional and static in shape.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

Array = jax.Array

TRASH_PAGE = 0


@flax.struct.dataclass
class PagePool:
  """Free-list state of ``num_pages`` pages (KV contents live in the KV backend).

  refcount_P: users of each page (the trash page is pinned at 1).
  free_stack_P: free page ids in entries [0, num_free); the top is num_free - 1.
  exhausted: sticky flag set when an allocation could not be served; the caller turns
    it into an error. A failed allocation hands out nothing, so nothing is overwritten.
  """
  refcount_P: Array
  free_stack_P: Array
  num_free: Array
  exhausted: Array

  @property
  def num_pages(self) -> int:
    return self.refcount_P.shape[0]


def init_pool(num_pages: int) -> PagePool:
  if num_pages < 2:
    raise ValueError(f"num_pages={num_pages} is too small: page 0 is reserved, need >= 2.")
  refcount = jnp.zeros((num_pages,), jnp.int32).at[TRASH_PAGE].set(1)
  # Stack order: pop from the top, so hand out low page ids first (easier to read).
  free_stack = jnp.concatenate([jnp.arange(num_pages - 1, 0, -1, dtype=jnp.int32),
                                jnp.zeros((1,), jnp.int32)])
  return PagePool(refcount_P=refcount, free_stack_P=free_stack,
                  num_free=jnp.int32(num_pages - 1), exhausted=jnp.bool_(False))


def allocate(pool: PagePool, counts_N: Array, max_per_row: int) -> tuple[PagePool, Array, Array]:
  """Pops ``counts_N[n]`` (<= max_per_row) fresh pages for each row n.

  Returns (pool, pages_NxA, ok): pages_NxA[n, j] for j < counts_N[n] are the new pages
  (refcount 1), other entries are TRASH_PAGE. When the pool cannot serve all rows at
  once nothing is allocated, ok is False and the pool's exhausted flag is set.
  """
  counts_N = jnp.minimum(counts_N.astype(jnp.int32), max_per_row)
  total = jnp.sum(counts_N)
  ok = total <= pool.num_free
  offsets_N = jnp.cumsum(counts_N) - counts_N
  slot_NxA = offsets_N[:, None] + jnp.arange(max_per_row, dtype=jnp.int32)[None, :]
  wanted_NxA = (jnp.arange(max_per_row)[None, :] < counts_N[:, None]) & ok
  stack_index = jnp.clip(pool.num_free - 1 - slot_NxA, 0, pool.num_pages - 1)
  pages_NxA = jnp.where(wanted_NxA, pool.free_stack_P[stack_index], TRASH_PAGE)
  refcount = pool.refcount_P.at[jnp.where(wanted_NxA, pages_NxA, pool.num_pages)].set(
      1, mode="drop")
  pool = pool.replace(refcount_P=refcount,
                      num_free=pool.num_free - jnp.where(ok, total, 0),
                      exhausted=pool.exhausted | ~ok)
  return pool, pages_NxA, ok


def add_references(pool: PagePool, pages: Array, valid: Array) -> PagePool:
  """Increments the count of every valid page listed (duplicates count each time)."""
  index = jnp.where(valid, pages, pool.num_pages).reshape(-1)
  return pool.replace(refcount_P=pool.refcount_P.at[index].add(1, mode="drop"))


def release(pool: PagePool, pages: Array, valid: Array) -> PagePool:
  """Drops one reference for every valid page listed; pages reaching 0 become free."""
  index = jnp.where(valid, pages, pool.num_pages).reshape(-1)
  before = pool.refcount_P
  after = before.at[index].add(-1, mode="drop")
  freed_P = (before > 0) & (after == 0)
  position_P = pool.num_free + jnp.cumsum(freed_P) - 1
  free_stack = pool.free_stack_P.at[jnp.where(freed_P, position_P, pool.num_pages)].set(
      jnp.arange(pool.num_pages, dtype=jnp.int32), mode="drop")
  return pool.replace(refcount_P=after, free_stack_P=free_stack,
                      num_free=pool.num_free + jnp.sum(freed_P, dtype=jnp.int32))
