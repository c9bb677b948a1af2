"""The long-tailed addition task: its digit counts follow the power law it claims, its
prompts and rewards are right for long operands, and it is reproducible by seed."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specrl_jax as sj
from specrl_jax.models import tokenizer
from specrl_jax.rl import tasks
from specrl_jax.rl.app.experiment import experiment_config


def _operands(problem):
  a, b = problem.prompt.rstrip("=").split("+")
  return a, b


def _responses(texts, width):
  tokens = np.full((len(texts), width), -1, np.int32)
  lengths = np.zeros(len(texts), np.int32)
  for row, text in enumerate(texts):
    ids = tokenizer.encode(text) + [tokenizer.EOS_ID]
    tokens[row, :len(ids)] = ids
    lengths[row] = len(ids)
  return jnp.asarray(tokens), jnp.asarray(lengths)


@pytest.mark.parametrize("options", [{}, dict(min_digits=2, max_digits=12, tail_exponent=1.5)],
                         ids=("default", "2-12_exponent_1.5"))
def test_digit_counts_follow_the_power_law(options):
  task = tasks.LongTailArithmetic(**options)
  rng = np.random.default_rng(0)
  draws = 20_000
  digits = []
  for _ in range(draws):
    a, b = _operands(task.sample(rng))
    assert len(a) == len(b)  # both operands of a problem have d digits
    digits.append(len(a))
  digits_D, probabilities_D = task.digit_distribution()
  expected_D = probabilities_D * draws
  observed_D = np.asarray([digits.count(int(d)) for d in digits_D])
  assert observed_D.sum() == draws  # no count outside min_digits..max_digits
  # Each count within 4 binomial standard deviations of d ** -tail_exponent's share.
  sigma_D = np.sqrt(expected_D * (1 - probabilities_D))
  np.testing.assert_array_less(np.abs(observed_D - expected_D), 4 * sigma_D)


def test_the_default_is_heavy_tailed_half_short_one_in_five_long():
  digits_D, probabilities_D = tasks.LongTailArithmetic().digit_distribution()
  np.testing.assert_array_equal(digits_D, np.arange(1, 17))
  np.testing.assert_allclose(probabilities_D * np.arange(1, 17), probabilities_D[0])  # ~ 1/d
  assert probabilities_D[digits_D <= 3].sum() > 0.5
  assert probabilities_D[digits_D >= 9].sum() > 0.19


def test_reference_response_lengths_are_long_tailed():
  task = tasks.LongTailArithmetic()
  rng = np.random.default_rng(1)
  lengths = np.asarray([len(tokenizer.encode(task.sample(rng).solution)) + 1  # + EOS
                        for _ in range(4000)])
  assert lengths.max() > 3 * lengths.mean()
  assert lengths.max() <= task.max_response_tokens


def test_long_operands_are_summed_right_and_rewarded_only_when_exact():
  task = tasks.LongTailArithmetic(min_digits=16, max_digits=16)
  problems = [task.sample(np.random.default_rng(seed)) for seed in range(8)]
  for problem in problems:
    a, b = _operands(problem)
    assert len(a) == len(b) == 16 and a[0] != "0"
    assert problem.solution.endswith(f"#{int(a) + int(b)}")
  wrong = [p.solution[:-1] + str((int(p.solution[-1]) + 1) % 10) for p in problems]
  tokens, lengths = _responses([p.solution for p in problems] + wrong, task.max_response_tokens)
  targets = {"answer": jnp.asarray(np.stack([p.targets["answer"] for p in problems] * 2))}
  rewards = jax.jit(task.reward)(targets, tokens, lengths)
  chex.assert_trees_all_equal(rewards, jnp.asarray([1.0] * 8 + [0.0] * 8, jnp.float32))
  prompt_set = tasks.make_prompt_set(task, 8, seed=0, max_prompt_tokens=task.max_prompt_tokens)
  assert int(prompt_set.lengths_P.max()) == task.max_prompt_tokens


def test_problems_are_reproducible_by_seed():
  task = tasks.LongTailArithmetic()
  prompts = lambda seed: [p.prompt for p in task.prompt_problems(50, np.random.default_rng(seed))]
  assert prompts(7) == prompts(7)
  assert prompts(7) != prompts(8)
  np.testing.assert_array_equal(tasks.make_prompt_set(task, 32, seed=3).tokens_PxT,
                                tasks.make_prompt_set(task, 32, seed=3).tokens_PxT)


@pytest.mark.parametrize("options, field", [
    (dict(min_digits=0), "min_digits"), (dict(max_digits=19), "max_digits"),
    (dict(min_digits=5, max_digits=4), "max_digits"), (dict(min_digits=True), "min_digits"),
    (dict(tail_exponent=0.0), "tail_exponent"), (dict(tail_exponent=float("nan")), "tail_exponent"),
    (dict(tail_exponent="1"), "tail_exponent")])
def test_invalid_options_are_refused_by_name(options, field):
  with pytest.raises(sj.ConfigError, match=f"LongTailArithmetic.{field}="):
    tasks.LongTailArithmetic(**options)


def test_the_experiment_config_selects_it_by_name():
  config = experiment_config("demo", [
      "--task.name=longtail_arithmetic", "--task.min_digits=1", "--task.max_digits=12",
      "--task.tail_exponent=1.5"])
  assert config.task.make() == tasks.LongTailArithmetic(min_digits=1, max_digits=12,
                                                        tail_exponent=1.5)
  assert tasks.make_task("longtail_arithmetic") == tasks.LongTailArithmetic()
  with pytest.raises(sj.ConfigError, match="tail_exponent"):
    experiment_config("demo", ["--task.name=longtail_arithmetic", "--task.tail_exponent=-1"])
