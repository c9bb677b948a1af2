"""Frozen, keyword-only, self-validating configuration dataclasses.

Every config checks itself in ``__post_init__`` and raises ``ConfigError`` with a
message that names the field, the bad value and what is allowed, so a typo in an
experiment fails at construction rather than deep inside a jitted function.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import numpy as np


class ConfigError(ValueError):
  """A configuration field holds a value outside its allowed range."""


def check(condition: bool, owner: str, field: str, value: Any, allowed: str) -> None:
  """Raises ConfigError naming ``owner.field`` when ``condition`` is false."""
  if not condition:
    raise ConfigError(f"{owner}.{field}={value!r} is invalid: expected {allowed}.")


def is_integer(value: Any) -> bool:
  """A Python or numpy integer; bools are refused (True is not the number 1 here)."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_finite_number(value: Any) -> bool:
  """A finite real Python or numpy number that is not a bool."""
  return (isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
          and math.isfinite(value))


def check_positive_int(owner: str, name: str, value: Any) -> None:
  """The package's one positive-integer check (Python or numpy ints, never bools)."""
  check(is_integer(value) and value > 0, owner, name, value, "a positive integer")


def check_non_negative_int(owner: str, name: str, value: Any,
                           allowed: str = "an integer >= 0") -> None:
  check(is_integer(value) and value >= 0, owner, name, value, allowed)


def check_finite_number(owner: str, name: str, value: Any, *, above: float | None = None,
                        at_least: float | None = None, at_most: float | None = None,
                        why: str = "") -> None:
  """The package's one real-number check: finite (an infinite learning rate trains NaN
  weights, an infinite cap caps nothing), never a bool, and within the bounds given
  (``above`` or ``at_least``, and ``at_most``). The message is built from the bounds, so
  it cannot drift from what is checked; ``why`` adds a reason to it."""
  ok = (is_finite_number(value) and (above is None or value > above)
        and (at_least is None or value >= at_least) and (at_most is None or value <= at_most))
  if above is not None:
    low_bound, low_bracket = f"> {above}", f"({above}"
  elif at_least is not None:
    low_bound, low_bracket = f">= {at_least}", f"[{at_least}"
  else:
    low_bound = low_bracket = ""
  if at_most is None:
    bounds = low_bound
  else:
    bounds = f"in {low_bracket}, {at_most}]" if low_bracket else f"<= {at_most}"
  allowed = " ".join(part for part in ("a finite number", bounds, why) if part)
  check(ok, owner, name, value, allowed)


def normalise_numbers(config: Any, ints: tuple[str, ...] = (), floats: tuple[str, ...] = ()
                      ) -> None:
  """Stores checked numpy scalars as Python ints and floats, so that a config hashes,
  compares and prints the same whichever kind of number built it (configs are static
  arguments of compiled programs)."""
  for name in ints:
    object.__setattr__(config, name, int(getattr(config, name)))
  for name in floats:
    object.__setattr__(config, name, float(getattr(config, name)))


_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """Decoder-only transformer of the Llama / Qwen2 / Qwen3 family."""

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 1e6
  rms_norm_eps: float = 1e-6
  tie_embeddings: bool = False
  qk_norm: bool = True
  attention_bias: bool = False
  max_position_embeddings: int = 32768
  # Llama-3.x "llama3" RoPE frequency scaling as a tuple of
  # (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings).
  rope_llama3_scaling: tuple[float, float, float, int] | None = None
  param_dtype: str = "float32"
  dtype: str = "float32"

  def __post_init__(self):
    owner = "ModelConfig"
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                 "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
      check_positive_int(owner, name, getattr(self, name))
    check(self.num_heads % self.num_kv_heads == 0, owner, "num_kv_heads",
          self.num_kv_heads, f"a divisor of num_heads={self.num_heads}")
    check(self.head_dim % 2 == 0, owner, "head_dim", self.head_dim,
          "an even number (rotary embeddings rotate pairs)")
    check(is_finite_number(self.rope_theta) and self.rope_theta > 0, owner, "rope_theta",
          self.rope_theta, "a finite number > 0")
    check(is_finite_number(self.rms_norm_eps) and 0 < self.rms_norm_eps < 1, owner,
          "rms_norm_eps", self.rms_norm_eps, "a number in (0, 1)")
    check(self.param_dtype in _DTYPES, owner, "param_dtype", self.param_dtype,
          f"one of {_DTYPES}")
    check(self.dtype in _DTYPES, owner, "dtype", self.dtype, f"one of {_DTYPES}")
    if self.rope_llama3_scaling is not None:
      check(len(self.rope_llama3_scaling) == 4 and self.rope_llama3_scaling[0] >= 1,
            owner, "rope_llama3_scaling", self.rope_llama3_scaling,
            "None or (factor>=1, low_freq_factor, high_freq_factor, original_max_positions)")
    normalise_numbers(self, ints=("vocab_size", "hidden_size", "intermediate_size",
                                  "num_layers", "num_heads", "num_kv_heads", "head_dim",
                                  "max_position_embeddings"),
                      floats=("rope_theta", "rms_norm_eps"))

  @property
  def num_groups(self) -> int:
    """Query heads per KV head (grouped-query attention)."""
    return self.num_heads // self.num_kv_heads

  def replace(self, **changes) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  def num_params(self) -> int:
    """Parameter count, embeddings included (tied embeddings counted once)."""
    d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
    attn = d * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
    if self.attention_bias:
      attn += self.head_dim * (self.num_heads + 2 * self.num_kv_heads)
    norms = 2 * d + (2 * self.head_dim if self.qk_norm else 0)
    per_layer = attn + 3 * d * f + norms
    head = 0 if self.tie_embeddings else d * v
    return v * d + self.num_layers * per_layer + d + head


# Named configs used by benchmarks, demos and tests.
PRESETS: dict[str, ModelConfig] = {
    # The benchmark model of the sampler issue: Qwen3 architecture, ~160M params.
    "bench-160m": ModelConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                              num_layers=8, num_heads=16, num_kv_heads=8, head_dim=64),
}

# The published architectures (their config.json), in bfloat16 as released. Qwen3 up to
# 4B ties the LM head to the embedding; Llama 3.2 1B ties, Llama 3.1 8B does not.
_QWEN3 = dict(vocab_size=151936, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6,
              qk_norm=True, max_position_embeddings=40960, param_dtype="bfloat16",
              dtype="bfloat16")
_LLAMA3 = dict(vocab_size=128256, rope_theta=5e5, rms_norm_eps=1e-5, qk_norm=False,
               max_position_embeddings=131072, param_dtype="bfloat16", dtype="bfloat16")
PRESETS.update({
    "qwen3-0.6b": ModelConfig(hidden_size=1024, intermediate_size=3072, num_layers=28,
                              num_heads=16, num_kv_heads=8, tie_embeddings=True, **_QWEN3),
    "qwen3-1.7b": ModelConfig(hidden_size=2048, intermediate_size=6144, num_layers=28,
                              num_heads=16, num_kv_heads=8, tie_embeddings=True, **_QWEN3),
    "qwen3-4b": ModelConfig(hidden_size=2560, intermediate_size=9728, num_layers=36,
                            num_heads=32, num_kv_heads=8, tie_embeddings=True, **_QWEN3),
    "qwen3-8b": ModelConfig(hidden_size=4096, intermediate_size=12288, num_layers=36,
                            num_heads=32, num_kv_heads=8, tie_embeddings=False, **_QWEN3),
    "llama-3.2-1b": ModelConfig(hidden_size=2048, intermediate_size=8192, num_layers=16,
                                num_heads=32, num_kv_heads=8, head_dim=64,
                                tie_embeddings=True, rope_llama3_scaling=(32.0, 1.0, 4.0, 8192),
                                **_LLAMA3),
    "llama-3.1-8b": ModelConfig(hidden_size=4096, intermediate_size=14336, num_layers=32,
                                num_heads=32, num_kv_heads=8, head_dim=128,
                                tie_embeddings=False, rope_llama3_scaling=(8.0, 1.0, 4.0, 8192),
                                **_LLAMA3),
})


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
  """How tokens are drawn from the policy. temperature=0 means greedy (argmax).

  The same warp (temperature, then top-k, then top-p) defines the distribution that
  plain sampling draws from, that speculative verification preserves, and whose
  log-probs are reported for RL.
  """

  temperature: float = 1.0
  top_k: int = 0  # 0 disables top-k
  top_p: float = 1.0  # 1.0 disables top-p
  max_new_tokens: int = 16
  stop_token_ids: tuple[int, ...] = ()

  def __post_init__(self):
    owner = "SamplingParams"
    check(is_finite_number(self.temperature) and self.temperature >= 0, owner,
          "temperature", self.temperature, "a finite number >= 0 (0 means greedy)")
    check(is_integer(self.top_k) and self.top_k >= 0, owner, "top_k", self.top_k,
          "an integer >= 0 (0 disables top-k)")
    check(is_finite_number(self.top_p) and 0 < self.top_p <= 1, owner, "top_p",
          self.top_p, "a number in (0, 1] (1 disables top-p)")
    check_positive_int(owner, "max_new_tokens", self.max_new_tokens)
    stops = self.stop_token_ids
    check(isinstance(stops, tuple) and all(is_integer(t) and t >= 0 for t in stops),
          owner, "stop_token_ids", stops, "a tuple of non-negative token ids")
    normalise_numbers(self, ints=("top_k", "max_new_tokens"), floats=("temperature", "top_p"))
    object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


# Static bounds on the draft shape. Verification and drafting are unrolled per depth and
# per child inside the compiled round, so compile time grows with them (a tiny model on
# a 2-core CPU: experiments/compile_bounds.py; see docs/drafters.md for the figures), and
# acceptance saturates long before: k = 16 chains, 128-node trees already compile in tens
# of seconds while real drafters accept 2-6 tokens a round.
MAX_DRAFT_TOKENS = 16
MAX_TREE_NODES = 128


def tree_nodes(tree: tuple[int, ...]) -> int:
  """Draft nodes of a static tree (root excluded): b1 + b1*b2 + ..."""
  nodes, width = 0, 1
  for branching in tree:
    width *= branching
    nodes += width
  return nodes


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpecConfig:
  """Speculative decoding shape.

  A chain of ``num_draft_tokens`` drafts, or a static ``tree`` giving the number of
  children per node at each depth, e.g. (3, 2, 1) = 3 + 6 + 6 draft nodes.
  Bounds (what compiles in reasonable time, docs/drafters.md): num_draft_tokens and the
  tree's depth at most MAX_DRAFT_TOKENS = 16, the tree's nodes at most MAX_TREE_NODES = 128.
  draft_mode "sample" draws drafts from the drafter's distribution q; "greedy" takes
  its top tokens (a point mass / top-b distinct children).
  adaptive: choose the chain length per batch of ``rounds_per_decision`` rounds, from 0
    (plain decoding; the drafter only keeps up) to ``num_draft_tokens``, by the
    acceptance and round times measured so far (``sj.speculative.adaptive``), per live
    width (``sj.speculative.concurrency``). Every round stays lossless whatever length
    is chosen.
  adaptive_trees: with adaptive, trees the controller may also choose (children per
    depth, each no deeper than num_draft_tokens), e.g. ((2, 2, 1),): measured once per
    width, then run where they beat the best chain.
  """

  num_draft_tokens: int = 3
  tree: tuple[int, ...] | None = None
  draft_mode: str = "sample"
  adaptive: bool = False
  rounds_per_decision: int = 8
  adaptive_trees: tuple[tuple[int, ...], ...] = ()

  def __post_init__(self):
    owner = "SpecConfig"
    check_positive_int(owner, "num_draft_tokens", self.num_draft_tokens)
    check(self.num_draft_tokens <= MAX_DRAFT_TOKENS, owner, "num_draft_tokens",
          self.num_draft_tokens, f"at most {MAX_DRAFT_TOKENS} (each draft position is "
          "unrolled into the compiled round: longer chains take minutes to compile and "
          "are rarely accepted that far)")
    if self.tree is not None:
      check(isinstance(self.tree, tuple) and len(self.tree) > 0
            and all(is_integer(b) and b > 0 for b in self.tree),
            owner, "tree", self.tree,
            "None or a non-empty tuple of positive children counts per depth, e.g. (3, 2, 1)")
      object.__setattr__(self, "tree", tuple(int(b) for b in self.tree))
      check(len(self.tree) <= MAX_DRAFT_TOKENS, owner, "tree", self.tree,
            f"a depth of at most {MAX_DRAFT_TOKENS}")
      check(tree_nodes(self.tree) <= MAX_TREE_NODES, owner, "tree", self.tree,
            f"at most {MAX_TREE_NODES} draft nodes (this one has {tree_nodes(self.tree)}: "
            "every node is unrolled into the compiled round, so bigger trees take minutes "
            "to compile)")
    check(self.draft_mode in ("sample", "greedy"), owner, "draft_mode", self.draft_mode,
          "'sample' or 'greedy'")
    check(isinstance(self.adaptive, bool), owner, "adaptive", self.adaptive, "True or False")
    check(not (self.adaptive and self.tree is not None), owner, "tree", self.tree,
          "None when adaptive=True (adaptive speculation chooses a chain length; a static "
          "tree has none to choose)")
    check_positive_int(owner, "rounds_per_decision", self.rounds_per_decision)
    self._check_adaptive_trees(owner)
    normalise_numbers(self, ints=("num_draft_tokens", "rounds_per_decision"))

  def _check_adaptive_trees(self, owner: str) -> None:
    trees = self.adaptive_trees
    allowed = ("a tuple of trees (tuples of positive children counts per depth), e.g. "
               "((2, 2, 1),)")
    check(isinstance(trees, (tuple, list)), owner, "adaptive_trees", trees, allowed)
    check(not trees or self.adaptive, owner, "adaptive_trees", trees,
          "() unless adaptive=True (a fixed shape is given by num_draft_tokens or tree)")
    normalised = []
    for tree in trees:
      check(isinstance(tree, (tuple, list)) and len(tree) > 0
            and all(is_integer(b) and b > 0 for b in tree), owner, "adaptive_trees", trees,
            allowed)
      tree = tuple(int(b) for b in tree)
      check(len(tree) <= self.num_draft_tokens, owner, "adaptive_trees", trees,
            f"trees no deeper than num_draft_tokens={self.num_draft_tokens} (the state "
            "is built for the longest chain)")
      check(any(b > 1 for b in tree), owner, "adaptive_trees", trees,
            "trees that branch somewhere (chains are chosen by their length already)")
      check(tree_nodes(tree) <= MAX_TREE_NODES, owner, "adaptive_trees", trees,
            f"trees of at most {MAX_TREE_NODES} draft nodes")
      normalised.append(tree)
    check(len(set(normalised)) == len(normalised), owner, "adaptive_trees", trees,
          "distinct trees")
    object.__setattr__(self, "adaptive_trees", tuple(normalised))

  @property
  def depth(self) -> int:
    """Longest run of draft tokens one round can accept."""
    return len(self.tree) if self.tree is not None else self.num_draft_tokens
