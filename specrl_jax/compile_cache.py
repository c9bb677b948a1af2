"""JAX's persistent compilation cache for `specrl train` and the demo.

Compiling the RL step, the rollouts and the warm start's programs takes most of a short
run's first minutes; with the cache on, a second process with the same configuration
loads them from disk instead. The cache is a folder of serialized executables keyed
by the program, its shardings, the backend and the JAX version, so a stale entry is
never used, only not found.

JAX treats the folder as trusted (its entries are executed): keep it where only you
write. A cache the user already configured wins over ours: ``jax.config``'s, or
``JAX_COMPILATION_CACHE_DIR`` when set at all (empty: no cache; the test suite sets it
so, so that no test writes or shares a cache it did not ask for).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import jax
from jax.experimental.compilation_cache import compilation_cache

# Cache every program that took at least this long to compile: the RL step's pieces
# compile in seconds, but the many small programs around them add up on a cold start.
MIN_COMPILE_SECONDS = 0.2
OFF = ("off", "none", "")
AUTO = "auto"
FOLDER = "jax_compilation_cache"


def cache_directory(setting: str, output_directory: str) -> str | None:
  """The folder ``setting`` names: "auto" is ``<parent of output_directory>/
  jax_compilation_cache`` (shared by the runs beside it), "off" none, else the path."""
  if setting.strip().lower() in OFF:
    return None
  if setting == AUTO:
    parent = os.path.dirname(os.path.abspath(output_directory))
    return os.path.join(parent, FOLDER)
  return os.path.abspath(setting)


@contextlib.contextmanager
def persistent_cache(directory: str | None) -> Iterator[str | None]:
  """Within the block, compiled programs are saved to and loaded from ``directory``
  (None: left as it is). Yields the folder in use; restores the previous settings on
  exit, so a caller in a long-lived process (a test, a notebook) does not keep ours."""
  configured = jax.config.jax_compilation_cache_dir
  if directory is None or configured or "JAX_COMPILATION_CACHE_DIR" in os.environ:
    yield configured or None
    return
  os.makedirs(directory, exist_ok=True)
  previous_time = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
  compilation_cache.set_cache_dir(directory)
  compilation_cache.reset_cache()  # a cache opened before (without a folder) is dropped
  try:
    yield directory
  finally:
    compilation_cache.set_cache_dir(configured)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", previous_time)
    compilation_cache.reset_cache()


class CompileCounter:
  """Counts the programs built while it is open: compiled by XLA (JAX's backend-compile
  events) or loaded from the persistent cache (its hit events). A program found in jit's
  in-memory cache raises neither; one that is traced and built again does, whether or
  not an earlier process left it in the cache.

      with CompileCounter() as compiled:
        ...
      compiled.count, compiled.seconds, compiled.loaded, compiled.built
  """

  EVENT = "/jax/core/compile/backend_compile_duration"
  HIT_EVENT = "/jax/compilation_cache/cache_hits"

  def __init__(self):
    self.count, self.seconds, self.loaded = 0, 0.0, 0

  @property
  def built(self) -> int:
    """Programs compiled or loaded from the persistent cache."""
    return self.count + self.loaded

  def _on_duration(self, name: str, seconds: float, **kwargs) -> None:
    if name == self.EVENT:
      self.count += 1
      self.seconds += seconds

  def _on_event(self, name: str, **kwargs) -> None:
    if name == self.HIT_EVENT:
      self.loaded += 1

  def __enter__(self) -> "CompileCounter":
    jax.monitoring.register_event_duration_secs_listener(self._on_duration)
    jax.monitoring.register_event_listener(self._on_event)
    return self

  def __exit__(self, *exc_info) -> None:
    jax.monitoring.unregister_event_duration_listener(self._on_duration)
    jax.monitoring.unregister_event_listener(self._on_event)
