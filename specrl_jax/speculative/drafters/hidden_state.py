"""Drafters that read the target's hidden states (MTP, EAGLE-3): the shared decode logic.

Such a drafter is one decoder layer run beside the target. Its entry at position j reads
the token x_j and a *feature* of the target at position j - 1 (MTP: the last hidden
state; EAGLE-3: a projection of a low, a middle and a high layer), and predicts x_{j+1}.
Deeper tree levels feed the drafter's own output at the parent node instead of the
target's feature, which is what training-time test trains for.

Two of the drafter's layers live in the shared page pool (so allocation, prefix sharing
and admission copies happen once for target and drafter):
  layer 0: the keys and values of its attention, kept in step with the target lazily
    by ``CachedDrafter`` like DraftModel's (each round first feeds the tokens emitted
    since its cache was last written);
  layer 1: a feature store: what the target's feature is made from at every cache
    position (EAGLE-3: the three layers' hidden states, fused by its projection only
    when read; a plain round that records them pays no fusion), written at prefill and
    after each verification for the root and the accepted nodes, read back as the next
    round's pending inputs. Half of each entry goes in the K pages, half in the V pages.
Position 0 has no earlier feature and reads zeros, in training and in decoding alike.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specrl_jax.config import ConfigError
from specrl_jax.kv.paged import LayerOffset, PagedKV, read_pages, write_pages
from specrl_jax.parallel.rules import path_string as rules_path
from specrl_jax.sampling.warp import proposal_log_probs
from specrl_jax.speculative.drafters.cached import CachedDrafter

Array = jax.Array

ATTENTION_LAYER = 0  # the drafter's attention KV, relative to its page-pool offset
FEATURE_LAYER = 1    # the feature store


class SharedTable(nnx.Variable):
  """A table copied from the target (token embedding, output head): read by the
  drafter, never trained (gradients are stopped and optimizers skip it)."""


def normal_param(rngs: nnx.Rngs, shape, dtype, std: float = 0.02) -> nnx.Param:
  return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32).astype(dtype) * std)


def shift_right(x_BxTxD: Array) -> Array:
  """x[:, j - 1] at position j, zeros at position 0: the feature each entry reads."""
  return jnp.pad(x_BxTxD[:, :-1], ((0, 0), (1, 0), (0, 0)))


# ------------------------------------------------------------------- feature store

def feature_store_shape(width: int) -> tuple[int, int]:
  """(heads, dim) of the store's page layer: one head, half an entry in K, half in V."""
  return (1, -(-width // 2))


def write_features(kv: PagedKV, layer: int, positions_BxT: Array,
                   features_BxTxD: Array) -> PagedKV:
  """Stores features at cache positions of ``kv``'s page table (negative: nowhere)."""
  half = kv.k_pages[layer].shape[-1]
  padded = jnp.pad(features_BxTxD, ((0, 0), (0, 0), (0, 2 * half - features_BxTxD.shape[-1])))
  k_BxTx1xD = padded[..., None, :half]
  v_BxTx1xD = padded[..., None, half:]
  k_pages = list(kv.k_pages)
  v_pages = list(kv.v_pages)
  k_pages[layer] = write_pages(k_pages[layer], kv.page_table_BxM, positions_BxT, k_BxTx1xD)
  v_pages[layer] = write_pages(v_pages[layer], kv.page_table_BxM, positions_BxT, v_BxTx1xD)
  return kv.replace(k_pages=tuple(k_pages), v_pages=tuple(v_pages))


def read_features(kv: PagedKV, layer: int, positions_BxT: Array, width: int) -> Array:
  """Entries stored at cache positions [B, T, width]; zeros where a position is negative."""
  valid_BxT = positions_BxT >= 0
  both = jnp.concatenate([read_pages(kv.k_pages[layer], kv.page_table_BxM, positions_BxT)[..., 0, :],
                          read_pages(kv.v_pages[layer], kv.page_table_BxM, positions_BxT)[..., 0, :]],
                         axis=-1)
  return jnp.where(valid_BxT[..., None], both[..., :width], 0)


# ------------------------------------------------------------------- the drafter

def split_weights(head: nnx.Module) -> tuple[nnx.GraphDef, dict[str, Any]]:
  """(graphdef, {"trainable": params, "shared": tables copied from the target})."""
  graphdef, trainable, shared = nnx.split(head, nnx.Param, SharedTable)
  return graphdef, {"trainable": trainable, "shared": shared}


def check_weights(owner: str, expected: dict[str, Any], given: dict[str, Any]) -> None:
  """Raises ConfigError unless ``given`` has ``expected``'s structure and shapes (e.g.
  weights trained for a target of another hidden size)."""
  want = {rules_path(path): tuple(leaf.shape)
          for path, leaf in jax.tree_util.tree_leaves_with_path(expected)}
  got = {rules_path(path): tuple(np.shape(leaf))
         for path, leaf in jax.tree_util.tree_leaves_with_path(given)}
  if set(want) != set(got):
    raise ConfigError(
        f"{owner} weights have entries {sorted(set(got) - set(want))} it has no place for "
        f"and lack {sorted(set(want) - set(got))}.")
  for path, shape in want.items():
    if got[path] != shape:
      raise ConfigError(
          f"{owner} weight {path!r} has shape {got[path]}; this target needs {shape} (were "
          "the weights trained for a target of another hidden size or vocabulary?).")


def merge_weights(graphdef: nnx.GraphDef, weights: dict[str, Any]) -> nnx.Module:
  return nnx.merge(graphdef, weights["trainable"], weights["shared"])


class HiddenStateDrafter(CachedDrafter):
  """A one-layer drafter on the target's features (see the module docstring).

  Subclasses hold a frozen, hashable ``config`` and an nnx head implementing
    fusion_inputs(hidden_BxTxD, layer_hidden) -> inputs_BxTxF   (what the store keeps)
    fuse(inputs_BxTxF) -> feature_BxTxD
    features(hidden_BxTxD, layer_hidden) -> feature_BxTxD   (the two in one, for training)
    decode(tokens_BxT, feature_BxTxD, positions_BxT, kv) -> (output_BxTxD, kv)
    logits(output_BxTxD) -> float32 [B, T, draft vocabulary]
  and a draft-to-target id table (None: the draft vocabulary is the target's).
  Weights are {"trainable": ..., "shared": ...} (nnx states); they travel to the
  compiled program through ``params()``, so new weights never recompile.
  """

  config: Any
  layer_config: Any  # ModelConfig of the drafter's one decoder layer (its KV shape)
  hidden_size: int
  vocab_size: int
  fusion_input_size: int  # F: the width of a feature-store entry

  def __init__(self, graphdef: nnx.GraphDef, weights: dict[str, Any],
               draft_to_target: np.ndarray | None):
    self.graphdef = graphdef
    self.weights = weights
    self.draft_to_target = draft_to_target

  # Hashing by config (and class) lets jit reuse one program for any weights.
  def __hash__(self):
    return hash((type(self), self.config))

  def __eq__(self, other):
    return type(other) is type(self) and other.config == self.config

  def head(self, weights=None) -> nnx.Module:
    """The nnx head with ``weights`` (default: this drafter's)."""
    return merge_weights(self.graphdef, self.weights if weights is None else weights)

  def with_weights(self, weights: dict[str, Any]) -> "HiddenStateDrafter":
    """The same drafter with other weights (e.g. after a training step)."""
    other = copy.copy(self)
    other.weights = weights
    return other

  # ----------------------------------------------------------------- target checks

  def check_target(self, target_config) -> None:
    name = type(self).__name__
    if target_config.hidden_size != self.hidden_size:
      raise ConfigError(
          f"{name} was built for hidden_size={self.hidden_size} but the target has "
          f"hidden_size={target_config.hidden_size}: a hidden-state drafter reads the "
          "target's hidden states and shares its embedding, so the sizes must match.")
    if target_config.vocab_size != self.vocab_size:
      raise ConfigError(
          f"{name} was built for vocab_size={self.vocab_size} but the target has "
          f"vocab_size={target_config.vocab_size}: the drafter's tokens are the target's.")
    for index in self.hidden_layers:
      if not 0 <= index < target_config.num_layers:
        raise ConfigError(
            f"{name} reads target layer {index} (hidden_layers={self.hidden_layers}) but "
            f"the target has {target_config.num_layers} layers: expected indices in "
            f"[0, {target_config.num_layers - 1}].")

  # ----------------------------------------------------------------- the interface

  def kv_layers(self):
    layer = self.layer_config
    return ((layer.num_kv_heads, layer.head_dim), feature_store_shape(self.fusion_input_size))

  def params(self):
    table = () if self.draft_to_target is None else jnp.asarray(self.draft_to_target, jnp.int32)
    return {"weights": self.weights, "draft_to_target": table}

  def target_log_q(self, params, output_BxTxD: Array, sampling) -> Array:
    """log q over the *target* vocabulary; tokens outside the draft table get -inf, so
    they are never proposed."""
    logits = merge_weights(self.graphdef, params["weights"]).logits(output_BxTxD)
    table = params["draft_to_target"]
    if not isinstance(table, tuple):
      full = jnp.full(logits.shape[:-1] + (self.vocab_size,), -jnp.inf, logits.dtype)
      logits = full.at[..., table].set(logits)
    return proposal_log_probs(logits, sampling)

  def fusion_inputs(self, params, target_output, select_NxE: Array | None = None) -> Array:
    """What the store keeps of the target's output, at all positions or only at node
    indices ``select_NxE``."""
    hidden, layer_hidden = target_output.hidden, target_output.layer_hidden
    if select_NxE is not None:
      take = lambda x: jnp.take_along_axis(x, select_NxE[..., None], axis=1)
      hidden, layer_hidden = take(hidden), tuple(take(h) for h in layer_hidden)
    return merge_weights(self.graphdef, params["weights"]).fusion_inputs(hidden, layer_hidden)

  def prefill(self, params, state, kv: LayerOffset, tokens_UxT, lengths_U, target_output):
    head = merge_weights(self.graphdef, params["weights"])
    inputs_UxTxF = self.fusion_inputs(params, target_output)
    positions_UxT = jnp.broadcast_to(jnp.arange(tokens_UxT.shape[1], dtype=jnp.int32),
                                     tokens_UxT.shape)
    _, kv = head.decode(tokens_UxT, shift_right(head.fuse(inputs_UxTxF)), positions_UxT, kv)
    inner = write_features(kv.inner, kv.offset + FEATURE_LAYER, kv.inner.write_positions_BxT,
                           inputs_UxTxF)
    return state, kv.replace(inner=inner)

  def decode_fed(self, params, tokens_NxT, positions_NxT, valid_NxT, kv: LayerOffset):
    """Each fed token reads the stored feature of the position before."""
    head = merge_weights(self.graphdef, params["weights"])
    # Fused here, not when stored: plain rounds of an idle drafter store and never fuse.
    features_NxTxD = head.fuse(read_features(kv.inner, kv.offset + FEATURE_LAYER,
                                             jnp.where(valid_NxT, positions_NxT - 1, -1),
                                             self.fusion_input_size))
    return head.decode(tokens_NxT, features_NxTxD, positions_NxT, kv)

  def root_log_q(self, params, root_Nx1xD, sampling):
    return self.target_log_q(params, root_Nx1xD, sampling)[:, 0]

  def decode_level(self, params, tokens_NxW, positions_NxW, parents_NxIxD, kv: LayerOffset,
                   sampling):
    """Each node reads its parent's output as its feature."""
    head = merge_weights(self.graphdef, params["weights"])
    # Breadth-first numbering: each parent's children are contiguous.
    features_NxWxD = jnp.repeat(parents_NxIxD, tokens_NxW.shape[1] // parents_NxIxD.shape[1],
                                axis=1)
    outputs_NxWxD, kv = head.decode(tokens_NxW, features_NxWxD, positions_NxW, kv)
    return self.target_log_q(params, outputs_NxWxD, sampling), outputs_NxWxD, kv

  # The target's features of plain rounds are stored by ``record``; the head's own
  # KV over them is computed when it drafts again (``catch_up``).
  def record(self, params, state, kv: LayerOffset, inputs, target_output):
    positions_Nx1 = jnp.where(inputs.active_N, inputs.cache_lengths_N, -1)[:, None]
    inner = write_features(kv.inner, kv.offset + FEATURE_LAYER, positions_Nx1,
                           self.fusion_inputs(params, target_output))
    return state, kv.replace(inner=inner)

  def finish(self, params, state, kv: LayerOffset, inputs, verdict, target_output):
    # The root and the accepted nodes enter the cache where the target's KV did: their
    # features are the next round's pending inputs.
    source_NxE, positions_NxE = verdict.accepted_positions(inputs.cache_lengths_N,
                                                           inputs.active_N)
    inputs_NxExF = self.fusion_inputs(params, target_output, source_NxE)
    inner = write_features(kv.inner, kv.offset + FEATURE_LAYER, positions_NxE, inputs_NxExF)
    return state, kv.replace(inner=inner)


@dataclasses.dataclass(frozen=True)
class TargetTables:
  """What a hidden-state drafter copies from its target at construction."""
  embed_VxD: Array
  lm_head_DxV: Array
  final_norm_D: Array

  @classmethod
  def of(cls, target) -> "TargetTables":
    head = target.embed[...].T if target.config.tie_embeddings else target.lm_head[...]
    return cls(embed_VxD=target.embed[...], lm_head_DxV=head,
               final_norm_D=target.final_norm.scale[...])
