"""Supervised warm start: teach a tiny policy the task's worked-solution format so
that RL starts from non-trivial reward, and distil a draft model from that policy.

Both are next-token training on prompt + solution + EOS with the loss on solution
tokens: against the solution itself (SFT) or against a teacher's full distribution
(distillation, soft cross-entropy), which is what a drafter must match to be accepted.
Every batch is freshly sampled from the task with a seeded generator, so runs repeat.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from specrl_jax.config import check, check_positive_int, is_finite_number
from specrl_jax.models import tokenizer
from specrl_jax.models.text_tokenizer import TextTokenizer
from specrl_jax.models.transformer import Transformer
from specrl_jax.rl.tasks.base import Problem, Task

Array = jax.Array


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTConfig:
  """steps of AdamW on batches of ``batch_size`` fresh problems; the learning rate
  warms up linearly over the first 10% of steps, then decays by cosine to 10%.

  noise: the fraction of solutions in which one digit is replaced by a random digit.
  A noisy demonstrator: the warm-started policy then slips on digits now and then, as
  a policy that imitated imperfect data does, and RL has something to fix quickly.
  """
  steps: int = 300
  batch_size: int = 32
  learning_rate: float = 3e-3
  weight_decay: float = 0.0
  noise: float = 0.0
  seed: int = 0

  def __post_init__(self):
    owner = "SFTConfig"
    for name in ("steps", "batch_size"):
      value = getattr(self, name)
      check_positive_int(owner, name, value)
    finite = lambda name: is_finite_number(getattr(self, name))
    check(finite("learning_rate") and self.learning_rate > 0, owner, "learning_rate",
          self.learning_rate, "a finite number > 0")
    check(finite("weight_decay") and self.weight_decay >= 0, owner, "weight_decay",
          self.weight_decay, "a finite number >= 0")
    check(finite("noise") and 0 <= self.noise <= 1, owner, "noise", self.noise,
          "a fraction in [0, 1]")


def with_digit_noise(problem: Problem, rng: np.random.Generator) -> Problem:
  """``problem`` with one random digit of its solution replaced by a random digit."""
  positions = [i for i, char in enumerate(problem.solution) if char.isdigit()]
  if not positions:
    return problem
  at = positions[int(rng.integers(len(positions)))]
  digit = str(int(rng.integers(10)))
  return dataclasses.replace(problem,
                             solution=problem.solution[:at] + digit + problem.solution[at + 1:])


def sft_examples(problems: Sequence[Problem], length: int,
                 text_tokenizer: TextTokenizer | None = None) -> tuple[np.ndarray, np.ndarray]:
  """(tokens int32 [N, length], loss mask [N, length]): the encoded prompt (chat
  template, or BOS + text), then solution + EOS, right-padded; the mask marks the
  tokens to predict (solution and EOS). text_tokenizer: default the built-in one."""
  text_tokenizer = text_tokenizer or tokenizer.text_tokenizer()
  tokens = np.full((len(problems), length), text_tokenizer.padding_id, np.int32)
  mask = np.zeros((len(problems), length), bool)
  for row, problem in enumerate(problems):
    prompt = problem.prompt_ids(text_tokenizer)
    answer = text_tokenizer.encode(problem.solution) + [text_tokenizer.eos_ids[0]]
    ids = prompt + answer
    if len(ids) > length:
      raise ValueError(f"problem {problem.prompt!r} needs {len(ids)} tokens > length {length}")
    tokens[row, :len(ids)] = ids
    mask[row, len(prompt):len(ids)] = True
  return tokens, mask


def sequence_length(task: Task) -> int:
  """Room for the longest prompt and solution, rounded up to a multiple of 8."""
  return -(-(task.max_prompt_tokens + task.max_response_tokens) // 8) * 8


def trim_padding(tokens_BxT: np.ndarray, mask_BxT: np.ndarray, minimum: int = 16
                 ) -> tuple[np.ndarray, np.ndarray]:
  """The batch cut to the shortest power-of-two width (>= ``minimum``) that holds every
  example: the columns dropped are padding after every example's EOS, which a causal
  model's earlier positions never see, so the loss is the same. A dataset task's
  ``sequence_length`` budgets for its longest allowed prompt (512 tokens by default)
  while its rows may be ~30: padding to it made a 12M-parameter SFT step ~15x slower.
  Powers of two keep the compiled widths few."""
  used = np.nonzero(mask_BxT.any(axis=0))[0]
  longest = int(used[-1]) + 1 if used.size else 1
  width = max(minimum, 1 << (longest - 1).bit_length())
  if width >= tokens_BxT.shape[1]:
    return tokens_BxT, mask_BxT
  return tokens_BxT[:, :width], mask_BxT[:, :width]


def _loss(model: Transformer, tokens_BxT, mask_BxT, teacher_log_probs_BxTxV):
  """Mean cross-entropy of the tokens under ``mask`` (predicted from position t - 1)."""
  log_probs_BxTxV = jax.nn.log_softmax(model(tokens_BxT)[:, :-1])
  mask = mask_BxT[:, 1:].astype(jnp.float32)
  if teacher_log_probs_BxTxV is None:
    picked = jnp.take_along_axis(log_probs_BxTxV, tokens_BxT[:, 1:, None], axis=-1)[..., 0]
    per_token = -picked
  else:
    per_token = -jnp.sum(jnp.exp(teacher_log_probs_BxTxV[:, :-1]) * log_probs_BxTxV, axis=-1)
  return jnp.sum(per_token * mask) / jnp.maximum(mask.sum(), 1.0)


def train_sft(model: Transformer, task: Task, config: SFTConfig, *,
              teacher: Transformer | None = None, log_every: int = 0,
              progress: str | None = None) -> tuple[Transformer, list[float]]:
  """Trains ``model`` (returned, a new object) and the loss of every step.

  With ``teacher``, the target is the teacher's next-token distribution (temperature
  1) on the same sequences: distillation of a drafter from the policy.
  progress: a label for a tqdm bar on stderr (None: no bar).
  """
  warmup = max(1, config.steps // 10)
  # At least one step of decay after the warmup: optax refuses an empty cosine (steps=1).
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, config.learning_rate, warmup, max(config.steps, warmup + 1),
      end_value=config.learning_rate * 0.1)
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax.adamw(schedule, weight_decay=config.weight_decay))
  graphdef, params = nnx.split(model)
  opt_state = tx.init(params)
  teacher_split = nnx.split(teacher) if teacher is not None else None

  @jax.jit
  def update(params, opt_state, teacher_params, tokens_BxT, mask_BxT):
    teacher_log_probs = None
    if teacher_split is not None:
      teacher_model = nnx.merge(teacher_split[0], teacher_params)
      teacher_log_probs = jax.nn.log_softmax(teacher_model(tokens_BxT))
    loss, grads = jax.value_and_grad(
        lambda p: _loss(nnx.merge(graphdef, p), tokens_BxT, mask_BxT, teacher_log_probs))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  rng = np.random.default_rng(config.seed)
  length = sequence_length(task)
  teacher_params = teacher_split[1] if teacher_split is not None else None
  losses = []
  bar = None
  if progress is not None:
    from tqdm import tqdm
    bar = tqdm(total=config.steps, desc=progress, unit="step", dynamic_ncols=True,
               file=sys.stderr)
    bar.set_postfix_str("compiling")  # the first step traces and compiles the update
  for step in range(config.steps):
    problems = [task.sample(rng) for _ in range(config.batch_size)]
    problems = [with_digit_noise(p, rng) if rng.random() < config.noise else p for p in problems]
    tokens, mask = trim_padding(*sft_examples(problems, length, task.tokenizer))
    params, opt_state, loss = update(params, opt_state, teacher_params, tokens, mask)
    losses.append(loss)
    if log_every and (step + 1) % log_every == 0:
      print(f"  sft step {step + 1}/{config.steps}: loss {float(loss):.3f}", flush=True)
    if bar is not None:
      bar.update(1)
      # Reading the loss waits for the step: only now and then, so dispatch runs ahead.
      if step == 0 or (step + 1) % 10 == 0:
        bar.set_postfix(loss=f"{float(loss):.3f}")
  if bar is not None:
    bar.close()
  return nnx.merge(graphdef, params), [float(x) for x in jax.device_get(losses)]
