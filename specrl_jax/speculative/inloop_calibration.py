"""Round seconds per (shape, width) for the in-loop controller, measured, never assumed.

``calibrate`` runs a rollout of each menu shape alone (``InLoopState.force``) through
the in-loop round hook on the device the run uses, one compiled program per width
(slot compaction's stages, each timed from dispatch to read-back, compiling and a
first untimed pass excluded), and divides each width's seconds by its rounds; a
narrower width's cost is capped by the wider one's. A width a shape's rollout
never reached (its sequences ended together) takes the nearest measured width's
seconds of that shape. ``fixed_seconds`` is what the same rollouts spent outside the
rounds (prefill, dispatch, read-back).

``refresh`` folds a later rollout's own timing in: its seconds beyond the fixed part,
against what the table predicts for the rounds it ran, rescale the cells it ran, each
by its share of the prediction, so a table that was off for the shapes the controller
settled on is corrected by the steps themselves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specrl_jax.config import SamplingParams, SpecConfig, check
from specrl_jax.models.transformer import Transformer
from specrl_jax.sampling.compaction import stage_widths
from specrl_jax.sampling.engine import EngineConfig
from specrl_jax.sampling.plan import plan_for_prompts
from specrl_jax.sampling.results import GenerateOutput
from specrl_jax.speculative.drafters.base import Drafter
from specrl_jax.speculative.inloop import InLoopConfig, InLoopState
from specrl_jax.speculative.inloop_rollout import generate_in_loop, in_loop_config
from specrl_jax.speculative.rollout import rounds_of, speculation


# Timed passes per shape, the median kept. One pass let a single slow rollout set a cell:
# on the 38M pair it put k = 4 at 1.36x k = 2's round cost where the rollouts ran 1.21x,
# and the controller settled on k = 2, 0.89x the best fixed chain; with three passes
# three calibrations in two runs chose k = 4 (0.976-0.989x the best fixed chain), as did
# 4 of 5 one-pass calibrations (docs/results.md, "In-loop adaptive"). The two extra
# passes cost 25 s there on a fast CPU, 100 s on a slow one, once per run.
REPEATS = 3


@dataclasses.dataclass(frozen=True)
class Calibration:
  """cost_SxW: median seconds per round of each shape at each width; fixed_seconds:
  median seconds of a rollout outside its rounds; widths: the stage widths timed."""
  cost_SxW: np.ndarray
  fixed_seconds: float
  widths: tuple[int, ...]


def calibrate(model: Transformer, prompts: Sequence[Sequence[int]], *,
              sampling: SamplingParams, drafter: Drafter, spec: SpecConfig,
              engine: EngineConfig, rng: jax.Array, repeats: int = REPEATS) -> Calibration:
  """Times each shape of ``spec``'s in-loop menu on ``prompts`` through
  ``generate_in_loop`` (one device) ``repeats`` times."""
  config = in_loop_config(spec)
  widths = engine_widths(model, prompts, sampling, engine, drafter, spec)

  def run(controller: InLoopState, key: jax.Array) -> GenerateOutput:
    return generate_in_loop(model, prompts, sampling=sampling, rng=key, drafter=drafter,
                            spec=spec, controller=controller, engine=engine)[0]

  return time_shapes(run, config, widths, rng=rng, repeats=repeats)


def time_shapes(run: Callable[[InLoopState, jax.Array], GenerateOutput], config: InLoopConfig,
                widths: tuple[int, ...], *, rng: jax.Array, repeats: int = REPEATS
                ) -> Calibration:
  """``run(controller, rng)``: a rollout through the in-loop hook, its stages timed
  (``sampling.rollout.generate_whole``); it is run once per shape and repeat with the
  controller forced to that shape."""
  check(isinstance(repeats, int) and repeats >= 1, "calibrate", "repeats", repeats,
        "an integer >= 1")
  shapes = len(config.shapes)
  # A forced rollout never reads the table: only its shape matters.
  base = InLoopState.initial(config, np.ones((shapes, len(widths))))
  samples: list[list[np.ndarray]] = [[] for _ in range(shapes)]
  fixed: list[float] = []
  # One untimed pass first: a stage program's first run pays one-time costs that the
  # narrow stages' few rounds cannot amortise (38M pair, width 2: 166 ms for 6 rounds on
  # the first pass, 13-15 ms a round after; docs/results.md, "In-loop adaptive").
  for repeat in range(-1, repeats):
    for shape in range(shapes):
      out = run(base.replace(force=jnp.int32(shape)),
                jax.random.fold_in(rng, (repeat + 1) * shapes + shape))
      if repeat < 0:
        continue
      seconds_W, rounds_W = _per_width(out, len(widths))
      with np.errstate(invalid="ignore", divide="ignore"):
        samples[shape].append(np.where(rounds_W > 0, seconds_W / np.maximum(rounds_W, 1),
                                       np.nan))
      fixed.append(max(out.stats["seconds"] - float(seconds_W.sum()), 0.0))
  cost_SxW = np.stack([_fill(_median(rows), config.labels[s]) for s, rows in enumerate(samples)])
  # A round over fewer rows does no more work than over more: the narrow stages, timed
  # over a handful of rounds, are capped by the wider width's measurement.
  cost_SxW = np.minimum.accumulate(cost_SxW, axis=1)
  return Calibration(cost_SxW=cost_SxW.astype(np.float32), fixed_seconds=float(np.median(fixed)),
                     widths=tuple(widths))


def _median(rows: list[np.ndarray]) -> np.ndarray:
  stacked = np.stack(rows)
  out = np.full(stacked.shape[1], np.nan)
  for w in range(stacked.shape[1]):
    finite = stacked[:, w][np.isfinite(stacked[:, w])]
    if finite.size:
      out[w] = np.median(finite)
  return out


def _per_width(out: GenerateOutput, num_widths: int) -> tuple[np.ndarray, np.ndarray]:
  """(seconds, rounds) per width of a timed rollout."""
  if "compaction" in out.stats:
    stats = out.stats["compaction"]
    check(len(stats["widths"]) == num_widths, "calibrate", "widths", stats["widths"],
          f"{num_widths} widths, as the controller's table has")
    return (np.asarray(stats["seconds_by_width"], np.float64),
            np.asarray(stats["rounds_by_width"], np.float64))
  # One width: the rollout's time is its rounds' plus the prefill, which one program
  # does not separate (fixed seconds 0).
  return (np.asarray([out.stats["seconds"]]), np.asarray([float(out.stats["target_calls"])]))


def engine_widths(model: Transformer, prompts: Sequence[Sequence[int]],
                  sampling: SamplingParams, engine: EngineConfig, drafter: Drafter,
                  spec: SpecConfig) -> tuple[int, ...]:
  """The stage widths ``generate_in_loop`` decodes ``prompts`` in (the memory plan
  counts the drafter's layers)."""
  rounds = rounds_of(*speculation(model.config, sampling, drafter, spec))
  plan = plan_for_prompts(model.config, [list(p) for p in prompts], sampling=sampling,
                          engine=engine, rounds=rounds, mesh=None)[0]
  layout = plan.layout
  return stage_widths(layout.num_slots, layout.compaction_min_width)


def _fill(seconds_W: np.ndarray, label: str) -> np.ndarray:
  """Unmeasured widths take the nearest measured width's seconds (ties: the wider)."""
  measured = np.flatnonzero(np.isfinite(seconds_W))
  if measured.size == 0:
    raise RuntimeError(f"calibration measured no round of {label}: its rollouts ran no "
                       "round (are the prompts' responses empty?)")
  out = seconds_W.copy()
  for w in np.flatnonzero(~np.isfinite(seconds_W)):
    out[w] = seconds_W[measured[np.argmin(np.abs(measured - w))]]
  return out


def refresh(cost_SxW: np.ndarray, fixed_seconds: float, rounds_SxW: np.ndarray,
            seconds: float, weight: float = 0.5) -> np.ndarray:
  """The table after a rollout that ran ``rounds_SxW`` rounds in ``seconds``: the ratio
  of its round seconds (beyond ``fixed_seconds``) to the table's prediction rescales
  each cell it ran by that ratio to the power ``weight`` times the cell's share of the
  prediction. Cells it did not run keep their calibration."""
  cost_SxW = np.asarray(cost_SxW, np.float64)
  rounds_SxW = np.asarray(rounds_SxW, np.float64)
  predicted_SxW = rounds_SxW * cost_SxW
  predicted = predicted_SxW.sum()
  measured = seconds - fixed_seconds
  if predicted <= 0 or measured <= 0 or not np.isfinite(measured):
    return cost_SxW.astype(np.float32)
  share_SxW = predicted_SxW / predicted
  return (cost_SxW * (measured / predicted) ** (weight * share_SxW)).astype(np.float32)
