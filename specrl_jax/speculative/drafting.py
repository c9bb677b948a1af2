"""Turning a drafter's level-wise distributions into a static draft tree."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from specrl_jax.config import SamplingParams
from specrl_jax.speculative.drafters.base import Drafter, RoundInputs, TreeLevel
from specrl_jax.speculative.topology import TreeTopology

Array = jax.Array


@flax.struct.dataclass
class DraftTree:
  """tokens_NxJ / valid_NxJ: node i's token at index i - 1 (invalid: q gave it no mass).
  log_q_NxIxV: the drafter's q at every internal node (ids 0..I-1)."""
  tokens_NxJ: Array
  valid_NxJ: Array
  log_q_NxIxV: Array


def choose_children(rng: Array, log_q_NxWxV: Array, branching: int, draft_mode: str
                    ) -> tuple[Array, Array]:
  """``branching`` distinct children per parent: sampled from q without replacement
  (Gumbel top-k) or q's top tokens. Returns tokens and validity [N, W * branching]."""
  scores = log_q_NxWxV
  if draft_mode == "sample":
    scores = scores + jax.random.gumbel(rng, scores.shape)
  _, tokens_NxWxB = jax.lax.top_k(scores, branching)
  valid_NxWxB = jnp.take_along_axis(log_q_NxWxV, tokens_NxWxB, axis=-1) > -jnp.inf
  num_slots = tokens_NxWxB.shape[0]
  return (tokens_NxWxB.reshape(num_slots, -1).astype(jnp.int32),
          valid_NxWxB.reshape(num_slots, -1))


def draft_tree(rng: Array, drafter: Drafter, params, state, kv, inputs: RoundInputs,
               sampling: SamplingParams, topology: TreeTopology, draft_mode: str,
               max_pending: int | None = None):
  """Runs the drafter level by level. Returns (DraftTree, drafter state, kv).

  max_pending: most tokens the drafter may have to catch up on (default: one round of
  this topology's depth accepted, plus the bonus token).
  """
  log_q_NxV, state, kv, scratch = drafter.start(params, state, kv, inputs, sampling,
                                                max_pending=max_pending or topology.depth + 1)
  level_log_q = log_q_NxV[:, None, :]
  if topology.depth == 0:
    num_slots = log_q_NxV.shape[0]
    return DraftTree(tokens_NxJ=jnp.zeros((num_slots, 0), jnp.int32),
                     valid_NxJ=jnp.zeros((num_slots, 0), bool),
                     log_q_NxIxV=level_log_q), state, kv
  internal_log_q = [level_log_q]
  tokens, valid = [], []
  keys = jax.random.split(rng, topology.depth)
  for depth, branching in enumerate(topology.branching):
    level_tokens, level_valid = choose_children(keys[depth], level_log_q, branching, draft_mode)
    tokens.append(level_tokens)
    valid.append(level_valid)
    if depth + 1 == topology.depth:
      break
    start = topology.level_starts[depth]
    nodes = np.arange(start, start + topology.level_sizes[depth])
    all_tokens = jnp.concatenate(tokens, axis=1)
    paths = topology.path_nodes[nodes][:, :depth + 1]
    paths_NxWxZ = all_tokens[:, paths - 1]
    mask_WxJ = topology.ancestor_mask[nodes][:, 1:start + len(nodes)]
    level = TreeLevel(depth=depth + 1, tokens_NxW=level_tokens, paths_NxWxZ=paths_NxWxZ,
                      mask_WxJ=mask_WxJ, sampling=sampling)
    level_log_q, scratch = drafter.extend(params, state, kv, scratch, inputs, level)
    internal_log_q.append(level_log_q)
  tree = DraftTree(tokens_NxJ=jnp.concatenate(tokens, axis=1),
                   valid_NxJ=jnp.concatenate(valid, axis=1),
                   log_q_NxIxV=jnp.concatenate(internal_log_q, axis=1))
  return tree, state, kv
