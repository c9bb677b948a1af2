"""`specrl train`: configs overridable from the command line, metrics / TensorBoard /
plots / checkpoints written, a killed run resumed to the same metrics as an
uninterrupted one, and clear errors that keep the last good checkpoint."""

import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys

import pytest

from specrl_jax.config import ConfigError
from specrl_jax.rl.app import experiment, train_command
from specrl_jax.rl import tasks
from specrl_jax.rl.app.metrics import read_jsonl

# Eight steps of a tiny policy with an online-trained draft model, checkpoints every 2.
ARGS = ["--preset=tiny", "--rl.steps=8", "--output.checkpoint_every=2",
        "--output.tensorboard=true", "--output.plots=true", "--output.progress=false"]
# Timing fields differ between runs; everything else must match exactly.
TIMING = ("step_seconds", "samples_per_second", "tokens_per_second")


def _env(cache):
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1",
             JAX_COMPILATION_CACHE_DIR=str(cache),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  return env


def _train(directory, cache, *extra):
  command = [sys.executable, "-m", "specrl_jax.rl.app.train_command", *ARGS,
             f"--output.directory={directory}", *extra]
  return subprocess.Popen(command, env=_env(cache), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)


def _without_timing(records):
  return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("train")
  cache = root / "jax_cache"
  whole = _train(root / "whole", cache)
  output, _ = whole.communicate(timeout=600)
  assert whole.returncode == 0, output

  # Same seed and warm start, killed right after its step-4 checkpoint, then resumed.
  shutil.copytree(root / "whole" / "warm_start", root / "killed" / "warm_start")
  killed = _train(root / "killed", cache)
  lines = []
  for line in killed.stdout:
    lines.append(line)
    if "checkpoint saved step=4" in line:
      killed.send_signal(signal.SIGKILL)
      break
  killed.wait(timeout=600)
  assert killed.returncode == -signal.SIGKILL, "".join(lines)
  steps_before_kill = len(read_jsonl(root / "killed" / "metrics.jsonl"))
  resumed = _train(root / "killed", cache)
  resumed_output, _ = resumed.communicate(timeout=600)
  assert resumed.returncode == 0, resumed_output
  return dict(root=root, whole_output=output, resumed_output=resumed_output,
              steps_before_kill=steps_before_kill)


def test_a_killed_run_resumes_to_the_metrics_of_an_uninterrupted_one(runs):
  whole = read_jsonl(runs["root"] / "whole" / "metrics.jsonl")
  resumed = read_jsonl(runs["root"] / "killed" / "metrics.jsonl")
  assert 4 <= runs["steps_before_kill"] < 8  # really killed mid-run
  assert "resumed from checkpoint step 4" in runs["resumed_output"]
  assert [r["step"] for r in resumed] == list(range(8))
  assert _without_timing(resumed) == _without_timing(whole)
  assert all(r["acceptance_length"] > 1 for r in whole)  # speculative rollouts throughout


def test_a_run_writes_metrics_tensorboard_checkpoints_and_plots(runs):
  directory = runs["root"] / "whole"
  records = read_jsonl(directory / "metrics.jsonl")
  for field in ("reward_mean", "response_length_mean", "acceptance_length",
                "per_position_acceptance", "step_seconds", "tokens_per_second", "loss",
                "drafter/loss"):
    assert field in records[0], field
  assert any(name.startswith("events.out.tfevents")
             for name in os.listdir(directory / "tensorboard"))
  assert sorted(os.listdir(directory / "checkpoints")) == ["4", "6", "8"]  # keeps 3
  for plot in ("reward", "acceptance_length", "per_position_acceptance", "time"):
    assert (directory / "plots" / f"{plot}.png").stat().st_size > 0
  summary = json.loads(runs["whole_output"][runs["whole_output"].index("{"):])
  assert summary["steps"] == 8 and summary["acceptance_length"] > 1


def test_a_run_prints_its_plan_before_it_starts(runs):
  output = runs["whole_output"]
  plan = output.index("this run:")
  assert plan < output.index("checkpoint saved")
  for subject in ("policy:", "data:", "reward:", "drafter:", "sampling:", "steps:",
                  "learning:", "mesh:", "output:"):
    assert output.index(subject, plan) < output.index("checkpoint saved"), subject
  assert "8 GRPO steps (sync) of 4 prompts x 4 samples" in output


def test_overrides_reach_the_config_with_their_types():
  config = train_command.parse_argv(["--preset=tiny", "--rl.group_size=8", "--rl.mesh=2,2,1",
                                     "--drafter.online=false", "--learner.learning_rate=3e-4"])
  assert config.rl.group_size == 8 and config.rl.mesh == (2, 2, 1)
  assert config.drafter.online is False and config.learner.learning_rate == 3e-4
  with pytest.raises(ConfigError, match="--rl.steps='ten' is invalid"):
    train_command.parse_argv(["--rl.steps=ten"])
  with pytest.raises(ConfigError, match="RLSection has"):
    train_command.parse_argv(["--rl.stepz=3"])
  with pytest.raises(ConfigError, match="RLSection.mode='fast'"):
    train_command.parse_argv(["--rl.mode=fast"])


def test_a_task_with_no_valid_prompts_is_a_clear_error():
  class Unprintable(tasks.Arithmetic):
    def sample(self, rng):
      return dataclasses.replace(super().sample(rng), prompt="what is 2 + 2 ?<")

  with pytest.raises(tasks.NoValidPromptsError, match="no valid prompts"):
    train_command.Session(experiment.PRESETS["tiny"], task=Unprintable(min_digits=1, max_digits=1))


class _Scripted:
  """A host reward that is correct, then NaN, then raises, as the test says."""

  def __init__(self):
    self.mode = "ok"

  def __call__(self, response, targets):
    if self.mode == "nan":
      return math.nan
    if self.mode == "raise":
      raise ZeroDivisionError("checker bug")
    return tasks.arithmetic_answer_checker(response, targets)


def test_bad_rewards_stop_the_run_with_a_clear_error_and_keep_the_last_good_checkpoint(tmp_path):
  config = train_command.parse_argv([
      "--preset=tiny", "--drafter.kind=none", "--rl.steps=4", "--output.checkpoint_every=1",
      "--output.progress=false", "--output.tensorboard=false",
      f"--output.directory={tmp_path}", "--warm_start.sft_steps=0"])
  reward = _Scripted()
  session = train_command.Session(
      config, task=tasks.PythonRewardTask(task=config.task.make(), fn=reward),
      log=lambda message: None)
  models = session.warm_start()
  session.train(models)  # 4 good steps, checkpoints 1..4 (the newest 3 kept)
  good = dataclasses.replace(config, rl=dataclasses.replace(config.rl, steps=6))
  session.config = good

  reward.mode = "nan"  # a reward function's NaN is refused as its value, naming the sample
  with pytest.raises(tasks.RewardFunctionError,
                     match=r"step 4: .*returned (float )?nan, not a finite real number"):
    session.train(models)
  reward.mode = "raise"
  with pytest.raises(tasks.RewardFunctionError,
                     match=r"step 4: .*raised ZeroDivisionError: checker bug.*step 4"):
    session.train(models)
  assert sorted(int(s) for s in os.listdir(tmp_path / "checkpoints")) == [2, 3, 4]
  # The good checkpoint still resumes.
  reward.mode = "ok"
  summary = session.train(models)
  assert summary["steps"] == 6


def test_a_non_finite_loss_names_the_step_and_the_kept_checkpoint(tmp_path):
  session = train_command.Session(dataclasses.replace(
      experiment.PRESETS["tiny"], output=experiment.OutputSection(directory=str(tmp_path))))
  metrics = {"rewards_finite": True, "reward_mean": 0.5, "loss": float("nan"),
             "grad_norm": 1.0, "pool_exhausted": False}
  with pytest.raises(train_command.TrainingDivergedError,
                     match=r"step 7: non-finite loss=nan; the update was not kept or checkpointed "
                           r"and the last good checkpoint \(step 6\) is kept"):
    session._check(7, metrics, 6)


def test_non_finite_rewards_of_a_jitted_task_reward_name_the_step_and_the_kept_checkpoint(tmp_path):
  session = train_command.Session(dataclasses.replace(
      experiment.PRESETS["tiny"], output=experiment.OutputSection(directory=str(tmp_path))))
  metrics = {"rewards_finite": False, "reward_mean": float("nan"), "loss": 0.5,
             "grad_norm": 1.0, "pool_exhausted": False}
  with pytest.raises(train_command.TrainingDivergedError,
                     match=r"step 4: the task's rewards are NaN.*last good checkpoint \(step 4\)"):
    session._check(4, metrics, 4)
