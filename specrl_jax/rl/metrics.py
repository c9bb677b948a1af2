"""Run metrics: one JSON line per step, TensorBoard scalars, PNG plots at the end.

metrics.jsonl is the record of a run (plots and tests read it); on resume the lines
of steps that will be recomputed are dropped first, so a resumed run's file reads
exactly like an uninterrupted one's.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

JSONL = "metrics.jsonl"


def flatten(metrics: Mapping[str, Any]) -> dict[str, float]:
  """Scalars as they are, vectors as name/0, name/1, ... (bools as 0/1)."""
  flat = {}
  for name, value in metrics.items():
    if isinstance(value, (list, tuple)):
      for index, item in enumerate(value):
        flat[f"{name}/{index}"] = float(item)
    elif isinstance(value, (bool, int, float)):
      flat[name] = float(value)
  return flat


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
  if not os.path.exists(path):
    return []
  with open(path) as file:
    return [json.loads(line) for line in file if line.strip()]


class MetricsWriter:
  """Appends step records to ``directory``/metrics.jsonl and TensorBoard events."""

  def __init__(self, directory: str | os.PathLike, *, tensorboard: bool = True,
               start_step: int = 0):
    os.makedirs(directory, exist_ok=True)
    self.path = os.path.join(directory, JSONL)
    kept = [r for r in read_jsonl(self.path) if r.get("step", -1) < start_step]
    with open(self.path, "w") as file:
      file.writelines(json.dumps(r) + "\n" for r in kept)
    self._file = open(self.path, "a")
    self._tensorboard = None
    if tensorboard:
      from tensorboardX import SummaryWriter
      self._tensorboard = SummaryWriter(os.path.join(directory, "tensorboard"),
                                        purge_step=start_step)

  def write(self, step: int, metrics: Mapping[str, Any]) -> None:
    record = {"step": int(step), **metrics}
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    if self._tensorboard is not None:
      for name, value in flatten(metrics).items():
        if math.isfinite(value):
          self._tensorboard.add_scalar(name, value, step)

  def close(self) -> None:
    self._file.close()
    if self._tensorboard is not None:
      self._tensorboard.close()

  def __enter__(self) -> "MetricsWriter":
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


# The default plot panels: (file stem, metric names drawn together, y label).
PANELS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("reward", ("reward_mean",), "mean reward"),
    ("response_length", ("response_length_mean",), "tokens"),
    ("acceptance_length", ("acceptance_length",), "tokens per target call"),
    ("time", ("step_seconds", "rollout_seconds", "train_seconds", "sync_seconds"), "seconds"),
    ("throughput", ("tokens_per_second", "samples_per_second"), "per second"),
)


def plot_run(records: Sequence[Mapping[str, Any]], directory: str | os.PathLike,
             panels: Iterable[tuple[str, tuple[str, ...], str]] = PANELS) -> list[str]:
  """One PNG per panel with any data (plus per-position acceptance); the paths."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  os.makedirs(directory, exist_ok=True)
  paths = []
  steps = [r["step"] for r in records]
  panels = list(panels)
  positions = sorted({k for r in records for k in flatten(r) if k.startswith(
      "per_position_acceptance/")}, key=lambda k: int(k.split("/")[1]))
  if positions:
    panels.append(("per_position_acceptance", tuple(positions), "acceptance rate"))
  for stem, names, label in panels:
    present = [n for n in names if any(n in flatten(r) for r in records)]
    if not present:
      continue
    figure, axes = plt.subplots(figsize=(6, 3.5))
    for name in present:
      values = [flatten(r).get(name, math.nan) for r in records]
      axes.plot(steps, values, marker=".", label=name)
    axes.set_xlabel("RL step")
    axes.set_ylabel(label)
    axes.grid(alpha=0.3)
    if len(present) > 1:
      axes.legend(fontsize=7)
    figure.tight_layout()
    path = os.path.join(directory, f"{stem}.png")
    figure.savefig(path, dpi=100)
    plt.close(figure)
    paths.append(path)
  return paths


def with_rates(metrics: dict[str, Any], samples_per_step: int) -> dict[str, Any]:
  """``metrics`` with samples and generated tokens per second of the step."""
  seconds = metrics["step_seconds"]
  return dict(metrics, samples_per_second=samples_per_step / seconds,
              tokens_per_second=metrics["generated_tokens"] / seconds)


def summarize(records: list[dict[str, Any]], plots: Sequence[str]) -> dict[str, Any]:
  """First/last reward (means over the first and last quarter of steps) and more."""
  if not records:
    return {"steps": 0, "plots": list(plots)}
  quarter = max(1, len(records) // 4)
  mean = lambda rs, key: float(np.mean([r[key] for r in rs]))
  timed = records[1:] or records  # the first step includes compilation
  return {
      "steps": len(records),
      "reward_first_quarter": mean(records[:quarter], "reward_mean"),
      "reward_last_quarter": mean(records[-quarter:], "reward_mean"),
      "acceptance_length": mean(records, "acceptance_length"),
      "response_length": mean(records, "response_length_mean"),
      "step_seconds": mean(timed, "step_seconds"),
      "samples_per_second": mean(timed, "samples_per_second"),
      "plots": list(plots),
  }
