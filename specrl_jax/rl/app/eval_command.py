"""`specrl eval`: pass@1..k and the mean reward of a policy on held-out prompts,
printed as JSON.

    specrl eval --checkpoint=RUN_DIR [--dataset=FILE] [--k=8] [--temperature=1.0]
                [--seed=0] [--max_prompts=0] [--reward=...] [--data.field=value ...]
    specrl eval --checkpoint=HF_FOLDER --dataset=FILE --reward=... [--k=8] [...]

RUN_DIR is a `specrl train` output directory: its config.json says which model,
dataset, reward and held-out split the run used, and the policy is its latest
checkpoint. The held-out split is evaluated (the run's eval_path or eval_fraction);
a run without one, or --split=all, evaluates every row of the dataset. A Hugging Face
folder is evaluated as it is, on every row of --dataset.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx

from specrl_jax import checkpoint
from specrl_jax.config import ConfigError
from specrl_jax.rl.app import command_errors, run_directory
from specrl_jax.rl.loop.evaluation import evaluate
from specrl_jax.rl.tasks.python_reward import take_failures
from specrl_jax.rl.app.experiment import PRESETS, apply_overrides, from_dict

# Options of the command itself; anything else is a --section.field override.
OPTIONS = {"--checkpoint": str, "--k": int, "--temperature": float, "--seed": int,
           "--max_prompts": int, "--split": str}
ALIASES = {"--dataset": "--data.path", "--reward": "--data.reward", "--model": "--policy.path"}


def _parse(argv: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
  options: dict[str, Any] = {"--k": 8, "--temperature": 1.0, "--seed": 0, "--max_prompts": 0,
                             "--split": "eval"}
  overrides = []
  for arg in argv:
    name, equals, value = arg.partition("=")
    if name in OPTIONS:
      if not equals:
        raise ConfigError(f"{name} needs a value: {name}=...")
      try:
        options[name] = OPTIONS[name](value)
      except ValueError:
        raise ConfigError(f"{arg} is invalid: expected a {OPTIONS[name].__name__}") from None
    else:
      overrides.append(f"{ALIASES[name]}={value}" if name in ALIASES else arg)
  if "--checkpoint" not in options:
    raise ConfigError("--checkpoint=PATH is required: a `specrl train` run directory or a "
                      "Hugging Face model folder")
  if options["--split"] not in ("eval", "all"):
    raise ConfigError(f"--split={options['--split']!r} is invalid: expected eval or all")
  return options, overrides


def _policy_and_task(path: str, overrides: list[str], split: str):
  """(policy model, task to evaluate, checkpoint step or None, correct threshold)."""
  from specrl_jax.rl.app.train_command import Session  # the RL stack, only when needed
  if not os.path.exists(path):
    raise ConfigError(f"--checkpoint={path} does not exist: give a `specrl train` run "
                      "directory or a Hugging Face model folder")
  record = run_directory.read_json(os.path.join(path, run_directory.CONFIG))
  is_run = record is not None and "rl" in record
  if is_run:
    config = apply_overrides(from_dict(record), overrides)
  else:
    config = apply_overrides(PRESETS["dataset"], [f"--policy.path={path}", *overrides])
  if not config.data.path:
    raise ConfigError("no dataset: give --dataset=FILE (the run trained on a built-in task)")
  config = dataclasses.replace(config, output=dataclasses.replace(
      config.output, directory=path if is_run else config.output.directory, resume=True))
  session = Session(config, log=lambda message: None)
  task = session.eval_task if split == "eval" and session.eval_task is not None else session.task
  if not is_run:
    return session.warm_start().policy, task, None, config.data.correct_threshold
  models = session.warm_start()
  _, online = session.drafter_for(models)
  train_mesh, _ = session.meshes()
  manager = checkpoint.TrainCheckpointManager(session.checkpoint_directory, max_to_keep=None,
                                              async_save=False)
  try:
    if not manager.all_steps():
      raise ConfigError(f"{session.checkpoint_directory} holds no checkpoint to evaluate")
    state, _ = session.restore_or_init(manager, models, online, train_mesh)
  finally:
    manager.close()
  graphdef = nnx.split(models.policy)[0]
  step = int(jax.device_get(state.step))
  model = nnx.merge(graphdef, jax.device_get(state.compute_params()))  # LoRA: merged
  return model, task, step, config.data.correct_threshold


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if any(a in ("-h", "--help") for a in argv):
    print(__doc__)
    return 0
  try:
    options, overrides = _parse(argv)
    model, task, step, threshold = _policy_and_task(options["--checkpoint"], overrides,
                                                    options["--split"])
    result = evaluate(model, task, k=options["--k"], temperature=options["--temperature"],
                      seed=options["--seed"], threshold=threshold,
                      max_prompts=options["--max_prompts"])
  except command_errors.USER_ERRORS as error:
    if command_errors.reraise():
      raise
    print(f"specrl eval: {command_errors.one_line(error)}", file=sys.stderr)
    return 1
  for line in take_failures():  # samples scored 0: their reward worker timed out or died
    print(f"specrl eval: warning: {line}", file=sys.stderr)
  print(json.dumps({"checkpoint": options["--checkpoint"], "step": step, "k": options["--k"],
                    **result}, indent=2))
  return 0


if __name__ == "__main__":
  sys.exit(main())
