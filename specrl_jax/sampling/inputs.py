"""Checks of ``sj.generate``'s arguments on the host, before anything is traced.

Everything here fails with a ValueError (or ConfigError) that names the argument, the
bad value and what is allowed: a wrong input must never be coerced into a different
one (``[[1.7, 2.2]]`` into ``[[1, 2]]``) or surface from deep inside JAX.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specrl_jax.config import ConfigError, SamplingParams, SpecConfig
from specrl_jax.models.transformer import Transformer


def _is_int(value: Any) -> bool:
  """A Python or numpy integer, not a bool (True is not token 1)."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _prompt_ids(index: int, prompt: Any) -> list[int]:
  """One prompt as a list of Python ints, refusing anything that is not a flat sequence
  of integers."""
  where = f"prompts[{index}]"
  if isinstance(prompt, (np.ndarray, jax.Array)):
    if prompt.ndim != 1 or not (jnp.issubdtype(prompt.dtype, jnp.integer)
                                 and prompt.dtype != bool):
      raise ValueError(f"{where} is an array of shape {tuple(prompt.shape)} and dtype "
                       f"{prompt.dtype}: expected a 1-D integer array of token ids.")
    return [int(t) for t in np.asarray(prompt)]
  if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
    raise ValueError(f"{where}={prompt!r} is a {type(prompt).__name__}: expected a list of "
                     "token ids (ints), e.g. [[1, 2, 3]] (tokenize text first).")
  for position, token in enumerate(prompt):
    if not _is_int(token):
      raise ValueError(f"{where}[{position}]={token!r} ({type(token).__name__}) is not a "
                       "token id: expected an int in [0, vocab_size) (floats, bools and "
                       "nested lists are refused, not coerced).")
  return [int(t) for t in prompt]


def check_prompts(prompts: Any, vocab_size: int, sampling: SamplingParams,
                  max_positions: int) -> list[list[int]]:
  """The prompts as lists of ints: a non-empty list (or tuple, or 2-D integer array) of
  non-empty flat integer sequences, every id in the vocabulary, each fitting the
  context with max_new_tokens."""
  if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
    prompts = list(prompts)
  if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
    length = len(prompts) if hasattr(prompts, "__len__") else "?"
    raise ValueError("prompts must be a non-empty list of token-id lists; got "
                     f"{type(prompts).__name__} of length {length}.")
  checked = []
  for index, prompt in enumerate(prompts):
    ids = _prompt_ids(index, prompt)
    if not ids:
      raise ValueError(f"prompts[{index}] is empty: every prompt needs at least one token.")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
      raise ValueError(f"prompts[{index}] has token id {bad[0]} outside the vocabulary "
                       f"[0, {vocab_size}).")
    if len(ids) + sampling.max_new_tokens > max_positions:
      raise ValueError(
          f"prompts[{index}] has {len(ids)} tokens; with max_new_tokens="
          f"{sampling.max_new_tokens} that exceeds the model's context of {max_positions} "
          "positions (ModelConfig.max_position_embeddings).")
    checked.append(ids)
  return checked


def check_sampling(sampling: Any, vocab_size: int) -> None:
  """A SamplingParams whose stop ids can occur: an id outside the vocabulary would never
  fire, so the caller's stop condition would silently never hold."""
  if not isinstance(sampling, SamplingParams):
    raise ValueError(f"sampling={sampling!r} is a {type(sampling).__name__}: expected "
                     "sj.SamplingParams(...).")
  outside = [t for t in sampling.stop_token_ids if t >= vocab_size]
  if outside:
    raise ConfigError(f"SamplingParams.stop_token_ids={sampling.stop_token_ids!r} is "
                      f"invalid: id {outside[0]} is outside the model's vocabulary "
                      f"[0, {vocab_size}) and could never stop a sequence.")


def check_rng(rng: Any) -> jax.Array:
  """A typed PRNG key (``jax.random.key``) or raw uint32 key data
  (``jax.random.PRNGKey``), as one typed scalar key; None means key 0."""
  if rng is None:
    return jax.random.key(0)
  expected = ("expected a key from jax.random.key(seed) or raw uint32 key data from "
              "jax.random.PRNGKey(seed)")
  if not isinstance(rng, (jax.Array, np.ndarray)):
    raise ValueError(f"rng={rng!r} ({type(rng).__name__}) is not a PRNG key: {expected}.")
  if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    if rng.shape != ():
      raise ValueError(f"rng is an array of {rng.shape} keys: expected one key (shape ()).")
    return rng
  raw_shape = jax.random.key_data(jax.random.key(0)).shape
  if rng.dtype != np.uint32 or tuple(rng.shape) != raw_shape:
    raise ValueError(f"rng has dtype {rng.dtype} and shape {tuple(rng.shape)}: {expected} "
                     f"(uint32 of shape {raw_shape}).")
  return jax.random.wrap_key_data(rng)


# What the engine calls on every drafter (``sj.drafters.Drafter``). Checked by duck type
# so that sampling/ does not import speculative/.
_DRAFTER_METHODS = ("bind", "params", "init_state", "start", "extend")


def check_drafter(drafter: Any) -> None:
  if drafter is None or all(callable(getattr(drafter, m, None)) for m in _DRAFTER_METHODS):
    return
  if isinstance(drafter, Transformer):
    raise ValueError("drafter is an sj.Transformer, not a drafter: wrap it as "
                     "drafter=sj.drafters.DraftModel(model).")
  raise ValueError(f"drafter={drafter!r} ({type(drafter).__name__}) is not a drafter: "
                   "expected None or one of sj.drafters (DraftModel, NGram, History, MTP, "
                   "Eagle3) or a subclass of sj.drafters.Drafter.")


def check_spec(spec: Any, vocab_size: int) -> None:
  """Tree children of one node are distinct tokens (drawn without replacement or q's
  top tokens), so no node can have more children than the vocabulary has tokens."""
  if spec is None:
    return
  if not isinstance(spec, SpecConfig):
    raise ValueError(f"spec={spec!r} is a {type(spec).__name__}: expected "
                     "sj.SpecConfig(...).")
  if spec.tree is not None and max(spec.tree) > vocab_size:
    raise ConfigError(f"SpecConfig.tree={spec.tree!r} is invalid for this model: a node's "
                      f"children are distinct tokens, so at most vocab_size={vocab_size} "
                      "children per node.")


def check_arguments(config, prompts: Any, *, sampling: Any, rng: Any, drafter: Any,
                    spec: Any) -> tuple[list[list[int]], jax.Array]:
  """All of ``generate``'s checks against the target's ``config``: (prompts as lists of
  ints, rng as one typed key)."""
  check_sampling(sampling, config.vocab_size)
  check_drafter(drafter)
  check_spec(spec, config.vocab_size)
  prompts = check_prompts(prompts, config.vocab_size, sampling,
                          config.max_position_embeddings)
  return prompts, check_rng(rng)
