"""Evaluation on held-out prompts: k samples per prompt, their rewards, pass@1..k.

pass@j is the unbiased estimator of Chen et al. (2021): with n samples of which c are
correct, 1 - C(n - c, j) / C(n, j), averaged over prompts. A sample is correct when
its reward is at least ``threshold``.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from specrl_jax.config import SamplingParams, check, check_positive_int
from specrl_jax.models.transformer import Transformer
from specrl_jax.rl.tasks.base import encode_problems
from specrl_jax.rl.tasks.dataset_task import DatasetTask
from specrl_jax.rl.tasks.python_reward import RewardFunctionError
from specrl_jax.rl.tasks.reward_workers import SampleError
from specrl_jax.sampling.generate import generate


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
  """The probability that at least one of k samples drawn without replacement from
  ``num_samples`` (``num_correct`` of them correct) is correct."""
  check(0 < k <= num_samples, "pass_at_k", "k", k, f"in [1, num_samples={num_samples}]")
  if num_samples - num_correct < k:
    return 1.0
  return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def evaluate(model: Transformer, task: DatasetTask, *, k: int = 8, temperature: float = 1.0,
             seed: int = 0, threshold: float = 1.0, max_prompts: int = 0
             ) -> dict[str, float]:
  """pass@1..k, the mean reward and the number of prompts of ``task``'s rows under
  ``model`` (sampled at ``temperature``, ``task.max_response_tokens`` at most).

  max_prompts: evaluate only the first this many usable rows (0: all).
  """
  check_positive_int("evaluate", "k", k)
  tok = task.tokenizer
  prompt_set = encode_problems(task.problems(), max_prompt_tokens=task.max_prompt_tokens,
                               text_tokenizer=tok)
  count = len(prompt_set) if max_prompts <= 0 else min(max_prompts, len(prompt_set))
  prompts = prompt_set.prompts[:count]
  indices = [int(i) for i in prompt_set.targets["index"][:count]]
  sampling = SamplingParams(temperature=temperature, max_new_tokens=task.max_response_tokens,
                            stop_token_ids=tok.eos_ids)
  out = generate(model, [p for p in prompts for _ in range(k)], sampling=sampling,
                 rng=jax.random.key(seed))
  tokens = np.asarray(out.tokens)
  lengths = np.asarray(out.lengths)
  completions = [tok.decode(row[:n].tolist()) for row, n in zip(tokens, lengths)]
  rows = [index for index in indices for _ in range(k)]
  try:
    rewards = np.asarray(task.score_texts(rows, completions), np.float64)
  except SampleError as error:
    raise RewardFunctionError(
        f"the reward function {task.reward_name} {error.problem} on evaluation sample "
        f"{error.index} (row {rows[error.index]}, completion "
        f"{completions[error.index][:80]!r})") from error.cause
  bad = np.flatnonzero(~np.isfinite(rewards))
  if bad.size:
    raise RewardFunctionError(f"the reward function {task.reward_name} returned "
                              f"{rewards[bad[0]]} on evaluation sample {int(bad[0])}: rewards "
                              "must be finite numbers")
  correct = (rewards >= threshold).reshape(count, k).sum(axis=1)
  result = {f"pass@{j}": float(np.mean([pass_at_k(k, int(c), j) for c in correct]))
            for j in range(1, k + 1)}
  result["reward_mean"] = float(rewards.mean())
  result["num_prompts"] = count
  result["response_length_mean"] = float(lengths.mean())
  return result

