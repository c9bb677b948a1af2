"""Shared helpers for benchmarks: timing, bandwidth measurement, cached artifacts."""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np

ARTIFACTS = Path(os.environ.get("SPECRL_ARTIFACTS", Path(__file__).resolve().parent.parent / "artifacts"))


def best_of(run: Callable[[], object], repeats: int) -> float:
  """Minimum wall time of ``repeats`` calls: the least-disturbed run on a shared machine."""
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    run()
    times.append(time.perf_counter() - start)
  return min(times)


def interleaved(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
  """Best-of-``repeats`` seconds per entry, alternating entries so that drifting machine
  load hits every contender alike (ratios stay meaningful on a noisy machine)."""
  times: dict[str, list[float]] = {name: [] for name in runs}
  for _ in range(repeats):
    for name, run in runs.items():
      start = time.perf_counter()
      run()
      times[name].append(time.perf_counter() - start)
  return {name: min(values) for name, values in times.items()}


def median(values):
  return statistics.median(values)


def read_bandwidth_bytes_per_second(size_bytes: int = 512 * 2**20, repeats: int = 5) -> float:
  """Sustained memory read bandwidth: a full reduction over a buffer far beyond cache."""
  buffer = np.ones(size_bytes // 8, np.float64)
  seconds = best_of(lambda: float(buffer.sum()), repeats)
  return size_bytes / seconds


def print_json(payload) -> None:
  print(json.dumps(payload, indent=2, sort_keys=False))
