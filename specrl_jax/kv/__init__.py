"""The paged KV cache: pages and their attention reference (``paged``), the
reference-counted page pool (``pool``) and memory planning (``planner``)."""

from specrl_jax.kv.paged import (AttentionFn, LayerOffset, PagedKV, gather_prefix,
                                 init_pages, page_size_of, page_slots,
                                 paged_attention_reference, read_pages, write_pages)
from specrl_jax.kv.planner import (MemoryBudgetError, MemoryPlan, bytes_per_page,
                                   device_memory_stats, kv_heads_per_device, plan_memory)
from specrl_jax.kv.pool import (TRASH_PAGE, PagePool, add_references, allocate, init_pool,
                                release)

__all__ = [
    "AttentionFn", "LayerOffset", "MemoryBudgetError", "MemoryPlan", "PagePool", "PagedKV",
    "TRASH_PAGE", "add_references", "allocate", "bytes_per_page", "device_memory_stats",
    "gather_prefix", "init_pages", "init_pool", "kv_heads_per_device", "page_size_of",
    "page_slots", "paged_attention_reference", "plan_memory", "read_pages", "release",
    "write_pages",
]
