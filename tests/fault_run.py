"""`specrl train` with a SIGKILL at a chosen moment: the process tests/test_faults.py
kills and resumes.

    python tests/fault_run.py FAULT [train arguments...]

FAULT is one of
  none          run to the end
  warm_start    die while the warm start is being written (its first model saved)
  checkpoint:N  die while checkpoint N is being written: its files are complete under
                orbax's temporary name, the rename that commits them not yet done
  step:N        die in training, right after step N's metrics are written (before
                the checkpoint that would follow it)
  saved:N       die right after checkpoint N is complete (before the next step)
"""

import os
import signal
import sys


def _die():
  sys.stdout.flush()
  os.kill(os.getpid(), signal.SIGKILL)


def _install(fault: str) -> None:
  kind, _, where = fault.partition(":")
  if kind == "none":
    return
  if kind == "warm_start":
    from specrl_jax import checkpoint
    save_model = checkpoint.save_model

    def save_then_die(directory, model):
      save_model(directory, model)
      _die()
    checkpoint.save_model = save_then_die
  elif kind == "checkpoint":
    from orbax.checkpoint._src.path import atomicity
    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize_or_die(self, *args, **kwargs):
      final = self.get_final()
      if final.parent.name == "checkpoints" and final.name == where:
        _die()
      return await finalize(self, *args, **kwargs)
    atomicity.AtomicRenameTemporaryPath.finalize = finalize_or_die
  elif kind == "saved":
    from specrl_jax import checkpoint
    save = checkpoint.TrainCheckpointManager.save

    def save_then_die(self, step, *args, **kwargs):
      saved = save(self, step, *args, **kwargs)
      if step == int(where):
        self.wait_until_finished()
        _die()
      return saved
    checkpoint.TrainCheckpointManager.save = save_then_die
  elif kind == "step":
    from specrl_jax.rl.app import metrics
    write = metrics.MetricsWriter.write

    def write_then_die(self, step, values):
      write(self, step, values)
      if step == int(where):
        _die()
    metrics.MetricsWriter.write = write_then_die
  else:
    raise SystemExit(f"unknown fault {fault!r}")


if __name__ == "__main__":
  _install(sys.argv[1])
  from specrl_jax.rl.app import train_command
  sys.exit(train_command.main(sys.argv[2:]))
