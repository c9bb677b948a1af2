"""Paged attention for GPUs: a Pallas kernel written for the Triton lowering.

Same contract as ``specrl_jax.kv.paged.paged_attention_reference``: T query tokens per
sequence (1 for plain decode, a chain or tree of drafts for verification) see the
sequence's committed prefix, stored in pages of a shared pool, and N >= T new keys by
``new_mask_BxTxL`` (scratch keys of shallower tree levels first, then the call's own T);
a query row that sees no key gives zeros.

Kernel layout: grid = (batch, KV head). One program owns the R = T * groups query rows
that share a KV head, so each key page is read once for all of them, and loops over
the sequence's pages only up to its prefix length (a dynamic trip count: pages past
the prefix, shared or trash, are never read), then folds in the new keys, with an
online softmax in float32 throughout. The Triton lowering wants power-of-two tensors
and dots at least 16 wide: query rows and new keys are padded to that here (padded
keys are masked, padded rows are dropped), page_size and head_dim must be powers of
two >= 16 when compiled. Runs anywhere with ``interpret=True`` (the CPU tests), at any
page size and head_dim.

Not done here: splitting a long prefix across programs (flash-decoding's split-K).
With B * KV programs a batch-1 decode of a model with 8 KV heads occupies 8 of an
H200's 132 SMs; that matters once attention, not the weights, dominates a step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from specrl_jax.kernels.shapes import check_paged_attention_shapes
from specrl_jax.models.attention import MASK_VALUE

Array = jax.Array

# Triton's dot needs every matrix dimension >= 16.
_MIN_DOT = 16


def _padded(n: int) -> int:
  return max(_MIN_DOT, pl.next_power_of_2(n))


def fits_triton(page_size: int, head_dim: int) -> bool:
  """Whether a pool of these pages lowers: both powers of two, at least 16."""
  return all(n >= _MIN_DOT and not n & (n - 1) for n in (page_size, head_dim))


def paged_attention_gpu(q_BxTxHxD: Array, k_pages_PxKxSxD: Array, v_pages_PxKxSxD: Array,
                        page_table_BxM: Array, prefix_lengths_B: Array, k_new_BxLxKxD: Array,
                        v_new_BxLxKxD: Array, new_mask_BxTxL: Array, *,
                        interpret: bool = False, num_warps: int = 4,
                        num_stages: int = 2) -> Array:
  """Paged attention as a Pallas (Triton) kernel; the reference's contract. [B, T, H, D]."""
  check_paged_attention_shapes(q_BxTxHxD, k_pages_PxKxSxD, v_pages_PxKxSxD, page_table_BxM,
                               prefix_lengths_B, k_new_BxLxKxD, v_new_BxLxKxD, new_mask_BxTxL)
  batch, q_len, num_heads, head_dim = q_BxTxHxD.shape
  _, num_kv_heads, page_size, _ = k_pages_PxKxSxD.shape
  new_keys = new_mask_BxTxL.shape[-1]
  if not interpret and not fits_triton(page_size, head_dim):
    raise ValueError(f"paged_attention_gpu: page_size={page_size}, head_dim={head_dim}; the "
                     f"Triton lowering needs powers of two >= {_MIN_DOT} (interpret mode "
                     "takes any).")
  groups = num_heads // num_kv_heads
  rows = q_len * groups
  rows_padded, keys_padded = _padded(rows), _padded(new_keys)

  # Rows of one KV head ordered (token, group), so the mask expands by repetition.
  q_BxKxRxD = (q_BxTxHxD.reshape(batch, q_len, num_kv_heads, groups, head_dim)
               .transpose(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, rows, head_dim))
  q_BxKxRxD = jnp.pad(q_BxKxRxD, ((0, 0), (0, 0), (0, rows_padded - rows), (0, 0)))
  pad_keys = ((0, 0), (0, 0), (0, keys_padded - new_keys), (0, 0))
  # As in the reference: keys in the query dtype, values in the pool's (a bfloat16 pool
  # under float32 activations: EngineConfig.kv_dtype).
  k_new_BxKxLxD = jnp.pad(k_new_BxLxKxD.astype(q_BxTxHxD.dtype).transpose(0, 2, 1, 3),
                          pad_keys)
  v_new_BxKxLxD = jnp.pad(v_new_BxLxKxD.astype(v_pages_PxKxSxD.dtype).transpose(0, 2, 1, 3),
                          pad_keys)
  # Booleans are no memory type Triton loads well; int32 is. Padded rows and keys: 0.
  mask_BxRxL = jnp.repeat(new_mask_BxTxL.astype(jnp.int32), groups, axis=1)
  mask_BxRxL = jnp.pad(mask_BxRxL, ((0, 0), (0, rows_padded - rows),
                                    (0, keys_padded - new_keys)))

  per_head = lambda b, h: (b, h, 0, 0)
  # The whole table, lengths and pools: refs are pointers under Triton, the kernel reads
  # the entries and pages it needs. (Whole arrays, not one head's slice of the pool:
  # interpret mode would copy a slice per program, a full block it does not.)
  whole = lambda array: pl.BlockSpec(array.shape, lambda b, h: (0,) * array.ndim)
  precision = (jax.lax.Precision.HIGHEST if q_BxTxHxD.dtype == jnp.float32
               else jax.lax.Precision.DEFAULT)
  kernel = functools.partial(_kernel, page_size=page_size, scale=head_dim ** -0.5,
                             precision=precision)
  out_BxKxRxD = pl.pallas_call(
      kernel,
      grid=(batch, num_kv_heads),
      in_specs=[whole(page_table_BxM), whole(prefix_lengths_B),
                pl.BlockSpec((None, None, rows_padded, head_dim), per_head),
                pl.BlockSpec((None, None, keys_padded, head_dim), per_head),
                pl.BlockSpec((None, None, keys_padded, head_dim), per_head),
                pl.BlockSpec((None, rows_padded, keys_padded), lambda b, h: (b, 0, 0)),
                whole(k_pages_PxKxSxD), whole(v_pages_PxKxSxD)],
      out_specs=pl.BlockSpec((None, None, rows_padded, head_dim), per_head),
      out_shape=jax.ShapeDtypeStruct(q_BxKxRxD.shape, q_BxTxHxD.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="paged_attention_gpu",
  )(page_table_BxM.astype(jnp.int32), prefix_lengths_B.astype(jnp.int32), q_BxKxRxD,
    k_new_BxKxLxD, v_new_BxKxLxD, mask_BxRxL, k_pages_PxKxSxD, v_pages_PxKxSxD)
  return (out_BxKxRxD[:, :, :rows].reshape(batch, num_kv_heads, q_len, groups, head_dim)
          .transpose(0, 2, 1, 3, 4).reshape(batch, q_len, num_heads, head_dim))


def _kernel(page_table_ref, prefix_lengths_ref, q_ref, k_new_ref, v_new_ref, mask_ref,
            k_pool_ref, v_pool_ref, out_ref, *, page_size, scale, precision):
  b, kv_head = pl.program_id(0), pl.program_id(1)
  prefix_length = prefix_lengths_ref[b]
  q_RxD = q_ref[...]
  rows, head_dim = q_RxD.shape

  def attend(carry, k_LxD, v_LxD, visible_RxL):
    acc_RxD, max_R, sum_R = carry
    scores_RxL = plgpu.dot(q_RxD, k_LxD, trans_b=True, precision=precision) * scale
    scores_RxL = jnp.where(visible_RxL, scores_RxL, MASK_VALUE)
    max_new_R = jnp.maximum(max_R, jnp.max(scores_RxL, axis=1))
    # Masked keys get exactly zero weight, so a row that has seen nothing keeps sum 0
    # (and the running max starts at the mask value, not -inf: -inf - -inf is NaN).
    probs_RxL = jnp.where(visible_RxL, jnp.exp(scores_RxL - max_new_R[:, None]), 0.0)
    rescale_R = jnp.exp(max_R - max_new_R)
    acc_RxD = rescale_R[:, None] * acc_RxD + plgpu.dot(probs_RxL.astype(v_LxD.dtype), v_LxD,
                                                    precision=precision)
    return acc_RxD, max_new_R, rescale_R * sum_R + jnp.sum(probs_RxL, axis=1)

  def page_step(index, carry):
    page = page_table_ref[b, index]
    position_1xS = index * page_size + jax.lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
    visible_RxS = jnp.broadcast_to(position_1xS < prefix_length, (rows, page_size))
    return attend(carry, k_pool_ref[page, kv_head].astype(q_RxD.dtype),
                  v_pool_ref[page, kv_head], visible_RxS)

  carry = (jnp.zeros((rows, head_dim), jnp.float32),
           jnp.full((rows,), MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32))
  num_pages = jnp.minimum(pl.cdiv(prefix_length, page_size), page_table_ref.shape[1])
  carry = jax.lax.fori_loop(0, num_pages, page_step, carry)
  acc_RxD, _, sum_R = attend(carry, k_new_ref[...], v_new_ref[...], mask_ref[...] != 0)
  out = jnp.where(sum_R[:, None] > 0, acc_RxD / jnp.where(sum_R > 0, sum_R, 1.0)[:, None], 0.0)
  out_ref[...] = out.astype(out_ref.dtype)
