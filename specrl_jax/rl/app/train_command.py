"""`specrl train`: warm start, then GRPO (sync or async) with metrics, checkpoints,
resume and plots.

    specrl train [--preset=demo|tiny|dataset] [--section.field=value ...]
    specrl train --model HF_FOLDER --dataset FILE --reward module:function [...]
                 [--coordinator HOST:PORT --num-processes N --process-id I | --distributed]
                 [--init-timeout SECONDS] [--heartbeat-timeout SECONDS]
                 [--shutdown-timeout SECONDS]
    specrl train ... --print-config   the resolved config as JSON, then exit
    specrl train ... --help           this text, then every field with its type, the
                                      default this command line resolves to and its doc

--model / --dataset / --reward (with "=" or a space) are --policy.path, --data.path
and --data.reward; with --model or --dataset the preset is "dataset" (learning rate
1e-6, 100 steps, at most 256 new tokens, history drafts; the run prints its plan first).

e.g. ``specrl train --preset=demo --rl.mode=async --rl.rollout_devices=4
--rl.train_devices=4 --output.directory=runs/async``. Re-running with the same
directory resumes from its latest checkpoint (``--output.resume=false`` starts over).

Multi-process: start the same command once per process (host) with
``--coordinator HOST:PORT --num-processes N --process-id I`` (the address of process
0), or with ``--distributed`` where jax.distributed detects them (Cloud TPU VMs, SLURM,
Open MPI, Kubernetes indexed jobs). The mesh then spans every process's devices, each
process loads only its prompts, all write the checkpoints together (the output
directory must be shared: NFS, gcsfuse, ...), and process 0 alone writes metrics and
plots. See docs/multihost.md.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Sequence
from typing import Any

import jax

from specrl_jax.compile_cache import cache_directory, persistent_cache
from specrl_jax.parallel import distributed
from specrl_jax.parallel.launch import DISTRIBUTED_FLAGS, parse_distributed_argv  # noqa: F401
from specrl_jax.rl.app import command_errors, config_help, run_lock
from specrl_jax.rl.app.experiment import PRESETS, to_dict
from specrl_jax.rl.app.guards import TrainingDivergedError
from specrl_jax.rl.app.session import Models, Session
from specrl_jax.rl.app.train_argv import parse_argv

__all__ = ["Models", "Session", "TrainingDivergedError", "main", "parse_argv"]


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if any(a in ("-h", "--help") for a in argv):
    return print_help([a for a in argv if a not in ("-h", "--help")])
  try:
    if "--print-config" in argv:
      config = parse_argv(parse_distributed_argv([a for a in argv if a != "--print-config"])[1])
      print(json.dumps(to_dict(config), indent=2))
      return 0
    summary = _train(argv)
  except command_errors.USER_ERRORS as error:
    if command_errors.reraise():
      raise
    print(f"specrl train: {command_errors.one_line(error)}", file=sys.stderr)
    return 1
  if summary is not None:
    print(json.dumps(summary, indent=2))
  return 0


def _train(argv: list[str]) -> dict[str, Any] | None:
  """The run of ``argv``: checked, its directory locked, its plan printed, warm start
  and GRPO; the summary (process 0) or None."""
  launch, argv = parse_distributed_argv(argv)
  if launch is not None:
    distributed.initialize(launch)
  config = parse_argv(argv)
  if jax.process_count() > 1:
    distributed.check_same_on_all_processes(json.dumps(to_dict(config), sort_keys=True),
                                            "the run configuration")
  log = print if distributed.is_primary() else (lambda _: None)
  session = Session(config, log=log)
  cache = cache_directory(config.output.compilation_cache, config.output.directory)
  command_errors.check_cache_path(cache)
  session.check()  # what cannot work fails now, not after the warm start
  session.announce()
  # Process 0 holds the lock for all: the others write only checkpoint shards.
  lock = (run_lock.held(config.output.directory, log=log) if distributed.is_primary()
          else contextlib.nullcontext())
  with lock:
    with persistent_cache(cache):
      return session.train(session.warm_start())


def print_help(argv: Sequence[str]) -> int:
  """The usage, then every section and field with the defaults ``argv`` resolves to
  (its preset and overrides; the demo preset's when they do not parse)."""
  print(__doc__)
  print(f"presets: {sorted(PRESETS)}")
  try:
    config, note = parse_argv(parse_distributed_argv(argv)[1]), ""
  except command_errors.USER_ERRORS as error:
    config, note = PRESETS["demo"], f" (the demo preset's: {command_errors.one_line(error)})"
  print(f"\nfields, as --section.field=value, with the defaults of this command line{note}:")
  print(config_help.help_text(config))
  return 0


if __name__ == "__main__":
  sys.exit(main())
