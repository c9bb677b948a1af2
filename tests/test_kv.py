"""The paged KV cache: page pool bookkeeping, page writes, prefix gathers, commits."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specrl_jax.kv import pool as page_pool
from specrl_jax.kv.paged import (PagedKV, gather_prefix, paged_attention_reference,
                                 read_pages, write_pages)
from specrl_jax.kv.pool import TRASH_PAGE
from specrl_jax.models.attention import grouped_attention

allocate = jax.jit(page_pool.allocate, static_argnames="max_per_row")
release = jax.jit(page_pool.release)
add_references = jax.jit(page_pool.add_references)


def free_pages(pool) -> list[int]:
  return sorted(np.asarray(pool.free_stack_P[:int(pool.num_free)]).tolist())


def assert_consistent(pool, expected_refcount: np.ndarray):
  """The free stack holds exactly the unused pages, once each; the trash page stays pinned."""
  refcount = np.asarray(pool.refcount_P)
  np.testing.assert_array_equal(refcount, expected_refcount)
  assert refcount[TRASH_PAGE] == 1
  free = free_pages(pool)
  assert len(free) == len(set(free)), f"a page is on the free stack twice: {free}"
  assert free == [p for p in range(1, pool.num_pages) if refcount[p] == 0]


# --- the page pool ----------------------------------------------------------------

def test_a_fresh_pool_has_every_page_but_the_trash_page_free():
  pool = page_pool.init_pool(6)
  assert pool.num_pages == 6
  assert int(pool.num_free) == 5
  assert not bool(pool.exhausted)
  assert_consistent(pool, np.array([1, 0, 0, 0, 0, 0]))


def test_a_pool_needs_a_page_besides_the_trash_page():
  with pytest.raises(ValueError, match="num_pages=1"):
    page_pool.init_pool(1)


def test_allocation_hands_out_distinct_fresh_pages_per_row():
  pool = page_pool.init_pool(10)
  pool, pages_NxA, ok = allocate(pool, jnp.array([2, 0, 3]), max_per_row=3)
  assert bool(ok)
  pages = np.asarray(pages_NxA)
  chex.assert_shape(pages, (3, 3))
  handed_out = [pages[0, 0], pages[0, 1], pages[2, 0], pages[2, 1], pages[2, 2]]
  assert len(set(handed_out)) == 5 and TRASH_PAGE not in handed_out
  # Entries beyond a row's count point at the trash page.
  assert pages[0, 2] == pages[1, 0] == pages[1, 1] == pages[1, 2] == TRASH_PAGE
  expected = np.zeros(10, int)
  expected[[TRASH_PAGE] + handed_out] = 1
  assert_consistent(pool, expected)


def test_counts_above_max_per_row_are_clipped():
  pool, pages_NxA, ok = allocate(page_pool.init_pool(10), jnp.array([5]), max_per_row=2)
  assert bool(ok)
  assert int(pool.num_free) == 7
  assert TRASH_PAGE not in np.asarray(pages_NxA)


def test_exhaustion_sets_the_flag_and_allocates_nothing():
  pool, _, _ = allocate(page_pool.init_pool(5), jnp.array([2]), max_per_row=2)
  before = pool
  pool, pages_NxA, ok = allocate(pool, jnp.array([1, 2]), max_per_row=2)  # 3 > 2 free
  assert not bool(ok)
  assert bool(pool.exhausted)
  np.testing.assert_array_equal(np.asarray(pages_NxA), TRASH_PAGE)
  np.testing.assert_array_equal(pool.refcount_P, before.refcount_P)
  assert int(pool.num_free) == int(before.num_free) == 2
  # The flag is sticky: a later allocation that fits still succeeds, flag stays set.
  pool, pages_NxA, ok = allocate(pool, jnp.array([2]), max_per_row=2)
  assert bool(ok) and bool(pool.exhausted)
  assert sorted(np.asarray(pages_NxA)[0].tolist()) == free_pages(before)


def test_shared_pages_return_only_when_the_last_user_releases():
  pool, pages_NxA, _ = allocate(page_pool.init_pool(6), jnp.array([2]), max_per_row=2)
  shared = pages_NxA[0]
  both = jnp.ones((2,), bool)
  pool = add_references(pool, shared, both)
  pool = add_references(pool, shared, both)  # three users now
  for users_left in (2, 1):
    pool = release(pool, shared, both)
    assert np.asarray(pool.refcount_P)[np.asarray(shared)].tolist() == [users_left] * 2
    assert not set(np.asarray(shared).tolist()) & set(free_pages(pool))
  pool = release(pool, shared, both)
  assert set(np.asarray(shared).tolist()) <= set(free_pages(pool))
  assert_consistent(pool, np.array([1, 0, 0, 0, 0, 0]))


def test_masked_entries_are_neither_referenced_nor_released():
  pool, pages_NxA, _ = allocate(page_pool.init_pool(6), jnp.array([2]), max_per_row=2)
  pool = add_references(pool, pages_NxA[0], jnp.array([True, False]))
  pool = release(pool, pages_NxA[0], jnp.array([False, True]))
  refcount = np.asarray(pool.refcount_P)
  assert refcount[int(pages_NxA[0, 0])] == 2
  assert refcount[int(pages_NxA[0, 1])] == 0
  assert free_pages(pool) == sorted([int(pages_NxA[0, 1]), 3, 4, 5])


def test_random_allocate_share_release_sequences_keep_the_pool_consistent():
  # A reference model of the pool (a refcount per page) driven by random operations;
  # after every step the jitted pool must agree with it and never hand a live page out.
  rng = np.random.default_rng(0)
  num_pages, rows, max_per_row = 24, 4, 3
  pool = page_pool.init_pool(num_pages)
  expected = np.zeros(num_pages, int)
  expected[TRASH_PAGE] = 1
  held: list[int] = []  # one entry per reference held
  failures = 0
  for _ in range(60):
    action = rng.integers(3)
    if action == 0:
      counts = rng.integers(0, max_per_row + 1, size=rows)
      pool, pages_NxA, ok = allocate(pool, jnp.asarray(counts), max_per_row=max_per_row)
      free_before = int((expected[1:] == 0).sum())
      assert bool(ok) == (counts.sum() <= free_before)
      failures += not bool(ok)
      if bool(ok):
        new = [int(p) for n, row in zip(counts, np.asarray(pages_NxA)) for p in row[:n]]
        assert all(expected[p] == 0 for p in new), "a live page was handed out again"
        assert len(new) == len(set(new)) == counts.sum()
        expected[new] = 1
        held += new
    elif held:
      picks = rng.choice(len(held), size=min(len(held), 5), replace=False)
      pages = jnp.asarray([held[i] for i in picks])
      if action == 1:
        pool = add_references(pool, pages, jnp.ones(len(picks), bool))
        np.add.at(expected, [held[i] for i in picks], 1)
        held += [held[i] for i in picks]
      else:
        pool = release(pool, pages, jnp.ones(len(picks), bool))
        np.add.at(expected, [held[i] for i in picks], -1)
        held = [p for i, p in enumerate(held) if i not in set(picks.tolist())]
    assert_consistent(pool, expected)
    assert bool(pool.exhausted) == (failures > 0)
  assert failures > 0, "the random walk should also hit exhaustion"


# --- page writes and gathers -------------------------------------------------------

def numbered_pages(num_pages: int, page_size: int) -> jax.Array:
  """pages[p, :, s] = 100 * p + s in every (head, dim) entry: easy to read back."""
  ids = 100 * jnp.arange(num_pages)[:, None] + jnp.arange(page_size)[None, :]
  return jnp.broadcast_to(ids[:, None, :, None], (num_pages, 2, page_size, 3)).astype(jnp.float32)


def test_gather_prefix_lays_pages_end_to_end_in_table_order():
  pages = numbered_pages(6, 4)
  table_BxM = jnp.array([[3, 1, 5], [2, 0, 0]])
  prefix = gather_prefix(pages, table_BxM)
  chex.assert_shape(prefix, (2, 12, 2, 3))
  position = np.arange(12)
  np.testing.assert_array_equal(prefix[0, :, 0, 0], 100 * np.array([3, 1, 5])[position // 4]
                                + position % 4)
  np.testing.assert_array_equal(prefix[1, :4, 1, 2], 200 + np.arange(4))


def test_write_pages_scatters_by_position_and_sends_negative_positions_to_trash():
  pages = jnp.zeros((5, 2, 4, 3))  # [P, KV, S, D]
  table_BxM = jnp.array([[3, 1], [2, 4]])
  positions_BxT = jnp.array([[0, 5, -1], [7, -1, 2]])
  values = jnp.broadcast_to(jnp.array([[1., 2., 3.], [4., 5., 6.]])[:, :, None, None],
                            (2, 3, 2, 3))
  written = np.asarray(write_pages(pages, table_BxM, positions_BxT, values)).transpose(0, 2, 1, 3)
  assert written[3, 0, 0, 0] == 1  # row 0, position 0 -> page 3 offset 0
  assert written[1, 1, 0, 0] == 2  # row 0, position 5 -> page 1 offset 1
  assert written[4, 3, 0, 0] == 4  # row 1, position 7 -> page 4 offset 3
  assert written[2, 2, 0, 0] == 6  # row 1, position 2 -> page 2 offset 2
  touched = np.zeros((5, 4), bool)
  touched[[3, 1, 4, 2], [0, 1, 3, 2]] = True
  # Everything else outside the trash page is untouched.
  assert not written[1:][~touched[1:]].any()


def test_paged_attention_over_a_gathered_prefix_equals_dense_causal_attention():
  # 7 tokens: the first 5 sit in pages (scattered, out of order), the last 2 are new.
  rng = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(rng[0], (1, 7, 4, 8))
  k = jax.random.normal(rng[1], (1, 7, 2, 8))
  v = jax.random.normal(rng[2], (1, 7, 2, 8))
  table = jnp.array([[4, 2, 0]])
  positions = jnp.arange(5)[None]
  k_pages = write_pages(jnp.zeros((5, 2, 2, 8)), table, positions, k[:, :5])
  v_pages = write_pages(jnp.zeros((5, 2, 2, 8)), table, positions, v[:, :5])
  np.testing.assert_array_equal(read_pages(k_pages, table, positions), k[:, :5])
  causal = jnp.tril(jnp.ones((7, 7), bool))[None]
  out = paged_attention_reference(q[:, 5:], k_pages, v_pages, table, jnp.array([5]),
                                  k[:, 5:], v[:, 5:], causal[:, 5:, 5:])
  dense = grouped_attention(q, k, v, causal)[:, 5:]
  np.testing.assert_allclose(out, dense, atol=1e-5)


def test_commit_writes_only_the_chosen_stashed_tokens():
  # Three stashed new tokens; commit token 2 to position 1 and token 0 to position 0,
  # skip the rest: token 1 (a rejected draft) must never reach the pages.
  zeros = jnp.zeros((4, 1, 2, 1))  # [P, KV, S, D]
  kv = PagedKV(k_pages=(zeros,), v_pages=(zeros,), page_table_BxM=jnp.array([[2, 3]]),
               prefix_lengths_B=jnp.array([0]), new_mask_BxTxT=jnp.ones((1, 3, 3), bool),
               write_positions_BxT=jnp.full((1, 3), -1), stash=True)
  new = jnp.array([10., 20., 30.]).reshape(1, 3, 1, 1)
  _, kv = kv.attend(0, jnp.zeros((1, 3, 1, 1)), new, new + 1)
  committed = kv.commit(jnp.array([[0, 2, 1]]), jnp.array([[0, 1, -1]]))
  assert committed.new_k == () and committed.new_v == ()
  k_pages = np.asarray(committed.k_pages[0])[:, 0, :, 0]
  np.testing.assert_array_equal(k_pages[2], [10, 30])
  np.testing.assert_array_equal(k_pages[3], [0, 0])
  assert 20 not in k_pages[1:]
  np.testing.assert_array_equal(np.asarray(committed.v_pages[0])[2, 0, :, 0], [11, 31])


def _page_copies_in_loops(compiled_text: str, page_shape: str) -> list[str]:
  """Copies of a page-shaped array inside any computation but the entry one (the decode
  loop's body and what it calls)."""
  copies, computation = [], ""
  for line in compiled_text.splitlines():
    if line and not line.startswith(" ") and line.rstrip().endswith("{"):
      computation = line
    elif re.search(rf"= f32\[{page_shape}\]\S* copy\(", line) and not computation.startswith("ENTRY"):
      copies.append(line.strip())
  return copies


@pytest.mark.parametrize("speculative", [False, True])
def test_decode_rounds_update_the_page_pool_in_place(speculative):
  # A round writes a few keys per layer; a copy of the page arrays would cost time in
  # proportion to the whole pool (it did: two copies per layer and round, ~25% of a
  # batch-8 decode step of a 160M model).
  from flax import nnx

  import specrl_jax as sj
  from specrl_jax.speculative import generate as engine_programs, rollout as rollout_programs
  config = sj.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=8)
  model = sj.Transformer(config, rngs=nnx.Rngs(0))
  drafter = (sj.drafters.DraftModel(sj.Transformer(config.replace(num_layers=1),
                                                   rngs=nnx.Rngs(1)))
             if speculative else None)
  spec = sj.SpecConfig(num_draft_tokens=2) if speculative else None
  sampling = sj.SamplingParams(temperature=1.0, max_new_tokens=8)
  inputs, layout, drafter, topology, draft_mode = engine_programs.prepare(
      config, [[1, 2, 3], [4, 5]], sampling, sj.EngineConfig(num_pages=97, page_size=4),
      drafter, spec)
  graphdef, params = nnx.split(model)
  text = rollout_programs._generate.lower(
      graphdef, params, drafter.params() if drafter else (), *inputs, jax.random.key(0),
      sampling=sampling, layout=layout, drafter=drafter, topology=topology,
      draft_mode=draft_mode).compile().as_text()
  assert re.search(r"f32\[97,2,4,8\]", text)  # the page arrays are where we look
  assert _page_copies_in_loops(text, "97,2,4,8") == []
