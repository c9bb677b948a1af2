"""Static draft-tree topology shared by drafting, tree attention masks and verification.

A chain of k drafts is the tree (1,) * k. Node 0 is the root: the last emitted token,
whose KV is not yet in the cache. Draft nodes are numbered breadth first from 1, so
each depth is a contiguous range and a node's children are contiguous too.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from specrl_jax.config import ConfigError, SpecConfig


@dataclasses.dataclass(frozen=True)
class TreeTopology:
  branching: tuple[int, ...]  # children per node at each depth

  def __post_init__(self):
    # () is depth 0: a round that drafts nothing and verifies only the root, i.e. a
    # plain decoding step that keeps the drafter in step (adaptive speculation's "off").
    if any(not isinstance(b, int) or b < 1 for b in self.branching):
      raise ConfigError(f"tree={self.branching!r} is invalid: expected a tuple of "
                        "positive children counts per depth, e.g. (3, 2, 1).")

  @classmethod
  def from_spec(cls, spec: SpecConfig) -> "TreeTopology":
    if spec.tree is not None:
      return cls(tuple(spec.tree))
    return cls((1,) * spec.num_draft_tokens)

  @property
  def depth(self) -> int:
    return len(self.branching)

  @property
  def is_chain(self) -> bool:
    return all(b == 1 for b in self.branching)

  @functools.cached_property
  def level_sizes(self) -> tuple[int, ...]:
    """Nodes at each depth 1..depth."""
    sizes, width = [], 1
    for b in self.branching:
      width *= b
      sizes.append(width)
    return tuple(sizes)

  @functools.cached_property
  def level_starts(self) -> tuple[int, ...]:
    """Index of the first node of each depth 1..depth (node 0 is the root)."""
    return tuple(int(s) for s in 1 + np.cumsum((0,) + self.level_sizes[:-1]))

  @property
  def num_nodes(self) -> int:
    """Draft nodes, root excluded."""
    return sum(self.level_sizes)

  @functools.cached_property
  def parent(self) -> np.ndarray:
    """parent[i] for nodes 0..num_nodes (parent[0] = -1)."""
    parent = [-1]
    previous_start = 0
    for depth, b in enumerate(self.branching):
      width = 1 if depth == 0 else self.level_sizes[depth - 1]
      parent += [previous_start + i for i in range(width) for _ in range(b)]
      previous_start = self.level_starts[depth]
    return np.asarray(parent, np.int32)

  @functools.cached_property
  def node_depth(self) -> np.ndarray:
    """Depth of nodes 0..num_nodes (root 0)."""
    depth = [0]
    for d, size in enumerate(self.level_sizes):
      depth += [d + 1] * size
    return np.asarray(depth, np.int32)

  @functools.cached_property
  def ancestor_mask(self) -> np.ndarray:
    """[1 + nodes, 1 + nodes]: True where column is the row node itself or an ancestor."""
    n = 1 + self.num_nodes
    mask = np.zeros((n, n), bool)
    for node in range(n):
      walk = node
      while walk >= 0:
        mask[node, walk] = True
        walk = self.parent[walk]
    return mask

  @functools.cached_property
  def first_child(self) -> np.ndarray:
    """Index of the first child of nodes 0..num_nodes (-1 for leaves)."""
    first = np.full(1 + self.num_nodes, -1, np.int32)
    for node in range(self.num_nodes, 0, -1):
      first[self.parent[node]] = node
    return first

  @functools.cached_property
  def path_nodes(self) -> np.ndarray:
    """[1 + nodes, depth]: node ids on the path from depth 1 down to the node, -1 padded."""
    paths = np.full((1 + self.num_nodes, self.depth), -1, np.int32)
    for node in range(1, 1 + self.num_nodes):
      walk = node
      while walk > 0:
        paths[node, self.node_depth[walk] - 1] = walk
        walk = self.parent[walk]
    return paths
