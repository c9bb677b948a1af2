"""The command-line flags that make a command join a multi-process JAX job:
``--coordinator HOST:PORT --num-processes N --process-id I`` or ``--distributed``,
plus the timeouts, as a ``DistributedConfig``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specrl_jax.config import ConfigError
from specrl_jax.parallel.distributed import DistributedConfig


# --flag VALUE / --flag=VALUE options of the multi-process launch -> DistributedConfig
# fields (integers, except the coordinator's HOST:PORT).
DISTRIBUTED_FLAGS = {
    "--coordinator": "coordinator",
    "--num-processes": "num_processes",
    "--process-id": "process_id",
    "--init-timeout": "initialization_timeout",
    "--heartbeat-timeout": "heartbeat_timeout",
    "--shutdown-timeout": "shutdown_timeout",
}


def parse_distributed_argv(argv: Sequence[str]) -> tuple[DistributedConfig | None, list[str]]:
  """Splits the launch flags off ``argv``: (how to join a multi-process job, or None
  for a single process; the remaining arguments)."""
  fields: dict[str, Any] = {}
  auto, rest = False, []
  args = list(argv)
  while args:
    arg = args.pop(0)
    flag, has_value, value = arg.partition("=")
    if flag == "--distributed" and not has_value:
      auto = True
      continue
    if flag not in DISTRIBUTED_FLAGS:
      rest.append(arg)
      continue
    if not has_value:
      if not args:
        raise ConfigError(f"{flag} needs a value.")
      value = args.pop(0)
    name = DISTRIBUTED_FLAGS[flag]
    if name != "coordinator":
      try:
        value = int(value)
      except ValueError:
        raise ConfigError(f"{flag}={value!r} is invalid: expected an integer.") from None
    fields[name] = value
  launch = {"coordinator", "num_processes", "process_id"} & set(fields)
  if not auto and not launch:
    if fields:
      raise ConfigError(f"{sorted(fields)} only apply to a multi-process run: add "
                        "--coordinator/--num-processes/--process-id or --distributed.")
    return None, rest
  if auto and launch:
    raise ConfigError("--distributed detects the coordinator, process count and id from the "
                      "environment: give either it or --coordinator/--num-processes/"
                      "--process-id, not both.")
  return DistributedConfig(**fields), rest
