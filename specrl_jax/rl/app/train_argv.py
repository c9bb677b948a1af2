"""The command line of `specrl train`: a preset, ``--section.field=value`` overrides,
and short flags for one's own model, dataset and reward."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from specrl_jax.rl.app.experiment import ExperimentConfig, experiment_config

# Short flags for the fields a run on one's own model and data always sets.
ALIASES = {"--model": "--policy.path", "--dataset": "--data.path", "--reward": "--data.reward"}


def parse_argv(argv: Sequence[str]) -> ExperimentConfig:
  """The run's config: ``--preset`` (default "demo", or "dataset" with --model or
  --dataset), then the overrides in order."""
  preset, overrides = None, []
  for arg in argv:
    name, _, value = arg.partition("=")
    if name == "--preset":
      preset = value
    else:
      overrides.append(f"{ALIASES[name]}={value}" if name in ALIASES else arg)
  if preset is None:
    own = any(arg.partition("=")[0] in ("--model", "--dataset") for arg in argv)
    preset = "dataset" if own else "demo"
  config = experiment_config(preset, overrides)
  if preset != "demo" or any(a.startswith("--output.directory=") for a in overrides):
    return config
  return dataclasses.replace(config, output=dataclasses.replace(config.output,
                                                                directory="runs/train"))
