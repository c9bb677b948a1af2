"""Memory planning for the KV page pool, as serving engines do it.

A device holds the weights and the page pool; activations and compiled programs take
what the budget leaves. The budget for pages is either an explicit number of bytes per
device (weights included, as a device's capacity would be given) or a fraction of the
memory the device reports free after the weights. Pages are all the same size: one
page holds ``page_size`` tokens of K and V in every layer (the target's and a drafter's),
so the pool's size is the budget over the bytes of a page, and a batch fits when its
sequences' pages plus the prompts' fit the pool. Everything here is arithmetic on
configs and numbers, so a batch that cannot fit is refused before anything compiles.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from specrl_jax.config import ModelConfig, check, check_positive_int


class MemoryBudgetError(ValueError):
  """The requested batch (or the weights alone) does not fit the memory budget."""


def kv_heads_per_device(num_kv_heads: int, tensor_shards: int) -> int:
  """KV heads each device stores when heads are split over ``tensor_shards``: an even
  split where the shards divide the heads, otherwise every device keeps all of them
  (the partition rules replicate a dimension the mesh axis does not divide, e.g. 2 KV
  heads on 4 tensor shards)."""
  return num_kv_heads // tensor_shards if num_kv_heads % tensor_shards == 0 else num_kv_heads


def bytes_per_page(kv_layers: Sequence[tuple[int, int]], *, page_size: int, kv_dtype,
                   tensor_shards: int = 1) -> int:
  """Bytes one page takes on one device: K and V of ``page_size`` tokens in every
  (num_kv_heads, head_dim) layer."""
  itemsize = np.dtype(jax.numpy.dtype(kv_dtype)).itemsize
  return sum(2 * kv_heads_per_device(heads, tensor_shards) * page_size * dim * itemsize
             for heads, dim in kv_layers)


def _gb(num_bytes: float) -> str:
  return f"{num_bytes / 1e9:.3f} GB ({int(num_bytes)} bytes)"


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryPlan:
  """How one device's memory divides between weights and KV pages.

  num_pages: the pool's size, its reserved trash page included.
  budget: how the bytes for pages were found (for error messages).
  """
  weight_bytes: int
  page_budget_bytes: int
  bytes_per_page: int
  page_size: int
  num_pages: int
  budget: str

  def pages_for(self, tokens: int) -> int:
    """Pages a sequence of ``tokens`` tokens occupies."""
    return -(-tokens // self.page_size)

  def max_sequences(self, pages_per_sequence: int, *, reserved_pages: int = 1) -> int:
    """Concurrent sequences of ``pages_per_sequence`` pages the pool holds once
    ``reserved_pages`` (the trash page, prompts kept for later samples) are taken."""
    return max(0, (self.num_pages - reserved_pages) // pages_per_sequence)

  def admit(self, num_sequences: int, *, pages_per_sequence: int, reserved_pages: int = 1,
            shrink: bool = False) -> int:
    """The number of sequences to decode concurrently: ``num_sequences`` when they fit;
    with ``shrink``, as many as fit (at least one). Otherwise MemoryBudgetError with the
    numbers."""
    fit = self.max_sequences(pages_per_sequence, reserved_pages=reserved_pages)
    if num_sequences <= fit:
      return num_sequences
    if shrink and fit >= 1:
      return fit
    needed = reserved_pages + num_sequences * pages_per_sequence
    raise MemoryBudgetError(
        f"{num_sequences} concurrent sequences do not fit the KV memory budget: they need "
        f"{num_sequences} x {pages_per_sequence} pages of {self.page_size} tokens (up to "
        f"{pages_per_sequence * self.page_size} tokens each) + {reserved_pages} reserved "
        f"pages (trash page and prompts) = {needed} pages of {self.bytes_per_page} bytes "
        f"= {_gb(needed * self.bytes_per_page)}, but the pool holds {self.num_pages} "
        f"pages: {self.budget}, weights {_gb(self.weight_bytes)} per device. At most "
        f"{fit} sequences of this length fit: lower num_slots or max_new_tokens, or "
        "raise the budget.")


def plan_memory(config: ModelConfig, *, kv_dtype, page_size: int, weight_bytes: int,
                memory_budget_bytes: int | None = None, memory_fraction: float | None = None,
                memory_stats: Mapping[str, int] | None = None, tensor_shards: int = 1,
                extra_kv_layers: Sequence[tuple[int, int]] = ()) -> MemoryPlan:
  """The page pool one device can hold.

  weight_bytes: the weights' bytes on one device (a drafter's included).
  memory_budget_bytes: the device's bytes for weights and pages together.
  memory_fraction: the share of the device's free memory after weights that pages get;
    free is ``bytes_limit`` less ``bytes_in_use`` from ``memory_stats`` (``bytes_in_use``
    counts resident weights; weights not resident yet are subtracted instead).
  tensor_shards: ways the KV heads are split over the mesh's "tensor" axis.
  extra_kv_layers: (num_kv_heads, head_dim) of layers a drafter keeps in the same pages.
  """
  owner = "plan_memory"
  check((memory_budget_bytes is None) != (memory_fraction is None), owner,
        "memory_budget_bytes", memory_budget_bytes,
        f"exactly one of memory_budget_bytes and memory_fraction (got memory_fraction="
        f"{memory_fraction!r})")
  check_positive_int(owner, "tensor_shards", tensor_shards)
  layers = ((config.num_kv_heads, config.head_dim),) * config.num_layers + tuple(extra_kv_layers)
  page_bytes = bytes_per_page(layers, page_size=page_size, kv_dtype=kv_dtype,
                              tensor_shards=tensor_shards)
  if memory_budget_bytes is not None:
    page_budget = memory_budget_bytes - weight_bytes
    budget = (f"memory_budget_bytes={memory_budget_bytes} less the weights leaves "
              f"{_gb(page_budget)} for pages")
  else:
    if not memory_stats or "bytes_limit" not in memory_stats:
      raise MemoryBudgetError(
          f"memory_fraction={memory_fraction} needs the device's memory statistics "
          f"(bytes_limit, bytes_in_use), which this backend does not report "
          f"(memory_stats()={memory_stats!r}): give memory_budget_bytes instead.")
    limit, in_use = int(memory_stats["bytes_limit"]), int(memory_stats.get("bytes_in_use", 0))
    free = limit - max(in_use, weight_bytes)
    page_budget = int(memory_fraction * free)
    budget = (f"memory_fraction={memory_fraction} of the {_gb(free)} free after weights "
              f"(bytes_limit {limit}, bytes_in_use {in_use}) gives {_gb(page_budget)} "
              "for pages")
  num_pages = page_budget // page_bytes if page_budget > 0 else 0
  if num_pages < 2:
    raise MemoryBudgetError(
        f"The KV memory budget holds {num_pages} pages, and the pool needs at least 2 "
        f"(one is reserved): {budget}; weights {_gb(weight_bytes)} per device, "
        f"{page_bytes} bytes per page of {page_size} tokens.")
  return MemoryPlan(weight_bytes=weight_bytes, page_budget_bytes=page_budget,
                    bytes_per_page=page_bytes, page_size=page_size, num_pages=int(num_pages),
                    budget=budget)


def device_memory_stats(devices: Sequence[jax.Device] | None = None) -> Mapping[str, int] | None:
  """``memory_stats()`` of the local device with the least free memory (the one that
  bounds a pool every device holds alike); None where the backend reports none (CPU)."""
  stats = [d.memory_stats() for d in (devices or jax.local_devices())]
  stats = [s for s in stats if s and "bytes_limit" in s]
  if not stats:
    return None
  return min(stats, key=lambda s: s["bytes_limit"] - s.get("bytes_in_use", 0))
