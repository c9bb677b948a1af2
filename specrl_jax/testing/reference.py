"""Slow, obviously correct references for decoders: full causal forwards, no cache.

Everything here recomputes the whole sequence at every step, so it shares no code
with the paged engine except the model and the one logits warp.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specrl_jax.config import SamplingParams
from specrl_jax.models.transformer import Transformer
from specrl_jax.sampling.warp import warped_log_probs
from specrl_jax.testing.stats import Outcome

# Rows per forward when enumerating, bounding memory.
_CHUNK = 4096


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _logits_BxTxV(graphdef, state, tokens_BxT):
  return nnx.merge(graphdef, state)(tokens_BxT)


# Separate from the forward so that one compiled forward per shape serves every
# SamplingParams (each warp compiles alone, quickly).
_warp = jax.jit(warped_log_probs, static_argnames="params")


def full_forward_log_probs(model: Transformer, tokens_BxT: np.ndarray,
                           sampling: SamplingParams) -> np.ndarray:
  """Warped log-probs [B, T, V] of the next token at every position, one causal forward
  over the whole (right-padded) sequences."""
  tokens_BxT = np.asarray(tokens_BxT, np.int32)
  batch, length = tokens_BxT.shape
  # Pad to power-of-two batches and multiple-of-8 lengths so repeated calls reuse a
  # few compiled shapes (causal attention: right padding changes nothing before it).
  padded = np.zeros((max(8, 1 << (batch - 1).bit_length()), -(-length // 8) * 8), np.int32)
  padded[:batch, :length] = tokens_BxT
  graphdef, state = nnx.split(model)
  log_probs_BxTxV = _warp(_logits_BxTxV(graphdef, state, jnp.asarray(padded)), sampling)
  return np.asarray(log_probs_BxTxV[:batch, :length])


def _next_token_log_probs(model: Transformer, sequences: list[Sequence[int]],
                          sampling: SamplingParams) -> np.ndarray:
  """Warped log-probs [B, V] after each of B equally long sequences, in chunks."""
  rows = []
  for start in range(0, len(sequences), _CHUNK):
    chunk = np.asarray(sequences[start:start + _CHUNK], np.int32)
    rows.append(full_forward_log_probs(model, chunk, sampling)[:, -1])
  return np.concatenate(rows).astype(np.float64)


def enumerate_sequence_distribution(model: Transformer, prompt: Sequence[int],
                                    sampling: SamplingParams, length: int, *,
                                    max_prefixes: int = 200_000) -> dict[Outcome, float]:
  """The exact joint distribution of the first ``length`` emitted tokens.

  Plain ancestral sampling from the warped distribution: every prefix with non-zero
  probability is extended by one batched full forward per depth (up to V^(length-1)
  prefixes at the last depth; top-k / top-p / greedy prune most of them). A prefix
  ending in one of ``sampling.stop_token_ids`` is a finished outcome, shorter than
  ``length``.
  Returns {token tuple: probability}; the probabilities sum to 1 up to float32 error.
  """
  if length < 1:
    raise ValueError(f"length={length} must be at least 1.")
  prompt = [int(t) for t in prompt]
  stops = set(sampling.stop_token_ids)
  live: dict[Outcome, float] = {(): 1.0}
  exact: dict[Outcome, float] = {}
  for depth in range(length):
    if len(live) > max_prefixes:
      raise ValueError(f"{len(live)} live prefixes at depth {depth} exceed max_prefixes="
                       f"{max_prefixes}: use a smaller vocabulary, length or top_k.")
    prefixes = list(live)
    probs_PxV = np.exp(_next_token_log_probs(model, [prompt + list(p) for p in prefixes],
                                             sampling))
    next_live: dict[Outcome, float] = {}
    for prefix, probs_V in zip(prefixes, probs_PxV):
      for token in np.flatnonzero(probs_V > 0):
        outcome = prefix + (int(token),)
        prob = live[prefix] * float(probs_V[token])
        if int(token) in stops or depth + 1 == length:
          exact[outcome] = prob
        else:
          next_live[outcome] = prob
    live = next_live
  return exact


def response_log_probs(model: Transformer, prompts: Sequence[Sequence[int]],
                       tokens_NxL: np.ndarray, lengths_N: np.ndarray,
                       sampling: SamplingParams) -> np.ndarray:
  """The warped log-prob of each emitted token given its prompt and the tokens before
  it, by full forwards (float32 [N, L], 0 after each response's end).

  What a decoder should report as ``logprobs``; identical rows are computed once.
  """
  tokens_NxL = np.asarray(tokens_NxL)
  lengths_N = np.asarray(lengths_N)
  rows = [tuple(int(t) for t in prompt) + tuple(int(t) for t in row[:n])
          for prompt, row, n in zip(prompts, tokens_NxL, lengths_N)]
  unique = list(dict.fromkeys(rows))
  width = max(len(row) for row in unique)
  # next_log_probs[row][t]: log-prob of token t + 1 of the row given tokens 0..t.
  next_log_probs: dict[tuple[int, ...], np.ndarray] = {}
  for start in range(0, len(unique), _CHUNK):
    chunk = unique[start:start + _CHUNK]
    padded_BxT = np.zeros((len(chunk), width), np.int32)
    for index, row in enumerate(chunk):
      padded_BxT[index, :len(row)] = row
    log_probs_BxTxV = full_forward_log_probs(model, padded_BxT, sampling)
    following_BxT = np.roll(padded_BxT, -1, axis=1)
    token_log_probs_BxT = np.take_along_axis(log_probs_BxTxV, following_BxT[..., None],
                                             axis=2)[..., 0]
    for index, row in enumerate(chunk):
      next_log_probs[row] = token_log_probs_BxT[index, :len(row) - 1]
  result_NxL = np.zeros(tokens_NxL.shape, np.float32)
  for index, (prompt, row, n) in enumerate(zip(prompts, rows, lengths_N)):
    result_NxL[index, :n] = next_log_probs[row][len(prompt) - 1:len(prompt) - 1 + n]
  return result_NxL


def greedy_reference(model: Transformer, prompts: Sequence[Sequence[int]],
                     max_new_tokens: int, stop_token_ids: Sequence[int] = ()
                     ) -> list[list[int]]:
  """Greedy decoding that reruns the full forward over the whole sequence every step."""
  stops = set(stop_token_ids)
  greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
  responses = []
  for prompt in prompts:
    sequence, response = [int(t) for t in prompt], []
    for _ in range(max_new_tokens):
      log_probs_V = full_forward_log_probs(model, np.asarray([sequence]), greedy)[0, -1]
      token = int(np.argmax(log_probs_V))
      response.append(token)
      sequence.append(token)
      if token in stops:
        break
    responses.append(response)
  return responses
