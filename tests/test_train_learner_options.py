"""`specrl train`'s learner options end to end at tiny size: a KL-penalised run builds
its reference policy, keeps it frozen, and resumes with it; the learner's options
reach the learner from the command line and bad ones are refused before anything
runs."""

import jax
import numpy as np
import pytest
from flax import nnx

from specrl_jax.config import ConfigError
from specrl_jax.rl import tasks
from specrl_jax.rl.app import train_command
from specrl_jax.rl.app.metrics import read_jsonl


def _spread(response, targets):
  """A reward that differs between samples (so GRPO has a signal) without a trained
  policy: the warm start is skipped to keep the test short."""
  del targets
  return float(len(response) % 3)


def _session(directory, steps, log):
  config = train_command.parse_argv([
      "--preset=tiny", "--drafter.kind=none", f"--rl.steps={steps}",
      "--output.checkpoint_every=1", "--output.progress=false", "--output.tensorboard=false",
      f"--output.directory={directory}", "--warm_start.sft_steps=0",
      "--learner.loss.beta=0.5", "--learner.schedule=linear", "--learner.decay_steps=10",
      "--learner.num_micro_batches=2"])
  return train_command.Session(
      config, task=tasks.PythonRewardTask(task=config.task.make(), fn=_spread), log=log)


def _same(a, b):
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_a_kl_penalised_run_trains_against_its_frozen_reference_and_resumes_with_it(tmp_path):
  session = _session(tmp_path, 2, log=lambda message: None)
  assert session.learner.loss.beta == 0.5 and session.learner.num_micro_batches == 2
  models = session.warm_start()
  initial = jax.device_get(nnx.split(models.policy)[1])
  session.train(models)
  state = jax.device_get(session.state)
  assert _same(state.ref_params, initial)  # frozen at the initial policy
  assert not _same(state.params, initial)  # while the policy moved
  records = read_jsonl(tmp_path / "metrics.jsonl")
  assert records[0]["kl"] == 0.0 and records[1]["kl"] > 0.0

  logs = []
  resumed = _session(tmp_path, 4, log=logs.append)
  resumed.train(resumed.warm_start())
  assert any("resumed from checkpoint step 2" in line for line in logs)
  assert _same(jax.device_get(resumed.state.ref_params), initial)
  records = read_jsonl(tmp_path / "metrics.jsonl")
  assert [r["step"] for r in records] == [0, 1, 2, 3]
  assert all(r["kl"] > 0.0 for r in records[1:])
  # The linear schedule over 10 steps from the peak (no warmup in the tiny preset).
  peak = session.config.learner.learning_rate
  np.testing.assert_allclose([r["learning_rate"] for r in records],
                             [peak * (1 - 0.9 * s / 10) for s in range(4)], rtol=1e-6)


def test_learner_options_are_checked_before_anything_runs():
  with pytest.raises(ConfigError, match="LearnerConfig.schedule='step'.*'constant'"):
    train_command.parse_argv(["--preset=tiny", "--learner.schedule=step"])
  with pytest.raises(ConfigError, match="LearnerConfig.num_micro_batches=3.*divisor of the 16"):
    train_command.parse_argv(["--preset=tiny", "--learner.num_micro_batches=3"])
  with pytest.raises(ConfigError, match="LearnerConfig.remat='all'"):
    train_command.parse_argv(["--preset=tiny", "--learner.remat=all"])
  with pytest.raises(ConfigError, match="GRPOConfig.beta=-1.0"):
    train_command.parse_argv(["--preset=tiny", "--learner.loss.beta=-1"])
  config = train_command.parse_argv(["--preset=tiny", "--learner.master_dtype=none",
                                     "--learner.remat=full", "--learner.skip_log_prob_pass=false"])
  learner = config.learner_config()
  assert learner.master_dtype is None and learner.remat == "full"
  assert learner.skip_log_prob_pass is False


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_lora_run_trains_adapters_and_its_rollouts_read_the_merged_weights(tmp_path, mode):
  config = train_command.parse_argv([
      "--preset=tiny", "--drafter.kind=none", "--rl.steps=2", f"--rl.mode={mode}",
      "--rl.max_policy_lag=0", "--output.checkpoint_every=0", "--output.progress=false", "--output.tensorboard=false",
      f"--output.directory={tmp_path}", "--warm_start.sft_steps=0", "--learner.learning_rate=0.05",
      "--learner.lora.rank=4", "--learner.lora.targets=q_proj,up_proj"])
  session = train_command.Session(
      config, task=tasks.PythonRewardTask(task=config.task.make(), fn=_spread),
      log=lambda message: None)
  models = session.warm_start()
  initial = jax.device_get(nnx.split(models.policy)[1])
  session.train(models)
  state = jax.device_get(session.state)
  assert sorted({name.split(".")[-1] for name in state.params}) == ["q_proj", "up_proj"]
  assert _same(state.frozen_params, initial)
  assert not _same(state.compute_params(), initial)
  records = read_jsonl(tmp_path / "metrics.jsonl")
  # Step 1's rollout sampled with the merged weights of step 0's update (no lag, also
  # in async): its log-probs are the learner's up to rounding, which they would not be
  # with the base weights or stale adapters.
  assert records[1]["logprob_mismatch_max"] < 1e-4
