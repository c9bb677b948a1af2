"""Paged attention for TPUs: a Pallas kernel for the Mosaic lowering.

One call attends ``T`` query tokens per sequence (1 for plain decode, a chain or a tree
of drafts for verification) to two kinds of keys: the sequence's committed prefix,
stored in pages of a shared pool and visible to every query, and N >= T new keys (the
call's own, after any scratch keys of shallower tree levels), visible according to
``new_mask_BxTxL``. The result matches
``specrl_jax.kv.paged.paged_attention_reference``, which gathers every page and runs
dense masked attention; this kernel instead streams only the pages a sequence uses.

Kernel layout (flash-decoding with an online softmax):
  grid = (batch, kv head, page block). One program owns the ``T * groups`` query rows
  that share a KV head, so every key page is read once for all of them. The page
  table and prefix lengths are scalar-prefetched: the index maps use them to fetch
  the pages of one block, and blocks past the prefix re-use the last useful block
  index (so the pipeline issues no copy) and skip their compute. The new tokens and
  their mask are folded in at the last page block, which also normalises and writes
  the output.

Scalar prefetch and a reduction over a sequential grid axis have no counterpart in
the Triton backend: GPUs use ``paged_attention_gpu``. On CPU this runs with
``interpret=True`` (the tests). It has not been compiled on a TPU yet. The pool layout
[P, KV, S, D] keeps a page block's two minor axes (page_size, head_dim) whole, as
Mosaic's tiling wants.

Why not JAX's maintained ``pallas.ops.tpu.ragged_paged_attention``: it reads one pool
[P, S, 2 * KV, D] with keys and values interleaved by head, expects the call's new
keys already written to the pages, and masks causally only. An adapter would need
that pool layout throughout kv/ (the writes, the prefix sharing, the stash and commit
of drafts) and could still serve only plain decode and chains: never trees (ancestor
masks), nor calls with scratch keys, nor verification that must not write rejected
drafts to the cache. So every case here runs this kernel.
"""

from __future__ import annotations

import functools
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from specrl_jax.config import check, check_positive_int
from specrl_jax.kernels.shapes import check_paged_attention_shapes
from specrl_jax.models.attention import MASK_VALUE

Array = jax.Array

# About this many prefix keys per grid step when pages_per_block is left to us: enough
# to fill a 128-wide matrix unit without holding many page buffers.
_TARGET_KEYS_PER_BLOCK = 128


def paged_attention_tpu(q_BxTxHxD: Array, k_pages_PxKxSxD: Array,
                        v_pages_PxKxSxD: Array, page_table_BxM: Array,
                        prefix_lengths_B: Array, k_new_BxLxKxD: Array,
                        v_new_BxLxKxD: Array, new_mask_BxTxL: Array, *,
                        interpret: bool = False,
                        pages_per_block: int | None = None) -> Array:
  """Paged attention as a Pallas kernel; same contract as the reference. [B, T, H, D].

  Query rows that may see no key at all (no prefix and an all-false mask row, i.e.
  padding) come out as zeros, as in the reference.
  ``pages_per_block``: pages handled per grid step (None: about 128 keys' worth).
  """
  batch, q_len, num_heads, head_dim = q_BxTxHxD.shape
  _, num_kv_heads, page_size, _ = k_pages_PxKxSxD.shape
  max_pages = page_table_BxM.shape[1]
  check_paged_attention_shapes(q_BxTxHxD, k_pages_PxKxSxD, v_pages_PxKxSxD, page_table_BxM,
                               prefix_lengths_B, k_new_BxLxKxD, v_new_BxLxKxD, new_mask_BxTxL)
  new_keys = new_mask_BxTxL.shape[-1]
  if pages_per_block is None:
    pages_per_block = min(max_pages, max(1, _TARGET_KEYS_PER_BLOCK // page_size))
  check_positive_int("paged_attention_tpu", "pages_per_block", pages_per_block)
  groups = num_heads // num_kv_heads
  rows = q_len * groups
  num_blocks = pl.cdiv(max_pages, pages_per_block)

  # Rows of one KV head ordered (token, group) so the mask expands by repetition.
  q_BxKxRxD = (q_BxTxHxD.reshape(batch, q_len, num_kv_heads, groups, head_dim)
               .transpose(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, rows, head_dim))
  # As in the reference: keys in the query dtype, values in the pool's.
  k_new_BxKxLxD = k_new_BxLxKxD.astype(q_BxTxHxD.dtype).transpose(0, 2, 1, 3)
  v_new_BxKxLxD = v_new_BxLxKxD.astype(v_pages_PxKxSxD.dtype).transpose(0, 2, 1, 3)
  # Booleans are not a supported memory type on every backend; int32 is.
  new_mask_BxTxL = new_mask_BxTxL.astype(jnp.int32)

  def page_index_map(slot_in_block):
    def index_map(b, kv_head, block, page_table_ref, prefix_lengths_ref):
      # Slots past the prefix point at its last page: an unchanged block index means
      # no copy, and their keys are masked anyway.
      last_used = jnp.maximum(pl.cdiv(prefix_lengths_ref[b], page_size) - 1, 0)
      slot = jnp.minimum(jnp.minimum(block * pages_per_block + slot_in_block, last_used),
                         max_pages - 1)
      return page_table_ref[b, slot], kv_head, 0, 0
    return index_map

  page_specs = [pl.BlockSpec((None, None, page_size, head_dim), page_index_map(i))
                for i in range(pages_per_block)]
  per_head = lambda b, kv_head, block, *_: (b, kv_head, 0, 0)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=2,
      grid=(batch, num_kv_heads, num_blocks),
      in_specs=[
          pl.BlockSpec((None, None, rows, head_dim), per_head),
          pl.BlockSpec((None, None, new_keys, head_dim), per_head),
          pl.BlockSpec((None, None, new_keys, head_dim), per_head),
          pl.BlockSpec((None, q_len, new_keys), lambda b, kv_head, block, *_: (b, 0, 0)),
          *page_specs, *page_specs],
      out_specs=pl.BlockSpec((None, None, rows, head_dim), per_head),
      scratch_shapes=[pltpu.VMEM((rows, 1), jnp.float32),
                      pltpu.VMEM((rows, 1), jnp.float32),
                      pltpu.VMEM((rows, head_dim), jnp.float32)])
  kernel = functools.partial(_paged_attention_kernel, pages_per_block=pages_per_block,
                             page_size=page_size, groups=groups, scale=head_dim ** -0.5)
  out_BxKxRxD = pl.pallas_call(
      kernel,
      grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct(q_BxKxRxD.shape, q_BxTxHxD.dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=interpret,
  )(page_table_BxM.astype(jnp.int32), prefix_lengths_B.astype(jnp.int32), q_BxKxRxD,
    k_new_BxKxLxD, v_new_BxKxLxD, new_mask_BxTxL,
    *([k_pages_PxKxSxD] * pages_per_block), *([v_pages_PxKxSxD] * pages_per_block))
  return (out_BxKxRxD.reshape(batch, num_kv_heads, q_len, groups, head_dim)
          .transpose(0, 2, 1, 3, 4).reshape(batch, q_len, num_heads, head_dim))


def _paged_attention_kernel(page_table_ref, prefix_lengths_ref, q_ref, k_new_ref, v_new_ref,
                            new_mask_ref, *refs, pages_per_block, page_size, groups, scale):
  del page_table_ref  # Consumed by the index maps.
  k_page_refs = refs[:pages_per_block]
  v_page_refs = refs[pages_per_block:2 * pages_per_block]
  out_ref, max_ref, sum_ref, acc_ref = refs[2 * pages_per_block:]
  block = pl.program_id(2)
  prefix_length = prefix_lengths_ref[pl.program_id(0)]
  block_keys = pages_per_block * page_size
  state = _OnlineSoftmax(q_ref, max_ref, sum_ref, acc_ref, scale)

  @pl.when(block == 0)
  def _init():
    # The running max starts at the mask value, not -inf: -inf - -inf would be NaN.
    max_ref[...] = jnp.full(max_ref.shape, MASK_VALUE, jnp.float32)
    sum_ref[...] = jnp.zeros(sum_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  @pl.when(block * block_keys < prefix_length)
  def _prefix_block():
    k_LxD = jnp.concatenate([ref[...] for ref in k_page_refs], axis=0)
    v_LxD = jnp.concatenate([ref[...] for ref in v_page_refs], axis=0)
    position_1xL = block * block_keys + jax.lax.broadcasted_iota(jnp.int32, (1, block_keys), 1)
    state.update(k_LxD, v_LxD, position_1xL < prefix_length)

  @pl.when(block == pl.num_programs(2) - 1)
  def _new_tokens_and_output():
    mask_TxL = new_mask_ref[...] != 0
    q_len, new_keys = mask_TxL.shape
    mask_RxL = jnp.broadcast_to(mask_TxL[:, None, :], (q_len, groups, new_keys)).reshape(
        q_len * groups, new_keys)
    state.update(k_new_ref[...], v_new_ref[...], mask_RxL)
    total = sum_ref[...]
    out = jnp.where(total > 0, acc_ref[...] / jnp.where(total > 0, total, 1.0), 0.0)
    out_ref[...] = out.astype(out_ref.dtype)


class _OnlineSoftmax:
  """Running (max, sum, weighted values) of the softmax over key blocks seen so far."""

  def __init__(self, q_ref, max_ref, sum_ref, acc_ref, scale: float):
    self.q_ref, self.max_ref, self.sum_ref, self.acc_ref = q_ref, max_ref, sum_ref, acc_ref
    self.scale = scale

  def update(self, k_LxD: Array, v_LxD: Array, visible_RxL: Array) -> None:
    q_RxD = self.q_ref[...]
    scores_RxL = _scores(q_RxD, k_LxD.astype(q_RxD.dtype)) * self.scale
    scores_RxL = jnp.where(visible_RxL, scores_RxL, MASK_VALUE)
    max_prev = self.max_ref[...]
    max_new = jnp.maximum(max_prev, scores_RxL.max(axis=1, keepdims=True))
    # Masked keys get exactly zero weight, so a row that has seen nothing keeps sum 0.
    probs_RxL = jnp.where(visible_RxL, jnp.exp(scores_RxL - max_new), 0.0)
    rescale = jnp.exp(max_prev - max_new)
    self.sum_ref[...] = rescale * self.sum_ref[...] + probs_RxL.sum(axis=1, keepdims=True)
    self.acc_ref[...] = rescale * self.acc_ref[...] + _weighted_values(
        probs_RxL.astype(v_LxD.dtype), v_LxD)
    self.max_ref[...] = max_new


# With one key (plain decode's new token) Mosaic lowers a 16-bit matmul to a vector
# broadcast that cannot change the element type and fails to verify; a product of two
# 16-bit numbers is exact in float32, so the elementwise form below is the same sum.
def _scores(q_RxD: Array, k_LxD: Array) -> Array:
  """q k^T in float32. [R, L]."""
  if k_LxD.shape[0] == 1:
    return jnp.sum(q_RxD.astype(jnp.float32) * k_LxD.astype(jnp.float32), axis=1,
                   keepdims=True)
  contract_last = (((1,), (1,)), ((), ()))
  return jax.lax.dot_general(q_RxD, k_LxD, contract_last, preferred_element_type=jnp.float32)


def _weighted_values(probs_RxL: Array, v_LxD: Array) -> Array:
  """probs v in float32. [R, D]."""
  if v_LxD.shape[0] == 1:
    return probs_RxL.astype(jnp.float32) * v_LxD.astype(jnp.float32)
  return jnp.dot(probs_RxL, v_LxD, preferred_element_type=jnp.float32)
