"""What `specrl train` and `specrl eval` print when the user's input cannot work: one line
naming the cause and the fix, no traceback (``SPECRL_TRACEBACK=1`` re-raises, for
debugging the library itself).

The errors are those of a bad configuration, dataset, reward, model folder or output
path, and of a run that must stop (diverged, a stale policy, an exhausted page pool,
a lost process). The file system's errors (a read-only or full disk, a path under a
file) arrive as OSError and get the fix their errno calls for.
"""

from __future__ import annotations

import errno
import os

from specrl_jax.config import ConfigError
from specrl_jax.kv.planner import MemoryBudgetError
from specrl_jax.models.hf_files import HFFormatError
from specrl_jax.parallel.distributed import DistributedError
from specrl_jax.rl.app.guards import TrainingDivergedError
from specrl_jax.rl.loop.async_pipeline import StalePolicyError
from specrl_jax.rl.tasks import NoValidPromptsError, RewardFunctionError
from specrl_jax.sampling.results import PagePoolExhaustedError

USER_ERRORS = (ConfigError, HFFormatError, MemoryBudgetError, NoValidPromptsError,
               RewardFunctionError, TrainingDivergedError, StalePolicyError,
               PagePoolExhaustedError, DistributedError, OSError)

_FIXES = {
    errno.ENOSPC: "free space on that disk, or give an --output.directory on another one",
    errno.EDQUOT: "free space within your quota, or give an --output.directory elsewhere",
    errno.EROFS: "the file system is read-only: give a writable --output.directory",
    errno.EACCES: "you may not write there: give a writable --output.directory (or fix "
                  "its permissions)",
    errno.EPERM: "you may not write there: give a writable --output.directory",
    errno.ENOTDIR: "a part of the path is a file, not a folder: give another path",
    errno.EEXIST: "a file is in the way of a folder: give another path",
    errno.ENOENT: "the path does not exist: check it",
}


def one_line(error: BaseException) -> str:
  """``error`` as one line: its type, its message and, for OSError, the fix."""
  if isinstance(error, OSError) and not isinstance(error, ConfigError):
    where = f" {error.filename}" if error.filename else ""
    fix = _FIXES.get(error.errno, "check the path and the disk")
    text = f"{type(error).__name__}: {error.strerror or error}:{where}; {fix}"
  else:
    text = f"{type(error).__name__}: {error}"
  return " ".join(text.split())  # one line, whatever the message held


def reraise() -> bool:
  """Whether to show the traceback instead (``SPECRL_TRACEBACK=1``)."""
  return os.environ.get("SPECRL_TRACEBACK", "") not in ("", "0")


def check_cache_path(directory: str | None) -> None:
  """Refuses a compilation-cache folder that cannot be created: one of its parents is
  a file (found now, not when the first program is compiled)."""
  if directory is None:
    return
  path = os.path.abspath(directory)
  while path and not os.path.exists(path):
    path = os.path.dirname(path)
  if os.path.exists(path) and not os.path.isdir(path):
    raise ConfigError(
        f"OutputSection.compilation_cache: the folder {directory} cannot be created: {path} "
        "is a file; give --output.compilation_cache=FOLDER elsewhere, or =off")
