"""Lossless verification of a drafted chain or tree (batched, under jit).

One rule covers every mode. Walking down from the root, the children of the current
node are tried in order. Child j with token x_j was proposed from a distribution q_j:
  - sampled children (draft_mode "sample"): q_j is the drafter's q at the parent with
    the earlier siblings removed and renormalised (sampling without replacement);
  - deterministic children (draft_mode "greedy"): q_j is a point mass on x_j.
x_j is accepted with probability min(1, p(x_j) / q_j(x_j)); on rejection the target
distribution becomes norm(max(0, p - q_j)) and the next sibling is tried. Accepting a
child moves to it, with p the target's distribution there. When no child is accepted
(or a leaf is reached) the final token is sampled from the current p. For chains this is
Leviathan/Chen speculative sampling; for point-mass children it is "accept c with
p(c)/p_remaining, zero it and renormalise"; for sampled trees it is the
RSD/Sequoia rule. With a greedy target (p one-hot) it accepts the longest prefix
matching the target argmax and then emits the target's token.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from specrl_jax.sampling.warp import sample_from_probs
from specrl_jax.speculative.topology import TreeTopology

Array = jax.Array


@flax.struct.dataclass
class Verdict:
  """Outcome of one verification round for N slots and a tree of depth Z.

  path_NxZ: accepted node id at each depth (-1 after the first rejection).
  num_accepted_N: accepted draft tokens (0..Z).
  tokens_NxE, log_probs_NxE: the E = Z + 1 emitted candidates (accepted drafts, then
    the final token), with the target's warped log-prob of each; valid up to
    num_accepted_N + 1.
  """
  path_NxZ: Array
  num_accepted_N: Array
  tokens_NxE: Array
  log_probs_NxE: Array

  def accepted_positions(self, cache_lengths_N: Array, active_N: Array
                         ) -> tuple[Array, Array]:
    """(source_NxE, positions_NxE): the tree node of the root and of each accepted node
    (0 past the path), and the cache position it enters at. The root sits at
    cache_lengths_N[n] and the accepted nodes follow it; -1 past the path and for
    inactive slots, so nothing is written there."""
    num_slots, depth = self.path_NxZ.shape
    source_NxE = jnp.concatenate([jnp.zeros((num_slots, 1), jnp.int32),
                                  jnp.maximum(self.path_NxZ, 0)], axis=1)
    keep_NxE = jnp.concatenate([active_N[:, None], (self.path_NxZ >= 0) & active_N[:, None]],
                               axis=1)
    positions_NxE = jnp.where(keep_NxE,
                              cache_lengths_N[:, None] + jnp.arange(depth + 1)[None, :], -1)
    return source_NxE, positions_NxE


def _take(x_NxV: Array, index_N: Array) -> Array:
  return jnp.take_along_axis(x_NxV, index_N[:, None], axis=1)[:, 0]


def _normalise(weights_NxV: Array, fallback_NxV: Array) -> Array:
  total = jnp.sum(weights_NxV, axis=-1, keepdims=True)
  return jnp.where(total > 0, weights_NxV / jnp.where(total > 0, total, 1.0), fallback_NxV)


def verify(rng: Array, target_log_probs_NxYxV: Array, draft_tokens_NxJ: Array,
           draft_valid_NxJ: Array, draft_log_probs_NxIxV: Array | None,
           topology: TreeTopology, draft_mode: str) -> Verdict:
  """Accepts a prefix path of the draft tree so that emitted tokens follow the target.

  target_log_probs_NxYxV: warped target log-probs at the root (index 0) and at every
    draft node (index = node id), Y = 1 + J.
  draft_tokens_NxJ / draft_valid_NxJ: token of node i at index i - 1; invalid nodes are
    never accepted (e.g. an n-gram drafter with fewer continuations than children).
  draft_log_probs_NxIxV: the drafter's log q at each internal node (ids 0..I-1); only
    read in "sample" mode.
  """
  num_slots, _, vocab = target_log_probs_NxYxV.shape
  first_child = jnp.asarray(topology.first_child)
  slot_N = jnp.arange(num_slots)
  p_NxV = jnp.exp(target_log_probs_NxYxV[:, 0])
  node_N = jnp.zeros((num_slots,), jnp.int32)
  alive_N = jnp.ones((num_slots,), bool)
  path = []
  widest = max(topology.branching, default=0)
  keys = jax.random.split(rng, topology.depth * widest + 1)
  for depth, branching in enumerate(topology.branching):
    first_N = first_child[node_N]
    if draft_mode == "sample":
      q_parent_NxV = jnp.exp(draft_log_probs_NxIxV[slot_N, node_N])
      removed_NxV = jnp.zeros((num_slots, vocab), bool)
    found_N = jnp.zeros((num_slots,), bool)
    chosen_N = jnp.full((num_slots,), -1, jnp.int32)
    for j in range(branching):
      child_N = first_N + j
      token_N = draft_tokens_NxJ[slot_N, child_N - 1]
      one_hot_NxV = jax.nn.one_hot(token_N, vocab, dtype=bool)
      if draft_mode == "sample":
        q_child_NxV = _normalise(jnp.where(removed_NxV, 0.0, q_parent_NxV), q_parent_NxV)
        removed_NxV = removed_NxV | one_hot_NxV
        q_token_N = _take(q_child_NxV, token_N)
      else:
        q_child_NxV = one_hot_NxV.astype(jnp.float32)
        q_token_N = jnp.ones((num_slots,), jnp.float32)
      trying_N = (alive_N & ~found_N & draft_valid_NxJ[slot_N, child_N - 1]
                  & (q_token_N > 0))
      uniform_N = jax.random.uniform(keys[depth * widest + j], (num_slots,))
      accept_N = trying_N & (uniform_N * q_token_N < _take(p_NxV, token_N))
      reject_N = trying_N & ~accept_N
      residual_NxV = _normalise(jnp.maximum(p_NxV - q_child_NxV, 0.0), p_NxV)
      p_NxV = jnp.where(reject_N[:, None], residual_NxV, p_NxV)
      found_N = found_N | accept_N
      chosen_N = jnp.where(accept_N, child_N, chosen_N)
    alive_N = alive_N & found_N
    node_N = jnp.where(alive_N, chosen_N, node_N)
    p_NxV = jnp.where(alive_N[:, None], jnp.exp(target_log_probs_NxYxV[slot_N, node_N]), p_NxV)
    path.append(jnp.where(alive_N, chosen_N, -1))

  path_NxZ = (jnp.stack(path, axis=1) if path
              else jnp.zeros((num_slots, 0), jnp.int32))  # depth 0: nothing drafted
  num_accepted_N = jnp.sum(path_NxZ >= 0, axis=1).astype(jnp.int32)
  final_N = sample_from_probs(keys[-1], p_NxV)
  final_log_prob_N = target_log_probs_NxYxV[slot_N, node_N, final_N]

  parent = jnp.asarray(topology.parent)
  safe_path_NxZ = jnp.maximum(path_NxZ, 1)
  path_tokens_NxZ = jnp.take_along_axis(draft_tokens_NxJ, safe_path_NxZ - 1, axis=1)
  path_log_probs_NxZ = target_log_probs_NxYxV[slot_N[:, None], parent[safe_path_NxZ],
                                              path_tokens_NxZ]
  depth_E = jnp.arange(topology.depth + 1)
  is_final_NxE = depth_E[None, :] == num_accepted_N[:, None]
  pad = ((0, 0), (0, 1))
  tokens_NxE = jnp.where(is_final_NxE, final_N[:, None], jnp.pad(path_tokens_NxZ, pad))
  log_probs_NxE = jnp.where(is_final_NxE, final_log_prob_N[:, None],
                            jnp.pad(path_log_probs_NxZ, pad))
  return Verdict(path_NxZ=path_NxZ, num_accepted_N=num_accepted_N, tokens_NxE=tokens_NxE,
                 log_probs_NxE=log_probs_NxE)
