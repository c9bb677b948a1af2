"""Simulator output: a stage breakdown table, JSON, and k x acceptance heatmaps."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import numpy as np

from specrl_jax.config import check, check_positive_int
from specrl_jax.sim import validation
from specrl_jax.sim.step import Comparison, SimulationSetup, simulate_step

_STAGES = (("data", "data"), ("prepare", "prepare"), ("weight sync", "weight_sync"),
           ("generation", "generation"), ("  exposed", "exposed_generation"),
           ("log-prob", "logprob"), ("training", "training"),
           ("drafter training", "drafter_training"), ("total", "total"))


def breakdown_table(comparison: Comparison, paper: dict | None = None) -> str:
  """Seconds per stage, plain vs speculative, with the paper's figures alongside."""
  spec = comparison.speculative
  header = f"{'stage':<18}{'plain':>10}"
  if spec is not None:
    header += f"{'spec':>10}{'speedup':>9}"
  if paper is not None and "plain" in paper:
    header += f"{'paper plain':>13}{'paper spec':>12}"
  lines = [f"# {comparison.setup_name}", header, "-" * len(header)]
  for label, field in _STAGES:
    plain_s = getattr(comparison.plain, field)
    row = f"{label:<18}{plain_s:>10.2f}"
    if spec is not None:
      spec_s = getattr(spec, field)
      ratio = f"{plain_s / spec_s:>8.2f}x" if spec_s > 0 else f"{'-':>9}"
      row += f"{spec_s:>10.2f}{ratio}"
    if paper is not None and "plain" in paper:
      for column, width in (("plain", 13), ("speculative", 12)):
        value = paper[column].get(field)
        row += f"{value:>{width}.1f}" if value is not None else f"{'-':>{width}}"
    lines.append(row)
  if spec is not None:
    lines.append(f"generation speedup {comparison.generation_speedup:.2f}x, "
                 f"end-to-end {comparison.step_speedup:.2f}x, "
                 f"{spec.rollout.tokens_per_round:.2f} tokens per target forward")
    if paper is not None:
      lines.append(f"paper: generation {paper['generation_speedup']:.2f}x, "
                   f"end-to-end {paper['step_speedup']:.2f}x")
  return "\n".join(lines)


def comparison_json(comparison: Comparison, setup: SimulationSetup | None = None,
                    paper: dict | None = None) -> dict:
  out = comparison.to_json()
  if setup is not None:
    out["assumptions"] = _setup_json(setup)
  if paper is not None:
    out["paper"] = paper
  return out


def _setup_json(setup: SimulationSetup) -> dict:
  def plain(value):
    if dataclasses.is_dataclass(value):
      return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
      return [plain(x) for x in value]
    return value
  return plain(setup)


@dataclasses.dataclass(frozen=True)
class SpeedupGrid:
  """Speedups over plain decoding for draft lengths x i.i.d. acceptance rates."""

  draft_lengths: tuple[int, ...]
  acceptance_rates: tuple[float, ...]
  generation: np.ndarray  # [len(draft_lengths), len(acceptance_rates)]
  step: np.ndarray


def speedup_grid(setup: SimulationSetup, draft_lengths: Sequence[int],
                 acceptance_rates: Sequence[float]) -> SpeedupGrid:
  check(setup.speculation is not None, "speedup_grid", "setup.speculation", None,
        "a SpeculationSpec whose drafter the grid varies k and acceptance for")
  check(len(draft_lengths) > 0 and len(acceptance_rates) > 0, "speedup_grid",
        "draft_lengths", (tuple(draft_lengths), tuple(acceptance_rates)),
        "non-empty draft lengths and acceptance rates")
  for k in draft_lengths:
    check_positive_int("speedup_grid", "draft_lengths[]", k)
  for rate in acceptance_rates:
    validation.unit_interval("speedup_grid", "acceptance_rates[]", rate)
  plain = simulate_step(setup, None)
  generation = np.zeros((len(draft_lengths), len(acceptance_rates)))
  step = np.zeros_like(generation)
  for i, k in enumerate(draft_lengths):
    for j, rate in enumerate(acceptance_rates):
      spec = dataclasses.replace(setup.speculation, num_draft_tokens=int(k), tree=None,
                                 acceptance=(float(rate),))
      result = simulate_step(setup, spec)
      generation[i, j] = plain.generation / result.generation
      step[i, j] = plain.total / result.total
  return SpeedupGrid(tuple(int(k) for k in draft_lengths),
                     tuple(float(a) for a in acceptance_rates), generation, step)


def write_heatmap(grid: SpeedupGrid, path: str | Path, *, title: str = "") -> Path:
  """Two panels, generation and end-to-end speedup; below 1 means speculation loses."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from matplotlib.colors import TwoSlopeNorm

  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), constrained_layout=True)
  for ax, values, label in ((axes[0], grid.generation, "generation speedup"),
                            (axes[1], grid.step, "end-to-end speedup")):
    high = max(float(values.max()), 1.01)
    low = min(float(values.min()), 0.99)
    image = ax.imshow(values, origin="lower", aspect="auto", cmap="RdBu",
                      norm=TwoSlopeNorm(vmin=low, vcenter=1.0, vmax=high))
    ax.set_xticks(range(len(grid.acceptance_rates)),
                  [f"{a:.2f}" for a in grid.acceptance_rates], rotation=45)
    ax.set_yticks(range(len(grid.draft_lengths)), [str(k) for k in grid.draft_lengths])
    ax.set_xlabel("per-position acceptance rate")
    ax.set_ylabel("draft length k")
    ax.set_title(label)
    for i in range(values.shape[0]):
      for j in range(values.shape[1]):
        ax.text(j, i, f"{values[i, j]:.2f}", ha="center", va="center", fontsize=7)
    fig.colorbar(image, ax=ax)
  if title:
    fig.suptitle(title)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
