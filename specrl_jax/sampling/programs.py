"""Bounded compiled programs for ``generate``: shape buckets and an LRU of executables.

Every distinct (static config, input shapes) pair is one XLA program, and ``jax.jit``
keeps every program it ever compiled. Calls with many prompt counts, request counts and
prompt lengths would each compile their own and keep it for good (40 mixed calls: 27
programs, resident memory 474 -> 1,002 MiB). Here shapes are rounded up to a few bucket
sizes, so nearby calls share a program, and at most ``max_programs`` executables are
kept, least recently used first out. Each is compiled ahead of time from its own
function object, so that evicting it drops JAX's traces and lowerings of it too.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

# Bucket sizes: powers of two and 1.5x powers of two, so padding adds at most half.
BUCKETS = tuple(sorted({b for k in range(24) for b in (2 ** k, 3 * 2 ** k // 2) if b > 0}))
DEFAULT_MAX_PROGRAMS = 16
# Each XLA:CPU executable holds about a thousand memory maps of its code (a tiny model's
# decode program: ~1,150), and the kernel kills a process past vm.max_map_count (65,530
# by default) by failing its next allocation. So past this share of the limit the caches
# evict beyond max_programs.
MAP_LIMIT_SHARE = 0.5


def memory_maps() -> tuple[int, int]:
  """(memory maps this process holds, the kernel's vm.max_map_count); (0, 0) where
  there is no such limit to read (not Linux)."""
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      limit = int(f.read())
    with open("/proc/self/maps", "rb") as f:
      return sum(1 for _ in f), limit
  except (OSError, ValueError):
    return 0, 0


def _memory_maps_over_limit() -> bool:
  held, limit = memory_maps()
  return held > MAP_LIMIT_SHARE * limit if limit else False


def bucket(size: int) -> int:
  """The smallest bucket size >= ``size``."""
  index = bisect.bisect_left(BUCKETS, size)
  return BUCKETS[index] if index < len(BUCKETS) else size


def bucket_inputs(inputs: tuple, layout, engine) -> tuple[tuple, Any]:
  """(tokens_UxT, lengths_U, prompt_of_request_R, last_request_U) and the layout padded
  to bucket sizes when ``engine.bucket_shapes``, changing nothing a request decodes:

  - requests: padding rows of prompt_of_request_R are -1, never admitted
    (``engine.count_requests``); their output rows are cut off by ``trim``;
  - slots (when automatic): extra slots stay empty; every random draw is indexed by slot
    first, and with partitionable threefry a slot's draws do not depend on the count;
  - distinct prompts (only with an automatic pool, as they take pages): one-token dummy
    prompts no request reads (last_request -1: their pages are never freed, and are
    counted in the pool);
  - pages (when automatic): more free pages than needed.
  """
  if not engine.bucket_shapes:
    return inputs, layout
  # A memory budget fixed the pool and the slots it holds: rounding either up would
  # overrun it.
  budgeted = engine.memory_fraction is not None or engine.memory_budget_bytes is not None
  automatic_slots = engine.num_slots == 0 and not budgeted
  automatic_pages = engine.num_pages == 0 and not budgeted
  tokens_UxT, lengths_U, prompt_of_request_R, last_request_U = (np.asarray(a) for a in inputs)
  num_requests, num_prompts = len(prompt_of_request_R), len(lengths_U)
  extra_requests = bucket(num_requests) - num_requests
  prompt_of_request_R = np.pad(prompt_of_request_R, (0, extra_requests), constant_values=-1)
  extra_prompts = bucket(num_prompts) - num_prompts if automatic_pages else 0
  tokens_UxT = np.pad(tokens_UxT, ((0, extra_prompts), (0, 0)))
  lengths_U = np.pad(lengths_U, (0, extra_prompts), constant_values=1)
  last_request_U = np.pad(last_request_U, (0, extra_prompts), constant_values=-1)
  num_slots = layout.num_slots
  if automatic_slots:
    num_slots = min(bucket(layout.num_slots), 256)  # the automatic count's own cap
  # A one-token dummy prompt takes one page.
  enough = (layout.pages_always_enough + extra_prompts
            + (num_slots - layout.num_slots) * layout.max_pages_per_seq)
  layout = dataclasses.replace(
      layout, num_slots=num_slots, pages_always_enough=enough,
      num_pages=bucket(enough) if automatic_pages else layout.num_pages)
  padded = tuple(jnp.asarray(a, jnp.int32)
                 for a in (tokens_UxT, lengths_U, prompt_of_request_R, last_request_U))
  return padded, layout


def trim(output, num_requests: int):
  """A GenerateOutput of padded requests cut to the first ``num_requests``, with the
  program cache's figures in ``stats["program_cache"]``."""
  # Padding requests are never live, so rounds_by_live ends at num_requests live slots.
  stats = dict(output.stats, request_rounds=output.stats["request_rounds"][:num_requests],
               program_cache=PROGRAMS.info())
  if "rounds_by_live" in stats:
    stats["rounds_by_live"] = stats["rounds_by_live"][:num_requests + 1]
  return dataclasses.replace(output, tokens=output.tokens[:num_requests],
                             lengths=output.lengths[:num_requests],
                             logprobs=output.logprobs[:num_requests], stats=stats)


def _signature(tree) -> tuple:
  """What a compiled executable is specialised to: tree structure, shapes, dtypes and
  placements of its arguments."""
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple((jax.typeof(x), getattr(x, "sharding", None)) for x in leaves)


class ProgramCache:
  """At most ``max_programs`` compiled executables, least recently used evicted first."""

  def __init__(self, max_programs: int = DEFAULT_MAX_PROGRAMS):
    self._programs: collections.OrderedDict = collections.OrderedDict()
    self._lock = threading.Lock()
    self.max_programs = max_programs
    self.compiles = self.hits = self.evictions = 0

  def resize(self, max_programs: int) -> None:
    if isinstance(max_programs, bool) or not isinstance(max_programs, int) or max_programs < 1:
      raise ValueError(f"max_programs={max_programs!r} is invalid: expected a positive "
                       "integer.")
    with self._lock:
      self.max_programs = max_programs
      self._evict()

  def _evict(self) -> None:
    while len(self._programs) > self.max_programs:
      self._programs.popitem(last=False)
      self.evictions += 1
    # Another holder may own the maps, so the newest program always stays.
    while len(self._programs) > 1 and _memory_maps_over_limit():
      self._programs.popitem(last=False)
      self.evictions += 1

  def call(self, function: Callable, leading: tuple, static: dict[str, Any], *args):
    """``function(*leading, *args, **static)`` through a compiled executable kept here.
    ``leading`` and ``static`` are static and must be hashable (they are part of the
    key, as jit's static arguments are); ``args`` are array pytrees."""
    return self.compiled(function, leading, static, *args)(*args)

  def compiled(self, function: Callable, leading: tuple, static: dict[str, Any], *args,
               donate: tuple[int, ...] = ()):
    """The executable ``call`` runs, compiled now if it is not kept (``donate``: the
    positions in ``args`` whose buffers it may reuse, e.g. a decode state's pages)."""
    key = (function, leading, tuple(sorted(static.items())), donate, _signature(args))
    with self._lock:
      executable = self._programs.get(key)
      if executable is not None:
        self._programs.move_to_end(key)
        self.hits += 1
    if executable is None:
      # A fresh function object per program: JAX's trace and lowering caches are keyed
      # weakly on it, so they let go of this program when the cache evicts it.
      def program(*program_args):
        return function(*leading, *program_args, **static)
      executable = jax.jit(program, donate_argnums=donate).lower(*args).compile()
      with self._lock:
        self._programs[key] = executable
        self.compiles += 1
        self._evict()
    return executable

  def clear(self) -> None:
    """Drops every kept executable (the counts stay): each holds memory maps of its
    compiled code, and a process may hold only vm.max_map_count of them."""
    with self._lock:
      self._programs.clear()

  def info(self) -> dict[str, int]:
    with self._lock:
      return {"programs": len(self._programs), "max_programs": self.max_programs,
              "compiles": self.compiles, "hits": self.hits, "evictions": self.evictions}


PROGRAMS = ProgramCache()
# The decode program in pieces (``rollout.start`` / ``continue_stage`` / ``compact_slots``):
# adaptive speculation runs one per (shape, width) of its menu, more than PROGRAMS keeps,
# and a rollout that evicted its own stages would recompile them every call.
STAGE_PROGRAMS = ProgramCache(max_programs=256)


def program_cache_info() -> dict[str, int]:
  """Compiled generate programs kept now, the most kept, and compiles / hits /
  evictions so far (also in ``generate``'s ``stats["program_cache"]``)."""
  return PROGRAMS.info()


def programs_compiled() -> int:
  """How many generate programs have been compiled so far in this process (a call
  that raised it compiled, so its time is not a decode time)."""
  return PROGRAMS.info()["compiles"] + STAGE_PROGRAMS.info()["compiles"]


def clear_program_caches() -> None:
  """Drops every compiled generate and stage program kept (``jax.clear_caches`` does
  not reach them); the next call of each shape compiles again."""
  PROGRAMS.clear()
  STAGE_PROGRAMS.clear()


def set_program_cache_size(max_programs: int) -> None:
  """Keeps at most ``max_programs`` compiled generate programs (evicting the least
  recently used now if there are more). Each costs host memory (tens of MiB for small
  models); a workload alternating between more shapes than this recompiles."""
  PROGRAMS.resize(max_programs)
