"""Tasks with verifiable rewards: the jittable checkers accept exactly the right
answers, the Python-callback hook agrees with them and reports its errors, and prompt
sets and the SFT warm start behave."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import specrl_jax as sj
from specrl_jax.models import tokenizer
from specrl_jax.rl.loop import sft
from specrl_jax.rl import tasks


def _responses(texts, width, *, eos=True):
  """Response token arrays as the sampler returns them: -1 after the end."""
  tokens = np.full((len(texts), width), -1, np.int32)
  lengths = np.zeros(len(texts), np.int32)
  for row, text in enumerate(texts):
    ids = tokenizer.encode(text) + ([tokenizer.EOS_ID] if eos else [])
    tokens[row, :len(ids)] = ids
    lengths[row] = len(ids)
  return jnp.asarray(tokens), jnp.asarray(lengths)


def _targets(problems):
  return {k: jnp.asarray(np.stack([p.targets[k] for p in problems])) for k in problems[0].targets}


def test_worked_sum_shows_each_column_with_its_carry():
  assert tasks.worked_sum(47, 85) == "7+5=12\n4+8+1=13\n#132"
  assert tasks.worked_sum(5, 123) == "5+3=8\n0+2=2\n0+1=1\n#128"


@pytest.mark.parametrize("task", [tasks.Arithmetic(), tasks.Countdown()], ids=lambda t: t.name)
def test_reference_solutions_earn_full_reward_under_jit(task):
  problems = [task.sample(np.random.default_rng(seed)) for seed in range(32)]
  tokens, lengths = _responses([p.solution for p in problems], task.max_response_tokens)
  rewards = jax.jit(task.reward)(_targets(problems), tokens, lengths)
  chex.assert_trees_all_equal(rewards, jnp.ones(32, jnp.float32))


def test_arithmetic_reward_checks_only_the_final_answer_and_its_end():
  task = tasks.Arithmetic(min_digits=2, max_digits=2)
  targets = {"answer": jnp.asarray([tokenizer.encode("132") + [-1]] * 6, jnp.int32)}
  texts = ["7+5=12\n4+8+1=13\n#132",   # right
           "#132",                      # right without steps: still the right answer
           "#131\n#132",                # the last answer counts
           "7+5=12\n#133",              # wrong
           "#1320",                     # extra digit
           "#13"]                       # too short
  tokens, lengths = _responses(texts, task.max_response_tokens)
  np.testing.assert_array_equal(task.reward(targets, tokens, lengths), [1, 1, 1, 0, 0, 0])


def test_arithmetic_reward_refuses_answers_without_eos():
  task = tasks.Arithmetic(min_digits=2, max_digits=2)
  targets = {"answer": jnp.asarray([tokenizer.encode("132") + [-1]], jnp.int32)}
  tokens, lengths = _responses(["#132"], task.max_response_tokens, eos=False)
  np.testing.assert_array_equal(task.reward(targets, tokens, lengths), [0])


def test_countdown_reward_requires_valid_arithmetic_with_each_number_once():
  task = tasks.Countdown(num_numbers=3)
  targets = {"numbers": jnp.asarray([[3, 5, 7]] * 7, jnp.int32),
             "target": jnp.asarray([22] * 7, jnp.int32)}
  texts = ["3*5=15\n15+7=22\n",    # valid
           "5*3=15\n7+15=22\n",    # operands in any order
           "3*5=15\n15+7=23\n",    # false arithmetic
           "3*5=15\n15+5=20\n",    # 5 used twice, 7 unused (and wrong target)
           "3*7=21\n21+1=22\n",    # 1 is not given
           "3*5=15\n",             # stops early
           "3*5=15\n15+7=22"]      # last line not closed
  tokens, lengths = _responses(texts, task.max_response_tokens)
  np.testing.assert_array_equal(jax.jit(task.reward)(targets, tokens, lengths),
                                [1, 1, 0, 0, 0, 0, 0])


def test_parse_lines_reads_operands_operators_and_results():
  tokens, _ = _responses(["12-3=9\n9*4=36\n"], 24)
  lines, count, ok = tasks.parse_lines(tokens[0], 2)
  np.testing.assert_array_equal(lines, [[12, 2, 3, 9], [9, 3, 4, 36]])
  assert int(count) == 2 and bool(ok)


def test_python_reward_agrees_with_the_jittable_checker():
  task = tasks.Arithmetic()
  hosted = tasks.PythonRewardTask(task=task, fn=tasks.arithmetic_answer_checker)
  problems = [task.sample(np.random.default_rng(seed)) for seed in range(8)]
  texts = [p.solution if i % 2 else p.solution + "1" for i, p in enumerate(problems)]
  tokens, lengths = _responses(texts, task.max_response_tokens)
  expected = task.reward(_targets(problems), tokens, lengths)
  np.testing.assert_array_equal(jax.jit(hosted.reward)(_targets(problems), tokens, lengths),
                                expected)
  np.testing.assert_array_equal(expected, [0, 1] * 4)


def test_a_raising_python_reward_yields_nan_and_a_clear_error_on_the_host():
  def broken(response, targets):
    raise KeyError("no such field")

  task = tasks.PythonRewardTask(task=tasks.Arithmetic(), fn=broken)
  problems = [task.sample(np.random.default_rng(0))]
  tokens, lengths = _responses([problems[0].solution], task.max_response_tokens)
  rewards = jax.jit(task.reward)(_targets(problems), tokens, lengths)
  assert np.isnan(np.asarray(rewards)).all()
  with pytest.raises(tasks.RewardFunctionError, match="broken raised KeyError"):
    tasks.raise_pending_errors()
  tasks.raise_pending_errors()  # reported once


def test_prompt_sets_drop_unusable_prompts_and_fail_when_none_is_left():
  good = tasks.Problem(prompt="1+2=", solution="#3", targets={"x": np.zeros(1)})
  bad_char = tasks.Problem(prompt="1 + 2 = ?<", solution="", targets={"x": np.zeros(1)})
  too_long = tasks.Problem(prompt="1" * 40, solution="", targets={"x": np.zeros(1)})
  prompt_set = tasks.encode_problems([bad_char, good, too_long], max_prompt_tokens=16)
  assert prompt_set.prompts == [tokenizer.encode("1+2=", add_bos=True)]
  assert prompt_set.tokens_PxT.shape == (1, 16)
  with pytest.raises(tasks.NoValidPromptsError, match="max_prompt_tokens=16"):
    tasks.encode_problems([too_long], max_prompt_tokens=16)
  with pytest.raises(tasks.NoValidPromptsError,
                     match="has no token in the tokenizer of the built-in vocabulary"):
    tasks.encode_problems([bad_char], max_prompt_tokens=16)


def test_step_indices_are_seeded_epochs_without_repeats():
  first_epoch = np.concatenate([tasks.step_indices(10, step, 5, seed=3) for step in range(2)])
  assert sorted(first_epoch.tolist()) == list(range(10))
  np.testing.assert_array_equal(tasks.step_indices(10, 7, 5, seed=3),
                                tasks.step_indices(10, 7, 5, seed=3))
  assert not np.array_equal(tasks.step_indices(10, 2, 5, seed=3)[:5],
                            tasks.step_indices(10, 0, 5, seed=3))


def test_make_task_names_the_registered_tasks():
  assert isinstance(tasks.make_task("countdown", num_numbers=4), tasks.Countdown)
  with pytest.raises(sj.ConfigError, match="expected one of"):
    tasks.make_task("chess")
  with pytest.raises(sj.ConfigError, match="max_digits"):
    tasks.Arithmetic(min_digits=3, max_digits=2)


def test_sft_lowers_the_loss_and_distillation_moves_the_student_toward_the_teacher():
  task = tasks.Arithmetic(min_digits=1, max_digits=1)
  config = sj.ModelConfig(vocab_size=tokenizer.VOCAB_SIZE, hidden_size=32, intermediate_size=64,
                          num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
  policy, losses = sft.train_sft(sj.Transformer(config, rngs=nnx.Rngs(0)), task,
                                 sft.SFTConfig(steps=40, batch_size=16, learning_rate=1e-2))
  assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5])
  _, soft = sft.train_sft(sj.Transformer(config, rngs=nnx.Rngs(1)), task,
                          sft.SFTConfig(steps=20, batch_size=16, learning_rate=1e-2),
                          teacher=policy)
  assert np.mean(soft[-3:]) < np.mean(soft[:3])


def test_sft_batches_drop_trailing_padding_without_changing_the_loss():
  # A task budgets for its longest allowed prompt; the batch is cut to the power of two
  # that holds its longest example, and a causal model's loss cannot tell.
  task = tasks.Arithmetic(min_digits=1, max_digits=2)
  problems = [task.sample(np.random.default_rng(i)) for i in range(6)]
  tokens, mask = sft.sft_examples(problems, 256)
  trimmed, trimmed_mask = sft.trim_padding(tokens, mask)
  longest = int(np.nonzero(mask.any(axis=0))[0][-1]) + 1
  assert trimmed.shape[1] == 1 << (longest - 1).bit_length() < 256
  np.testing.assert_array_equal(trimmed, tokens[:, :trimmed.shape[1]])
  assert (tokens[:, trimmed.shape[1]:] == tokenizer.text_tokenizer().padding_id).all()
  config = sj.ModelConfig(vocab_size=tokenizer.VOCAB_SIZE, hidden_size=32, intermediate_size=64,
                          num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
  model = sj.Transformer(config, rngs=nnx.Rngs(0))
  full = sft._loss(model, jnp.asarray(tokens), jnp.asarray(mask), None)
  cut = sft._loss(model, jnp.asarray(trimmed), jnp.asarray(trimmed_mask), None)
  np.testing.assert_allclose(cut, full, rtol=1e-5)
  narrow = np.zeros((2, 40), bool)
  narrow[:, 3] = True
  assert sft.trim_padding(np.zeros((2, 40), np.int32), narrow)[0].shape == (2, 16)


def test_the_noisy_demonstrator_rewrites_one_digit_and_nothing_else():
  problem = tasks.Arithmetic().sample(np.random.default_rng(0))
  noisy = sft.with_digit_noise(problem, np.random.default_rng(1))
  changed = [i for i, (a, b) in enumerate(zip(problem.solution, noisy.solution)) if a != b]
  assert len(noisy.solution) == len(problem.solution) and len(changed) <= 1
  assert all(noisy.solution[i].isdigit() for i in changed)
  assert noisy.prompt == problem.prompt and noisy.targets is problem.targets
