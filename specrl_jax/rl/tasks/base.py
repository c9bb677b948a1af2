"""What a task is: problems with verifiable answers, their prompts, and a reward.

A task samples problems (a prompt, a worked solution for the SFT warm start, and the
arrays its reward needs), and scores responses with a *jittable* reward over token
arrays, so rewards run inside the compiled RL step with no host round trip. Tasks
whose answers need Python to check (a CAS, a unit-test runner) wrap a host function
with ``python_reward`` instead, which calls back to the host.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specrl_jax.config import ConfigError, check, check_positive_int
from specrl_jax.models import tokenizer
from specrl_jax.models.text_tokenizer import TextTokenizer, UnknownTextError

Array = jax.Array
# (targets: dict of [R, ...] arrays, response tokens int32 [R, L] with -1 after the end,
#  response lengths int32 [R]) -> float32 rewards [R]
RewardFn = Callable[[Mapping[str, Array], Array, Array], Array]


class NoValidPromptsError(ValueError):
  """A prompt set has no prompt the policy can be trained on."""


@dataclasses.dataclass(frozen=True)
class Problem:
  """One problem: the prompt text, a worked solution (SFT target, no EOS), the
  per-problem arrays the reward reads (same keys and shapes for every problem), an
  optional system prompt, or instead the whole conversation before the answer as chat
  messages (rendered by the tokenizer's chat template)."""
  prompt: str
  solution: str
  targets: Mapping[str, np.ndarray]
  system: str | None = None
  messages: tuple[Mapping[str, str], ...] | None = None

  def prompt_ids(self, text_tokenizer: TextTokenizer) -> list[int]:
    """The prompt as the policy reads it: ``messages`` when given (a conversation,
    system message included), else ``prompt`` as the user's turn after ``system``."""
    if self.messages is not None:
      return text_tokenizer.encode_messages(self.messages)
    return text_tokenizer.encode_prompt(self.prompt, system=self.system)


class Task(abc.ABC):
  """A family of problems with a verifiable reward.

  Subclasses are frozen dataclasses (hashable: they are static arguments of jitted
  steps) implementing ``sample`` and ``reward``.
  """

  name: str = "task"

  @property
  @abc.abstractmethod
  def max_response_tokens(self) -> int:
    """Responses longer than this (EOS included) cannot be correct."""

  @property
  @abc.abstractmethod
  def max_prompt_tokens(self) -> int:
    """The longest prompt the task samples (BOS included)."""

  @abc.abstractmethod
  def sample(self, rng: np.random.Generator) -> Problem:
    """A random problem."""

  @abc.abstractmethod
  def reward(self, targets: Mapping[str, Array], tokens_RxL: Array, lengths_R: Array) -> Array:
    """Jittable float32 rewards [R] of responses against their problems' targets."""

  def prompt_problems(self, size: int, rng: np.random.Generator) -> list[Problem]:
    """The problems of a prompt set: ``size`` samples (a dataset gives its rows)."""
    return [self.sample(rng) for _ in range(size)]

  @property
  def tokenizer(self) -> TextTokenizer:
    """The tokenizer prompts, solutions and responses are encoded with."""
    return tokenizer.text_tokenizer()

  def check_tokenizer(self, policy_tokenizer: TextTokenizer) -> None:
    """Raises ConfigError if the task cannot be trained with ``policy_tokenizer``."""
    if not same_vocabulary(policy_tokenizer, self.tokenizer):
      raise ConfigError(
          f"task {self.name!r} encodes with {self.tokenizer.source} ({self.tokenizer.vocab_size} "
          f"tokens) but the policy's tokenizer is {policy_tokenizer.source} "
          f"({policy_tokenizer.vocab_size} tokens); its reward reads token ids of its own "
          "vocabulary. Use a dataset task (--dataset=... --reward=...) with this model, or a "
          "built-in-vocabulary policy.")


def same_vocabulary(a: TextTokenizer, b: TextTokenizer) -> bool:
  """The two map the same strings to the same ids and stop at the same tokens."""
  return a is b or (a.tokenizer.get_vocab(with_added_tokens=True)
                    == b.tokenizer.get_vocab(with_added_tokens=True) and a.eos_ids == b.eos_ids)


@dataclasses.dataclass(frozen=True)
class PromptSet:
  """P problems encoded with a tokenizer (its chat template, or BOS + prompt text).

  tokens_PxT: int32 prompts right-padded with the tokenizer's pad id to T (a multiple
  of the bucket);
  lengths_P: int32; targets: the reward's arrays, each [P, ...]; problems: the source.
  """
  problems: tuple[Problem, ...]
  tokens_PxT: np.ndarray
  lengths_P: np.ndarray
  targets: Mapping[str, np.ndarray]

  def __len__(self) -> int:
    return len(self.problems)

  @property
  def prompts(self) -> list[list[int]]:
    return [row[:n].tolist() for row, n in zip(self.tokens_PxT, self.lengths_P)]

  def take(self, indices: Sequence[int]) -> "PromptBatch":
    indices = np.asarray(indices, np.int64)
    return PromptBatch(tokens_PxT=self.tokens_PxT[indices], lengths_P=self.lengths_P[indices],
                       targets={k: v[indices] for k, v in self.targets.items()},
                       indices_P=indices.astype(np.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptBatch:
  """The prompts of one RL step as arrays (a pytree: it crosses into jitted steps)."""
  tokens_PxT: Any
  lengths_P: Any
  targets: Mapping[str, Any]
  indices_P: Any

  @property
  def num_prompts(self) -> int:
    return self.tokens_PxT.shape[0]


def _stack_targets(problems: Sequence[Problem]) -> dict[str, np.ndarray]:
  keys = sorted(problems[0].targets)
  for index, problem in enumerate(problems):
    if sorted(problem.targets) != keys:
      raise ValueError(f"problem {index} has reward targets {sorted(problem.targets)}; "
                       f"expected the same keys as problem 0: {keys}")
  return {k: np.stack([np.asarray(p.targets[k]) for p in problems]) for k in keys}


def encode_problems(problems: Sequence[Problem], *, max_prompt_tokens: int,
                    bucket: int = 16, text_tokenizer: TextTokenizer | None = None) -> PromptSet:
  """Encodes problems into a PromptSet, dropping the ones that cannot be prompts.

  text_tokenizer: the policy's (default: the built-in vocabulary). A prompt is
  unusable when its text has characters the tokenizer has no token for or it is
  longer than ``max_prompt_tokens``; if nothing is left, that is an error naming why
  the first problems were rejected (a run with no prompts cannot learn).
  """
  check(isinstance(max_prompt_tokens, int) and max_prompt_tokens > 1, "encode_problems",
        "max_prompt_tokens", max_prompt_tokens, "an integer > 1")
  text_tokenizer = text_tokenizer or tokenizer.text_tokenizer()
  kept, encoded, reasons = [], [], []
  for index, problem in enumerate(problems):
    try:
      ids = problem.prompt_ids(text_tokenizer)
    except UnknownTextError as error:
      reasons.append(f"problem {index}: {error}")
      continue
    if len(ids) > max_prompt_tokens:
      reasons.append(f"problem {index}: prompt has {len(ids)} tokens > max_prompt_tokens="
                     f"{max_prompt_tokens}")
      continue
    kept.append(problem)
    encoded.append(ids)
  if not kept:
    detail = "; ".join(reasons[:3]) if reasons else "the problem list is empty"
    raise NoValidPromptsError(f"no valid prompts among {len(problems)} problems ({detail}).")
  width = -(-max(len(ids) for ids in encoded) // bucket) * bucket
  tokens = np.full((len(kept), width), text_tokenizer.padding_id, np.int32)
  for row, ids in enumerate(encoded):
    tokens[row, :len(ids)] = ids
  return PromptSet(problems=tuple(kept), tokens_PxT=tokens,
                   lengths_P=np.asarray([len(ids) for ids in encoded], np.int32),
                   targets=_stack_targets(kept))


def make_prompt_set(task: Task, size: int, *, seed: int, max_prompt_tokens: int = 64,
                    bucket: int = 16) -> PromptSet:
  """``task``'s prompt problems (``size`` samples drawn with ``seed``, or a dataset's
  rows), encoded with the task's tokenizer."""
  check_positive_int("make_prompt_set", "size", size)
  rng = np.random.default_rng(seed)
  return encode_problems(task.prompt_problems(size, rng),
                         max_prompt_tokens=max_prompt_tokens, bucket=bucket,
                         text_tokenizer=task.tokenizer)


def step_indices(num_prompts_in_set: int, step: int, prompts_per_step: int, seed: int
                 ) -> np.ndarray:
  """The prompt indices of RL step ``step``: epochs of seeded permutations.

  A pure function of (set size, step, batch size, seed), so a resumed run sees exactly
  the prompts the uninterrupted run would have.
  """
  start = step * prompts_per_step
  indices = []
  while len(indices) < prompts_per_step:
    epoch, offset = divmod(start + len(indices), num_prompts_in_set)
    order = np.random.default_rng([seed, epoch]).permutation(num_prompts_in_set)
    take = min(prompts_per_step - len(indices), num_prompts_in_set - offset)
    indices.extend(order[offset:offset + take].tolist())
  return np.asarray(indices, np.int64)


# ------------------------------------------------------------------ token utilities

def token_of(char: str) -> int:
  return tokenizer.VOCAB[char]


DIGIT_0 = tokenizer.VOCAB["0"]


def digits_of(tokens: Array) -> tuple[Array, Array]:
  """(is a digit, its value) for each token id."""
  is_digit = (tokens >= DIGIT_0) & (tokens <= DIGIT_0 + 9)
  return is_digit, jnp.where(is_digit, tokens - DIGIT_0, 0)


def answer_tokens(text: str, width: int) -> np.ndarray:
  """int32 [width]: the answer's token ids, -1 padded (the reward's target format)."""
  ids = tokenizer.encode(text)
  if len(ids) > width:
    raise ValueError(f"answer {text!r} has {len(ids)} tokens > width {width}")
  return np.asarray(ids + [-1] * (width - len(ids)), np.int32)


def matches_after_marker(tokens_RxL: Array, lengths_R: Array, marker: int,
                         answer_RxA: Array) -> Array:
  """bool [R]: the response ends with ``marker`` + answer + EOS.

  The answer is read after the *last* marker; a response cut off by the token budget
  (no EOS) never matches, so truncated answers are not rewarded.
  """
  length = tokens_RxL.shape[1]
  index_L = jnp.arange(length)
  valid_RxL = index_L[None, :] < lengths_R[:, None]
  is_marker_RxL = (tokens_RxL == marker) & valid_RxL
  has_marker_R = jnp.any(is_marker_RxL, axis=1)
  last_marker_R = length - 1 - jnp.argmax(is_marker_RxL[:, ::-1], axis=1)
  answer_length_R = jnp.sum(answer_RxA >= 0, axis=1)
  width = answer_RxA.shape[1]
  index_A = jnp.arange(width)
  read_RxA = jnp.clip(last_marker_R[:, None] + 1 + index_A[None, :], 0, length - 1)
  read_tokens_RxA = jnp.take_along_axis(tokens_RxL, read_RxA, axis=1)
  digit_ok_R = jnp.all((index_A[None, :] >= answer_length_R[:, None])
                       | (read_tokens_RxA == answer_RxA), axis=1)
  end_R = last_marker_R + 1 + answer_length_R
  eos_R = jnp.take_along_axis(tokens_RxL, jnp.clip(end_R, 0, length - 1)[:, None], axis=1)[:, 0]
  ends_right_R = (end_R == lengths_R - 1) & (eos_R == tokenizer.EOS_ID)
  return has_marker_R & digit_ok_R & ends_right_R
