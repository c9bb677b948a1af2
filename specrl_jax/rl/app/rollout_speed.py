"""Plain vs speculative rollout speed of one RL batch, measured so that a loaded machine
cannot fake the answer: the two arms alternate (plain, speculative, then speculative,
plain, ...) on the same prompts, weights and seeds, and the figure is the median of the
per-repeat ratios with their spread, never a best-of.

    arms = RolloutArms(session, models)          # compiles both rollouts once
    before = arms.measure(params, drafter_params, repeats=9)
    ... RL ...
    after = arms.measure(trained_params, trained_drafter_params, repeats=9)

Both measurements reuse the same compiled programs: the weights must keep the layout
they had (the train mesh's, ``Session.initial_state``), so nothing compiles after RL.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from typing import Any

import jax
from flax import nnx

from specrl_jax.rl.app.session import Models, Session
from specrl_jax.rl.loop.rollout import make_rollout
from specrl_jax.rl.loop.sync import prompts_on_mesh
from specrl_jax.speculative.rollout import acceptance_length

ARMS = ("plain", "speculative")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeedCheck:
  """One interleaved measurement: seconds per rollout batch of each arm, repeat by
  repeat (``plain_seconds[i]`` and ``speculative_seconds[i]`` ran back to back)."""
  plain_seconds: tuple[float, ...]
  speculative_seconds: tuple[float, ...]
  acceptance_length: float
  target_calls_plain: int
  target_calls_speculative: int

  @property
  def speedups(self) -> tuple[float, ...]:
    """Plain over speculative seconds, per repeat (pairs share the machine's load)."""
    return tuple(p / s for p, s in zip(self.plain_seconds, self.speculative_seconds))

  @property
  def speedup(self) -> float:
    return statistics.median(self.speedups)

  def quartiles(self) -> tuple[float, float]:
    first, _, third = statistics.quantiles(self.speedups, n=4, method="inclusive")
    return first, third

  def as_dict(self) -> dict[str, Any]:
    low, high = self.quartiles()
    return {"speedup_median": self.speedup, "speedup_quartiles": [low, high],
            "speedup_min": min(self.speedups), "speedup_max": max(self.speedups),
            "speedups": list(self.speedups), "repeats": len(self.speedups),
            "plain_seconds_median": statistics.median(self.plain_seconds),
            "speculative_seconds_median": statistics.median(self.speculative_seconds),
            "plain_seconds": list(self.plain_seconds),
            "speculative_seconds": list(self.speculative_seconds),
            "acceptance_length": self.acceptance_length,
            "target_calls_plain": self.target_calls_plain,
            "target_calls_speculative": self.target_calls_speculative}

  def line(self, label: str) -> str:
    low, high = self.quartiles()
    return (f"{label}: speculative rollouts {self.speedup:.2f}x plain decoding (median of "
            f"{len(self.speedups)} interleaved repeats; quartiles {low:.2f}-{high:.2f}x, "
            f"range {min(self.speedups):.2f}-{max(self.speedups):.2f}x); "
            f"{statistics.median(self.plain_seconds):.3f}s plain vs "
            f"{statistics.median(self.speculative_seconds):.3f}s speculative per batch; "
            f"acceptance length {self.acceptance_length:.2f} tokens per target call "
            f"({self.target_calls_plain} -> {self.target_calls_speculative} target forwards)")


class RolloutArms:
  """The plain and the speculative rollout of RL step 0's prompts, compiled once on the
  train mesh and timed as often as asked."""

  def __init__(self, session: Session, models: Models):
    drafter, _ = session.drafter_for(models)
    if drafter is None:
      raise ValueError("RolloutArms needs a drafter: DrafterSection.kind='none' has no "
                       "speculative arm to compare.")
    train_mesh, _ = session.meshes()
    self.session = session
    self.prompts = prompts_on_mesh(session.step_prompts(0), train_mesh)
    graphdef = nnx.split(models.policy)[0]
    build = lambda **kwargs: jax.jit(make_rollout(
        graphdef, models.policy.config, session.task, session.rollout_config, train_mesh,
        prompt_width=session.prompt_width, engine=session.engine, **kwargs))
    self.rollouts = {"plain": build(),
                     "speculative": build(drafter=drafter, spec=session.spec)}

  def run(self, arm: str, params, drafter_params, seed: int):
    draft = drafter_params if arm == "speculative" else ()
    return jax.block_until_ready(
        self.rollouts[arm](params, draft, self.prompts, jax.random.key(seed), 0))

  def measure(self, params, drafter_params, *, repeats: int, label: str = "speed check"
              ) -> SpeedCheck:
    """Each arm once untimed (compiles on the first call), then ``repeats`` pairs in
    alternating order; seed i is the same for both arms of pair i."""
    from tqdm import tqdm
    bar = tqdm(total=2 * (1 + repeats), desc=label, unit="run", dynamic_ncols=True,
               file=sys.stderr, disable=not self.session.config.output.progress)
    for arm in ARMS:
      bar.set_postfix_str(f"{arm} rollout (compiles the first time)")
      self.run(arm, params, drafter_params, seed=0)
      bar.update(1)
    bar.set_postfix_str("plain and speculative in turn")
    seconds = {arm: [] for arm in ARMS}
    outputs = {}
    for repeat in range(repeats):
      for arm in (ARMS if repeat % 2 == 0 else ARMS[::-1]):
        start = time.perf_counter()
        outputs[arm] = self.run(arm, params, drafter_params, seed=repeat + 1)
        seconds[arm].append(time.perf_counter() - start)
        bar.update(1)
    bar.close()
    counters = {arm: jax.device_get(out.counters) for arm, out in outputs.items()}
    spec = counters["speculative"]
    return SpeedCheck(
        plain_seconds=tuple(seconds["plain"]), speculative_seconds=tuple(seconds["speculative"]),
        acceptance_length=float(acceptance_length(spec["accepted_per_position"],
                                                  spec["draft_rounds"])),
        target_calls_plain=int(counters["plain"]["target_calls"]),
        target_calls_speculative=int(spec["target_calls"]))


def plot_speed_checks(checks: dict[str, SpeedCheck], path: str) -> str:
  """Left: seconds per rollout batch, every repeat a dot, the median a bar; right: the
  per-repeat speed-up with its median, against plain decoding's 1x."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
  labels = list(checks)
  for offset, (arm, colour) in enumerate((("plain", "tab:grey"), ("speculative", "tab:blue"))):
    for i, check in enumerate(checks.values()):
      values = getattr(check, f"{arm}_seconds")
      x = i + 0.38 * offset
      left.bar(x, statistics.median(values), width=0.36, color=colour, alpha=0.6,
               label=f"{arm} decoding (median)" if i == 0 else None)
      left.scatter([x] * len(values), values, color="black", s=8, zorder=3)
  left.set_xticks([i + 0.19 for i in range(len(labels))], labels)
  left.set_ylabel("seconds per rollout batch")
  left.set_title("Rollout time of one RL batch (dots: repeats)", fontsize=10)
  left.legend(fontsize=8)
  for i, check in enumerate(checks.values()):
    right.scatter([i] * len(check.speedups), check.speedups, color="tab:blue", s=12)
    low, high = check.quartiles()
    right.errorbar([i], [check.speedup], yerr=[[check.speedup - low], [high - check.speedup]],
                   fmt="_", color="black", markersize=24, capsize=6)
    right.annotate(f"{check.speedup:.2f}x", (i, check.speedup), xytext=(10, 0),
                   textcoords="offset points", fontsize=9)
  right.axhline(1.0, color="tab:grey", linestyle="--", label="plain decoding")
  right.set_xticks(range(len(labels)), labels)
  right.set_xlim(-0.5, len(labels) - 0.5)
  right.set_ylabel("speed-up (plain / speculative seconds)")
  right.set_title("Speed-up per repeat; median and quartiles", fontsize=10)
  right.legend(fontsize=8)
  for axes in (left, right):
    axes.grid(alpha=0.3, axis="y")
  repeats = len(next(iter(checks.values())).speedups)
  figure.suptitle(f"Plain vs speculative rollouts, same prompts, weights and seeds, "
                  f"{repeats} interleaved repeats", fontsize=9)
  figure.tight_layout()
  figure.savefig(path, dpi=100)
  plt.close(figure)
  return path
