"""Shared helpers for benchmarks: timing, bandwidth measurement, cached artifacts."""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np

# The demo preset's first sizes (a 1.2M policy, a 64 x 1 draft model at k = 3, 8 slots),
# which bench_rl's --policy tiny, reward_curves and bench_demo_round_cost keep so that
# their recorded figures stay reproducible after the demo grew (docs/results.md, "Demo
# round cost"). Overrides on top of the demo preset.
SMALL_DEMO_POLICY = [
    "--policy.hidden_size=192", "--policy.intermediate_size=512", "--policy.num_layers=3",
    "--policy.num_heads=6", "--policy.head_dim=32"]
SMALL_DEMO_DRAFTER = [
    "--drafter.model.hidden_size=64", "--drafter.model.intermediate_size=128",
    "--drafter.model.num_heads=2", "--drafter.num_draft_tokens=3"]
SMALL_DEMO = SMALL_DEMO_POLICY + SMALL_DEMO_DRAFTER + [
    "--warm_start.sft_steps=150", "--warm_start.sft_learning_rate=5e-3",
    "--warm_start.distill_steps=100", "--rl.engine.num_slots=8"]
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
  timed = paired_samples({name: (lambda _, run=run: run()) for name, run in runs.items()},
                         repeats)
  return {name: min(seconds for seconds, _ in results) for name, results in timed.items()}


def paired_samples(runs: dict[str, Callable[[int], object]], samples: int
                   ) -> dict[str, list[tuple[float, object]]]:
  """(seconds, result) of ``run(sample)`` for every entry and sample 0..samples-1, the
  entries interleaved within each sample. Give each sample its own rollout seed: one
  batch's time hangs on its slowest sequence, so a single seed is one draw of luck
  that best-of-N timings of the same seed cannot average out."""
  results: dict[str, list[tuple[float, object]]] = {name: [] for name in runs}
  for sample in range(samples):
    for name, run in runs.items():
      start = time.perf_counter()
      out = run(sample)
      results[name].append((time.perf_counter() - start, out))
  return results


class CompileCounter:
  """Counts the programs JAX compiles in this process and the seconds spent tracing,
  lowering and compiling them (its compile events), so that a benchmark can warm up
  until nothing new compiles and take what still compiled while timed out of its
  times."""

  STAGES = ("/jax/core/compile/jaxpr_trace_duration",
            "/jax/core/compile/jaxpr_to_mlir_module_duration",
            "/jax/core/compile/backend_compile_duration")

  def __init__(self):
    import jax
    self.count, self.seconds = 0, 0.0

    def on_duration(name, seconds, **kwargs):
      if name in self.STAGES:
        self.seconds += seconds
        self.count += name == self.STAGES[-1]

    jax.monitoring.register_event_duration_secs_listener(on_duration)


def median(values):
  return statistics.median(values)


def read_bandwidth_bytes_per_second(size_bytes: int = 512 * 2**20, repeats: int = 5) -> float:
  """Sustained memory read bandwidth: a full reduction over a buffer far beyond cache."""
  buffer = np.ones(size_bytes // 8, np.float64)
  seconds = best_of(lambda: float(buffer.sum()), repeats)
  return size_bytes / seconds


def dense_forward_seconds(model, batch: int, query_tokens: int, repeats: int,
                          steps: int = 8) -> float:
  """One forward of ``model`` over [batch, query_tokens] tokens, no cache: the bare
  cost of a plain step (1 token) or a verification (k + 1), best of N. Timed as
  ``steps`` forwards chained in one compiled loop (each reads the previous one's argmax,
  so none can be hoisted), as the engine runs its rounds: no per-call dispatch."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  graphdef, params = nnx.split(model)

  def chained(params, tokens):
    step = lambda _, tokens: jnp.argmax(
        nnx.merge(graphdef, params).forward(tokens).logits, axis=-1).astype(jnp.int32)
    return jax.lax.fori_loop(0, steps, step, tokens)

  forward = jax.jit(chained)
  tokens = jnp.ones((batch, query_tokens), jnp.int32)
  run = lambda: jax.block_until_ready(forward(params, tokens))
  run()
  return best_of(run, repeats) / steps


def pyplot():
  """matplotlib.pyplot on the file-only backend (benchmarks write PNGs, headless)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def plot_against_k(series, ks) -> tuple:
  """The two panels every k study draws: acceptance length and speed vs plain decoding
  against the draft length. series: (label, line style, color or None, ks, acceptance
  lengths, speedups) per curve; ks: the x ticks. Returns (figure, axes)."""
  plt = pyplot()
  figure, axes = plt.subplots(1, 2, figsize=(12, 4.2))
  for label, style, color, xs, acceptance, speedup in series:
    colored = {} if color is None else {"color": color}
    axes[0].plot(xs, acceptance, style, label=label, **colored)
    axes[1].plot(xs, speedup, style, label=label, **colored)
  axes[0].set(xlabel="k (draft tokens per round)", ylabel="tokens per target forward",
              title="acceptance length")
  axes[1].axhline(1.0, color="black", lw=0.8, ls="--")
  axes[1].set(xlabel="k (draft tokens per round)", ylabel="tokens/s relative to plain",
              title="speed vs plain decoding (CPU)")
  for axis in axes:
    axis.set_xticks(sorted(ks))
    axis.grid(alpha=0.3)
  return figure, axes


def print_json(payload) -> None:
  print(json.dumps(payload, indent=2, sort_keys=False))
