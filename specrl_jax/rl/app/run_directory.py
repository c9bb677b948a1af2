"""The records of a run directory: which configuration its checkpoints and its cached
warm start were made with, and whether a new configuration may continue them.

    <directory>/config.json           the run's configuration (written once its state
                                      is restored or initialised, never by a run that
                                      fails before that)
    <directory>/warm_start/key.json   the part of the configuration the cached warm
                                      start was made from
    <directory>/checkpoints/<step>/   orbax train states

Every file here is written to a temporary name and renamed, so that a process killed
mid-write leaves the previous version or none, never half of one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from specrl_jax.config import ConfigError
from specrl_jax.rl.app import drafter_registry

CONFIG = "config.json"
WARM_START_KEY = "key.json"

# What a resumed run may change: how long it runs, where it runs (checkpoints restore
# onto any mesh), how the learner trades memory for compute (remat, micro-batches:
# the same update either way), what it writes and how often it evaluates. Anything else
# would continue one experiment's state under another's settings.
RESUMABLE = ("rl.steps", "rl.mesh", "rl.rollout_devices", "rl.train_devices",
             "learner.remat", "learner.num_micro_batches", "output.",
             "data.eval_every", "data.eval_k", "data.eval_max_prompts",
             "data.allow_changed_dataset")


# Fields a newer config replaced by another of the same section, with the replacement's
# value for each recorded one: a record written before the change then resumes (or is
# refused) by what it meant, instead of by a field the config no longer has.
RETIRED = {
    "learner.loss.normalize_std": ("advantage", {True: "group-normalized",
                                                 False: "group-centered"}),
}


def upgrade_record(record: Mapping[str, Any]) -> dict[str, Any]:
  """``record`` (a config as a dict) with its RETIRED fields replaced."""
  record = json.loads(json.dumps(record))  # a deep copy, as JSON data
  for path, (replacement, values) in RETIRED.items():
    *sections, name = path.split(".")
    section = record
    for part in sections:
      section = section.get(part) if isinstance(section, dict) else None
    if isinstance(section, dict) and name in section:
      value = section.pop(name)
      section.setdefault(replacement, values.get(value, value))
  return record


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """Nested dicts as {"section.field": value}; lists (from JSON) as tuples."""
  flat = {}
  for name, value in tree.items():
    if isinstance(value, Mapping):
      flat.update(flatten(value, f"{prefix}{name}."))
    else:
      flat[f"{prefix}{name}"] = tuple(value) if isinstance(value, list) else value
  return flat


def differences(old: Mapping[str, Any], new: Mapping[str, Any],
                ignore: tuple[str, ...] = (), defaults: Mapping[str, Any] | None = None
                ) -> list[str]:
  """"field: old -> new" for every field that differs (and is not under ``ignore``);
  a field ``old`` lacks (recorded before it existed) reads as its value in ``defaults``."""
  recorded, new = flatten(old), flatten(new)
  # A default of None for an optional section (learner.lora) is not a field the record
  # lacks when the record holds that section's fields (learner.lora.rank), nor the
  # other way round.
  filled = {name: value for name, value in flatten(defaults or {}).items()
            if not _overlaps(name, recorded)}
  old = {**filled, **recorded}
  lines = []
  for name in sorted(set(old) | set(new)):
    if any(name == i or (i.endswith(".") and name.startswith(i)) for i in ignore):
      continue
    if old.get(name, "<absent>") != new.get(name, "<absent>"):
      lines.append(f"{name}: {old.get(name, '<absent>')!r} -> {new.get(name, '<absent>')!r}")
  return lines


def _overlaps(name: str, flat: Mapping[str, Any]) -> bool:
  """Whether ``flat`` holds ``name``, a field inside it, or a section holding it."""
  return name in flat or any(other.startswith(f"{name}.") or name.startswith(f"{other}.")
                             for other in flat)


def write_json(path: str, record: Mapping[str, Any]) -> None:
  """Writes ``record`` to ``path`` atomically (a temporary file, then a rename)."""
  temporary = f"{path}.tmp-{os.getpid()}"
  with open(temporary, "w") as file:
    json.dump(record, file, indent=2)
    file.flush()
    os.fsync(file.fileno())
  os.replace(temporary, path)


def read_json(path: str) -> dict[str, Any] | None:
  """The record at ``path``; None if there is none or it cannot be read as one."""
  try:
    with open(path) as file:
      record = json.load(file)
  except (OSError, ValueError):
    return None
  return record if isinstance(record, dict) else None


def check_resumable(directory: str, checkpoint_steps: list[int],
                    config: Mapping[str, Any], defaults: Mapping[str, Any] | None = None
                    ) -> None:
  """Raises ConfigError, touching nothing, if ``config`` may not continue the
  checkpoints of the run in ``directory`` (``checkpoint_steps``: those present);
  ``defaults``: the values of fields newer than the recorded config."""
  if not checkpoint_steps:
    return
  recorded = read_json(os.path.join(directory, CONFIG))
  if recorded is None:
    return  # an older run without a record: restoring checks the state's shapes
  changed = differences(upgrade_record(recorded), config, ignore=RESUMABLE,
                        defaults=defaults)
  if changed:
    raise ConfigError(
        f"the run in {directory} has checkpoints (steps {checkpoint_steps}) made with "
        f"{os.path.join(directory, CONFIG)}; this configuration differs in "
        f"{'; '.join(changed)}. A resumed run may change only {', '.join(RESUMABLE)}: give "
        "the recorded values, another --output.directory, or --output.resume=false to "
        "start over (which deletes the checkpoints).")


def warm_start_key(config: Mapping[str, Any]) -> dict[str, Any]:
  """The part of an experiment config (as a dict) that determines its warm start."""
  key = {"policy": config["policy"], "task": config["task"],
         "warm_start": config["warm_start"]}
  if config.get("data", {}).get("path"):  # SFT reads the dataset's solutions
    key["data"] = {name: value for name, value in config["data"].items()
                   if name != "allow_changed_dataset"}  # how a resume may go on, not data
  drafter = drafter_registry.warm_start_key(dict(config["drafter"]))
  if drafter is not None:  # what the warm start trains of the drafter (the registry says)
    key["drafter"] = drafter
  return key


def warm_start_mismatch(folder: str, key: Mapping[str, Any]) -> str | None:
  """Why the warm start cached in ``folder`` does not fit ``key`` (None if it does)."""
  recorded = read_json(os.path.join(folder, WARM_START_KEY))
  if recorded is None:
    return f"{folder} has no readable {WARM_START_KEY} (the config it was made with)"
  changed = differences(recorded, key)
  if changed:
    return f"{folder} was made with another config: {'; '.join(changed)}"
  return None
