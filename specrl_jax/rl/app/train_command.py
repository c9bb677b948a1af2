"""`specrl train`: warm start, then GRPO (sync or async) with metrics, checkpoints,
resume and plots.

    specrl train [--preset=demo|tiny|dataset] [--section.field=value ...]
    specrl train --model=HF_FOLDER --dataset=FILE --reward=module:function [...]
                 [--coordinator HOST:PORT --num-processes N --process-id I | --distributed]
                 [--init-timeout SECONDS] [--heartbeat-timeout SECONDS]
                 [--shutdown-timeout SECONDS]

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

import json
import sys
from collections.abc import Sequence

import jax

from specrl_jax.compile_cache import cache_directory, persistent_cache
from specrl_jax.config import ConfigError
from specrl_jax.parallel import distributed
from specrl_jax.parallel.distributed import DistributedError
from specrl_jax.parallel.launch import DISTRIBUTED_FLAGS, parse_distributed_argv  # noqa: F401
from specrl_jax.rl.app.experiment import PRESETS, to_dict
from specrl_jax.rl.app.guards import TrainingDivergedError
from specrl_jax.rl.app.session import Models, Session
from specrl_jax.rl.app.train_argv import parse_argv
from specrl_jax.rl.loop.async_pipeline import StalePolicyError
from specrl_jax.rl.tasks import RewardFunctionError
from specrl_jax.sampling.results import PagePoolExhaustedError

__all__ = ["Models", "Session", "TrainingDivergedError", "main", "parse_argv"]


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if any(a in ("-h", "--help") for a in argv):
    print(__doc__)
    print(f"presets: {sorted(PRESETS)}; fields: see specrl_jax/rl/app/experiment.py")
    return 0
  try:
    launch, argv = parse_distributed_argv(argv)
    if launch is not None:
      distributed.initialize(launch)
    config = parse_argv(argv)
    if jax.process_count() > 1:
      distributed.check_same_on_all_processes(json.dumps(to_dict(config), sort_keys=True),
                                              "the run configuration")
    session = Session(config, log=print if distributed.is_primary() else (lambda _: None))
    session.check()  # what cannot work fails now, not after the warm start
    with persistent_cache(cache_directory(config.output.compilation_cache,
                                          config.output.directory)):
      models = session.warm_start()
      summary = session.train(models)
  except (ConfigError, TrainingDivergedError, RewardFunctionError, StalePolicyError,
          PagePoolExhaustedError, DistributedError) as error:
    print(f"specrl train: {type(error).__name__}: {error}", file=sys.stderr)
    return 1
  if summary is not None:
    print(json.dumps(summary, indent=2))
  return 0


if __name__ == "__main__":
  sys.exit(main())
