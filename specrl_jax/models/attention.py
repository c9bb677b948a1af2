"""Attention math shared by every KV layout, and the pluggable KV interface.

The transformer never owns a cache. Each attention layer projects q, k, v and hands
them to a ``KVBackend``; the backend decides where keys and values live (nowhere for
a plain causal forward, pages of a pool for decoding) and which positions each query
may see. One model implementation therefore serves training, prefill, decode and
tree verification.
"""

from __future__ import annotations

from typing import Protocol

import flax.struct

import jax
import jax.numpy as jnp

Array = jax.Array

# Large negative instead of -inf, so a fully masked row (a padding query) gives no NaN
# (which would leak into gradients); such rows are then zeroed explicitly.
MASK_VALUE = -1e30


def grouped_attention(q_BxTxHxD: Array, k_BxLxKxD: Array, v_BxLxKxD: Array,
                      mask_BxTxL: Array) -> Array:
  """Softmax attention with grouped-query heads; returns [B, T, H, D] in q's dtype.

  ``mask_BxTxL`` is True where query t may attend to key s. Scores and softmax are
  computed in float32 whatever the compute dtype.
  """
  batch, q_len, num_heads, head_dim = q_BxTxHxD.shape
  num_kv_heads = k_BxLxKxD.shape[2]
  groups = num_heads // num_kv_heads
  q_BxTxKxGxD = q_BxTxHxD.reshape(batch, q_len, num_kv_heads, groups, head_dim)
  scores_BxKxGxTxL = jnp.einsum("btkgd,bskd->bkgts", q_BxTxKxGxD, k_BxLxKxD,
                                preferred_element_type=jnp.float32)
  scores_BxKxGxTxL = scores_BxKxGxTxL * (head_dim ** -0.5)
  scores_BxKxGxTxL = jnp.where(mask_BxTxL[:, None, None], scores_BxKxGxTxL, MASK_VALUE)
  probs_BxKxGxTxL = jax.nn.softmax(scores_BxKxGxTxL, axis=-1)
  sees_anything_BxT = jnp.any(mask_BxTxL, axis=-1)
  probs_BxKxGxTxL = jnp.where(sees_anything_BxT[:, None, None, :, None], probs_BxKxGxTxL, 0.0)
  out_BxTxKxGxD = jnp.einsum("bkgts,bskd->btkgd", probs_BxKxGxTxL.astype(v_BxLxKxD.dtype),
                             v_BxLxKxD, preferred_element_type=jnp.float32)
  return out_BxTxKxGxD.reshape(batch, q_len, num_heads, head_dim).astype(q_BxTxHxD.dtype)


class KVBackend(Protocol):
  """Where keys/values live and what each query sees. Implementations are pytrees."""

  def attend(self, layer: int, q_BxTxHxD: Array, k_BxTxKxD: Array,
             v_BxTxKxD: Array) -> tuple[Array, "KVBackend"]:
    """Stores this step's k/v for ``layer`` and returns (attention output, new backend)."""
    ...


@flax.struct.dataclass
class CausalNoCache:
  """Plain causal attention over the tokens of this call; keeps nothing.

  ``valid_BxT`` (optional) marks real tokens; padded keys are never attended to.
  """
  valid_BxT: Array | None = None

  def attend(self, layer, q_BxTxHxD, k_BxTxKxD, v_BxTxKxD):
    del layer
    q_len = q_BxTxHxD.shape[1]
    causal_TxT = jnp.tril(jnp.ones((q_len, q_len), dtype=bool))
    mask_BxTxT = jnp.broadcast_to(causal_TxT, (q_BxTxHxD.shape[0], q_len, q_len))
    if self.valid_BxT is not None:
      mask_BxTxT = mask_BxTxT & self.valid_BxT[:, None, :].astype(bool)
    return grouped_attention(q_BxTxHxD, k_BxTxKxD, v_BxTxKxD, mask_BxTxT), self
