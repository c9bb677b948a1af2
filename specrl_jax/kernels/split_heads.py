"""Paged attention with the heads split over a mesh's "tensor" axis.

A Pallas call has no partitioning rule: left to the compiler on a tensor-parallel
mesh, its operands would be gathered whole onto every device. Attention is independent
per KV head (and its group of query heads), so a ``shard_map`` over "tensor" runs the
kernel once per shard of heads on exactly the heads that shard holds: queries and new
keys split on their head axis, the pages on their KV-head axis (as the sharded key and
value projections write them), the page table, prefix lengths and mask whole.
Mosaic (TPU) kernels lower only where every mesh axis is manual, so the region is
manual over the batch axes too unless the caller's already is.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh, PartitionSpec as P

from specrl_jax.kv.paged import AttentionFn, paged_attention_reference

Array = jax.Array

_HEADS = P(None, None, "tensor", None)       # [B, T or L, H or K, D]
_PAGE_HEADS = P(None, "tensor", None, None)  # [P, K, S, D]


@dataclasses.dataclass(frozen=True)
class SplitHeads:
  """``kernel`` (the paged contract) run per "tensor" shard of the heads of ``mesh``.

  With fewer KV heads than tensor shards (or a count they do not divide) the KV heads
  are not split, and the reference runs instead, as the compiler partitions it itself.
  Frozen and hashable: PagedKV holds it as a static field.
  """
  kernel: AttentionFn
  mesh: Mesh

  @property
  def tensor(self) -> int:
    return self.mesh.shape["tensor"]

  def splits(self, num_kv_heads: int) -> bool:
    return num_kv_heads % self.tensor == 0

  def __call__(self, q_BxTxHxD: Array, k_pages_PxKxSxD: Array, v_pages_PxKxSxD: Array,
               page_table_BxM: Array, prefix_lengths_B: Array, k_new_BxLxKxD: Array,
               v_new_BxLxKxD: Array, new_mask_BxTxL: Array) -> Array:
    args = (q_BxTxHxD, k_pages_PxKxSxD, v_pages_PxKxSxD, page_table_BxM, prefix_lengths_B,
            k_new_BxLxKxD, v_new_BxLxKxD, new_mask_BxTxL)
    if not self.splits(k_pages_PxKxSxD.shape[1]):
      return paged_attention_reference(*args)
    # Inside a per-shard program the context's mesh (its batch axes manual) is the one
    # to nest in; elsewhere, ours.
    context = jax.sharding.get_abstract_mesh()
    per_shard = jax.shard_map(
        self.kernel, mesh=self.mesh if context.empty else context,
        in_specs=(_HEADS, _PAGE_HEADS, _PAGE_HEADS, P(), P(), _HEADS, _HEADS, P()),
        out_specs=_HEADS, axis_names=self.axes_to_enter(), check_vma=False)
    return per_shard(*args)

  def axes_to_enter(self) -> set[str]:
    """Every axis of the mesh not already manual where this is traced: Mosaic kernels
    lower only in a region manual over all of them (the batch axes, when a per-shard
    program has not made them manual already, hold one shard: their specs replicate)."""
    context = jax.sharding.get_abstract_mesh()
    already = set() if context.empty else set(context.manual_axes)
    return set(self.mesh.axis_names) - already
