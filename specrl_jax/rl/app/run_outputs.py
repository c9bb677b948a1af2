"""What one ``Session.train`` call writes besides the train state: checkpoints, and on
process 0 the metrics (JSONL, TensorBoard), the progress bar and the closing summary."""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

from specrl_jax import checkpoint
from specrl_jax.rl.app.experiment import ExperimentConfig
from specrl_jax.rl.app.metrics import MetricsWriter, plot_run, read_jsonl, summarize


@dataclasses.dataclass
class RunOutputs:
  """What one ``Session.train`` call writes besides the state, closed when it ends:
  checkpoints, and on process 0 the metrics and the progress bar."""
  manager: checkpoint.TrainCheckpointManager
  writer: MetricsWriter | None = None
  progress: Any = None  # a tqdm bar

  def advance(self, metrics: dict[str, Any]) -> None:
    if self.progress is not None:
      self.progress.update(1)
      self.progress.set_postfix(reward=f"{metrics['reward_mean']:.3f}",
                                accept=f"{metrics['acceptance_length']:.2f}")

  def close(self) -> None:
    if self.progress is not None:
      self.progress.close()
    if self.writer is not None:
      self.writer.close()
    self.manager.close()


def open_run_outputs(config: ExperimentConfig, manager: checkpoint.TrainCheckpointManager,
                     start: int, *, primary: bool) -> RunOutputs:
  """Metrics and the progress bar, on process 0 only; the run starts at step ``start``."""
  if not primary:
    return RunOutputs(manager=manager)
  output = config.output
  writer = MetricsWriter(output.directory, tensorboard=output.tensorboard, start_step=start)
  progress = None
  if output.progress:
    from tqdm import tqdm
    progress = tqdm(total=config.rl.steps, initial=start, desc="GRPO", unit="step",
                    dynamic_ncols=True, file=sys.stderr)
    # It moves when a step ends; the first of a session also traces and compiles.
    progress.set_postfix_str(f"step {start}: compiling the RL step")
  return RunOutputs(manager=manager, writer=writer, progress=progress)


def run_summary(config: ExperimentConfig, writer: MetricsWriter | None) -> dict[str, Any] | None:
  """The run's summary and plots, from metrics.jsonl (process 0; None elsewhere)."""
  if writer is None:
    return None
  records = read_jsonl(writer.path)
  plots = (plot_run(records, os.path.join(config.output.directory, "plots"))
           if config.output.plots else [])
  return summarize(records, plots)
