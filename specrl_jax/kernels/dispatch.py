"""Which attention runs where: ``EngineConfig(attention=...)`` resolved per backend.

  "reference": the pure-JAX gather-every-page reference (kv/paged.py) everywhere.
  "pallas":    the paged kernel of the backend (Triton on GPU, Mosaic on TPU) for decode
               and verification, and ``jax.nn.dot_product_attention`` for prefill. On
               GPU, pools the Triton lowering cannot tile (page_size or head_dim not a
               power of two >= 16: the tests' toy models) use the reference. On CPU the
               GPU kernel runs in interpret mode at any shape: exact, and slow (tests).
  "auto":      "pallas" on an accelerator, "reference" on CPU.

On a mesh whose "tensor" axis splits the heads, the kernels run once per head shard
(``split_heads.SplitHeads``). The backend is JAX's default, or the platform a program
is lowered for inside ``platform.lowering_for``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from specrl_jax.config import check
from specrl_jax.kernels.paged_attention_gpu import fits_triton, paged_attention_gpu
from specrl_jax.kernels.paged_attention_tpu import paged_attention_tpu
from specrl_jax.kernels.platform import attention_backend
from specrl_jax.kernels.split_heads import SplitHeads
from specrl_jax.kv.paged import AttentionFn, paged_attention_reference

Array = jax.Array

ATTENTION_CHOICES = ("auto", "reference", "pallas")

# Module-level partials: PagedKV holds these as static fields, and a fresh partial per
# call would compare unequal and recompile every rollout.
paged_attention_gpu_interpret = functools.partial(paged_attention_gpu, interpret=True)
paged_attention_tpu_interpret = functools.partial(paged_attention_tpu, interpret=True)


def paged_attention_gpu_where_it_fits(q_BxTxHxD: Array, k_pages_PxKxSxD: Array,
                                      *args: Array) -> Array:
  """The Triton kernel where the pool's shapes lower, the reference elsewhere."""
  _, _, page_size, head_dim = k_pages_PxKxSxD.shape
  attention_fn = (paged_attention_gpu if fits_triton(page_size, head_dim)
                  else paged_attention_reference)
  return attention_fn(q_BxTxHxD, k_pages_PxKxSxD, *args)


def prefill_attention(q_BxTxHxD: Array, k_pages_PxKxSxD: Array, v_pages_PxKxSxD: Array,
                      page_table_BxM: Array, prefix_lengths_B: Array, k_new_BxTxKxD: Array,
                      v_new_BxTxKxD: Array, new_mask_BxTxT: Array) -> Array:
  """Prefill's attention through ``jax.nn.dot_product_attention``: the paged contract
  for a call with an empty prefix (prefill writes the prompts' keys into the pages and
  sees them as new keys), so the pages are not read.

  On GPU at 16-bit precision it asks for cuDNN's fused kernel, which takes the mask as
  causal plus a key length per row: prefill's mask is exactly that (causal, hiding each
  prompt's padding at the end), and the length is its last row's count. Elsewhere, or
  where cuDNN refuses the shapes, XLA's implementation takes the mask as given.
  """
  del k_pages_PxKxSxD, v_pages_PxKxSxD, page_table_BxM, prefix_lengths_B
  dtype = q_BxTxHxD.dtype
  if attention_backend() == "gpu" and dtype in (jnp.bfloat16, jnp.float16):
    lengths_B = jnp.sum(new_mask_BxTxT[:, -1, :], axis=-1, dtype=jnp.int32)
    try:
      return jax.nn.dot_product_attention(
          q_BxTxHxD, k_new_BxTxKxD.astype(dtype), v_new_BxTxKxD.astype(dtype),
          is_causal=True, key_value_seq_lengths=lengths_B, implementation="cudnn")
    except (NotImplementedError, ValueError, RuntimeError):  # version, shape or dtype
      pass
  return jax.nn.dot_product_attention(
      q_BxTxHxD, k_new_BxTxKxD.astype(dtype), v_new_BxTxKxD.astype(dtype),
      mask=new_mask_BxTxT.astype(bool)[:, None])


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
  """The attention functions a decode engine's PagedKV calls."""
  name: str                  # the resolved choice: "reference" or "pallas"
  decode: AttentionFn        # decode steps, drafting and verification
  prefill: AttentionFn       # the prompts' causal forward


def resolve_attention(attention: str, backend: str | None = None,
                      mesh: Mesh | None = None) -> AttentionPlan:
  """The plan for ``attention`` (one of ATTENTION_CHOICES) on ``backend`` (default:
  ``platform.attention_backend()``); with ``mesh`` (a "tensor" axis > 1 splitting the
  heads) the kernels run per head shard."""
  check(attention in ATTENTION_CHOICES, "EngineConfig", "attention", attention,
        f"one of {ATTENTION_CHOICES}")
  backend = backend or attention_backend()
  if attention == "auto":
    attention = "reference" if backend == "cpu" else "pallas"
  if attention == "reference":
    return AttentionPlan("reference", paged_attention_reference, paged_attention_reference)
  decode = {"tpu": paged_attention_tpu, "gpu": paged_attention_gpu_where_it_fits}.get(
      backend, paged_attention_gpu_interpret)
  if mesh is not None and mesh.shape.get("tensor", 1) > 1:
    decode = SplitHeads(decode, mesh)
  return AttentionPlan("pallas", decode, prefill_attention)


def paged_attention(q_BxTxHxD: Array, k_pages_PxKxSxD: Array, v_pages_PxKxSxD: Array,
                    page_table_BxM: Array, prefix_lengths_B: Array, k_new_BxLxKxD: Array,
                    v_new_BxLxKxD: Array, new_mask_BxTxL: Array, *,
                    attention: str = "auto") -> Array:
  """Decode / verification attention through the choice ``attention`` on this backend."""
  return resolve_attention(attention).decode(
      q_BxTxHxD, k_pages_PxKxSxD, v_pages_PxKxSxD, page_table_BxM, prefix_lengths_B,
      k_new_BxLxKxD, v_new_BxLxKxD, new_mask_BxTxL)
