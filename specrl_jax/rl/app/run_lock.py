"""The lock of a run directory: one `specrl train` at a time writes to it.

    <directory>/run.lock    {"pid": ..., "host": ..., "started": ...} of the holder

Two runs on one directory would interleave their metrics and mix their checkpoints, so
the second is refused, naming the holder. A lock whose holder is gone (a run killed
with SIGKILL cannot remove it) is stale: a run on the same host sees that its process
no longer exists and takes the lock over with a warning. A lock held from another host
cannot be checked from here; the message says how to remove it once that run is dead.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

from specrl_jax.config import ConfigError
from specrl_jax.rl.app.run_directory import read_json

LOCK = "run.lock"


class RunDirectoryLockedError(ConfigError):
  """Another live run holds the run directory."""


def _holder_record() -> dict[str, Any]:
  return {"pid": os.getpid(), "host": socket.gethostname(),
          "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime())}


def _alive(pid: Any) -> bool:
  if not isinstance(pid, int) or pid <= 0:
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # exists, owned by someone else
    return True
  return True


def _describe(record: dict[str, Any] | None) -> str:
  if record is None:
    return "an unreadable lock"
  return (f"pid {record.get('pid')} on host {record.get('host')!r}, started "
          f"{record.get('started')}")


def _publish(path: str, record: dict[str, Any], *, replace: bool) -> bool:
  """Writes ``record`` at ``path`` whole (a temporary file, then a link or rename);
  False if ``path`` exists and ``replace`` is not set."""
  temporary = f"{path}.tmp-{os.getpid()}"
  with open(temporary, "w") as file:
    json.dump(record, file)
    file.flush()
    os.fsync(file.fileno())
  try:
    if replace:
      os.replace(temporary, path)
      return True
    try:
      os.link(temporary, path)  # atomic, and fails if a lock is there
    except FileExistsError:
      return False
    except OSError:  # no hard links on this file system (some network ones)
      return _create_exclusive(path, record)
    return True
  finally:
    with contextlib.suppress(FileNotFoundError):
      os.unlink(temporary)


def _create_exclusive(path: str, record: dict[str, Any]) -> bool:
  try:
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
  except FileExistsError:
    return False
  with os.fdopen(descriptor, "w") as file:
    json.dump(record, file)
  return True


def acquire(directory: str, *, log: Callable[[str], None] = print) -> dict[str, Any]:
  """Takes the lock of ``directory`` (created if needed); its record. Raises
  RunDirectoryLockedError naming the holder if a live run holds it, OSError if the
  directory cannot be written."""
  path = os.path.join(directory, LOCK)
  mine = _holder_record()
  # The file system's errors (read-only, full) go up as they are: the command names the
  # path and the fix.
  os.makedirs(directory, exist_ok=True)
  if _publish(path, mine, replace=False):
    return mine
  holder = read_json(path)
  here = holder is not None and holder.get("host") == mine["host"]
  if holder is None or not here or _alive(holder.get("pid")):
    raise RunDirectoryLockedError(
        f"the run directory {directory} is in use by another `specrl train` "
        f"({_describe(holder)}; lock file {path}): wait for it to end, or give another "
        "--output.directory; if that run is dead (on another host, or the lock "
        "is unreadable), delete the lock file")
  log(f"warning: {path} was left by a run that is gone ({_describe(holder)}): taking "
      "the lock over")
  _publish(path, mine, replace=True)
  if read_json(path) != mine:  # another run took it over at the same moment
    raise RunDirectoryLockedError(
        f"the run directory {directory} was just taken by another `specrl train` "
        f"({_describe(read_json(path))}): give another --output.directory")
  return mine


def release(directory: str, record: dict[str, Any]) -> None:
  """Removes the lock if ``record`` still holds it."""
  path = os.path.join(directory, LOCK)
  if read_json(path) == record:
    with contextlib.suppress(FileNotFoundError):
      os.unlink(path)


@contextlib.contextmanager
def held(directory: str, *, log: Callable[[str], None] = print) -> Iterator[None]:
  """The lock of ``directory`` for the duration of the block."""
  record = acquire(directory, log=log)
  try:
    yield
  finally:
    release(directory, record)


__all__ = ["LOCK", "RunDirectoryLockedError", "acquire", "held", "release"]
