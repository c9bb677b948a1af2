"""The command line of `specrl train`: a preset, ``--section.field=value`` overrides,
and short flags for one's own model, dataset and reward."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from specrl_jax.config import ConfigError
from specrl_jax.rl.app.experiment import ExperimentConfig, experiment_config

# Short flags for the fields a run on one's own model and data always sets.
ALIASES = {"--model": "--policy.path", "--dataset": "--data.path", "--reward": "--data.reward"}
# Flags that take a value, as "--flag=VALUE" or "--flag VALUE".
VALUED = ("--preset", *ALIASES)


def joined(argv: Sequence[str]) -> list[str]:
  """``argv`` with "--model PATH" (a space) joined into "--model=PATH"; a valued flag
  without its value (last, or followed by another flag) is refused, naming it."""
  out, args = [], list(argv)
  while args:
    arg = args.pop(0)
    if arg in VALUED:
      if not args or args[0].startswith("--"):
        raise ConfigError(f"{arg} needs a value: {arg} VALUE or {arg}=VALUE "
                          f"(got {'nothing' if not args else repr(args[0])} after it).")
      arg = f"{arg}={args.pop(0)}"
    out.append(arg)
  return out


def parse_argv(argv: Sequence[str]) -> ExperimentConfig:
  """The run's config: ``--preset`` (default "demo", or "dataset" with --model or
  --dataset), then the overrides in order."""
  preset, overrides = None, []
  argv = joined(argv)
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
