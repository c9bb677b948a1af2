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
from typing import Any, NamedTuple

import numpy as np

JSONL = "metrics.jsonl"


def flatten(metrics: Mapping[str, Any]) -> dict[str, float]:
  """Scalars as they are, vectors as name/0, name/1, ... (bools as 0/1)."""
  flat = {}
  for name, value in metrics.items():
    if isinstance(value, (list, tuple)) and all(isinstance(i, (bool, int, float))
                                                for i in value):
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
      for index, sample in enumerate(metrics.get("samples", ())):
        self._tensorboard.add_text(f"samples/{index}", json.dumps(sample, ensure_ascii=False),
                                   step)

  def close(self) -> None:
    self._file.close()
    if self._tensorboard is not None:
      self._tensorboard.close()

  def __enter__(self) -> "MetricsWriter":
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


class Panel(NamedTuple):
  """One PNG: ``axes`` side by side, each (metric names drawn together, y label)."""
  stem: str
  title: str
  axes: tuple[tuple[tuple[str, ...], str], ...]
  steady: bool = False  # leaves out step 0, whose time is mostly compilation
  baseline: tuple[float, str] | None = None  # (value, label): a dashed reference line


PANELS: tuple[Panel, ...] = (
    Panel("reward", "Mean reward per RL step", ((("reward_mean",), "mean reward"),)),
    Panel("response_length", "Mean response length", ((("response_length_mean",), "tokens"),)),
    Panel("acceptance_length", "Speculative acceptance length",
          ((("acceptance_length",), "tokens per target call"),),
          baseline=(1.0, "plain decoding (1 token per call)")),
    # Async runs report generation and training apart; a sync step is one program.
    Panel("time", "Wall-clock time per RL step",
          ((("step_seconds", "rollout_seconds", "train_seconds", "sync_seconds"), "seconds"),),
          steady=True),
    Panel("throughput", "Throughput",
          ((("samples_per_second",), "samples / s"), (("tokens_per_second",), "tokens / s")),
          steady=True),
)


def plot_run(records: Sequence[Mapping[str, Any]], directory: str | os.PathLike,
             panels: Iterable[Panel] = PANELS) -> list[str]:
  """One PNG per panel with any data (plus per-position acceptance); the paths."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.ticker import MaxNLocator

  os.makedirs(directory, exist_ok=True)
  paths = []
  flat = [flatten(r) for r in records]
  panels = list(panels)
  positions = sorted({k for r in flat for k in r if k.startswith(
      "per_position_acceptance/")}, key=lambda k: int(k.split("/")[1]))
  if positions:
    panels.append(Panel("per_position_acceptance", "Acceptance rate by draft depth",
                        ((tuple(positions), "acceptance rate"),)))
  shapes = sorted({k for r in flat for k in r if k.startswith("inloop_shape_by_width/")},
                  key=lambda k: int(k.split("/")[1]))
  if shapes:
    # The in-loop controller's choice at each width of slot compaction (widest first).
    panels.append(Panel("inloop_shape_by_width",
                        "Draft shape run most per width (in-loop controller)",
                        ((tuple(shapes), "shape (0 plain, k chain, K+1.. trees; -1 unused)"),)))
  for panel in panels:
    shown = [(r["step"], f) for r, f in zip(records, flat)
             if not (panel.steady and r["step"] == 0 and len(records) > 1)]
    axes_present = [([n for n in names if any(n in f for _, f in shown)], label)
                    for names, label in panel.axes]
    axes_present = [(names, label) for names, label in axes_present if names]
    if not axes_present:
      continue
    figure, axes_row = plt.subplots(1, len(axes_present), squeeze=False,
                                    figsize=(6 * len(axes_present), 3.8))
    for axes, (names, label) in zip(axes_row[0], axes_present):
      for name in names:
        axes.plot([step for step, _ in shown], [f.get(name, math.nan) for _, f in shown],
                  marker=".", label=name)
      if panel.baseline is not None:
        axes.axhline(panel.baseline[0], color="grey", linestyle="--", label=panel.baseline[1])
      axes.set_xlabel("RL step")
      axes.xaxis.set_major_locator(MaxNLocator(integer=True))
      axes.set_ylabel(label)
      axes.grid(alpha=0.3)
      if len(axes_present) > 1:
        axes.set_title(label, fontsize=9)
      if len(names) > 1 or panel.baseline is not None:
        axes.legend(fontsize=7)
    title = panel.title
    if len(shown) < len(records):
      first = next(f for r, f in zip(records, flat) if r["step"] == 0)
      title += (f"\n(steady state: step 0, {first.get('step_seconds', math.nan):.1f} s "
                "with compilation, not shown)")
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    path = os.path.join(directory, f"{panel.stem}.png")
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
  evaluated = [r for r in records if "eval_pass@1" in r]
  last_eval = ({"eval": {k: v for k, v in evaluated[-1].items() if k.startswith("eval_")}}
               if evaluated else {})
  return {
      **last_eval,
      "steps": len(records),
      "reward_first_quarter": mean(records[:quarter], "reward_mean"),
      "reward_last_quarter": mean(records[-quarter:], "reward_mean"),
      "acceptance_length": mean(records, "acceptance_length"),
      "response_length": mean(records, "response_length_mean"),
      "step_seconds": mean(timed, "step_seconds"),
      "samples_per_second": mean(timed, "samples_per_second"),
      "plots": list(plots),
  }
