"""The static shape of a decode program (slots, pages, page size, KV dtype) and the
host-side packing of prompts into it."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from specrl_jax.config import SamplingParams
from specrl_jax.sampling.engine import EngineConfig
from specrl_jax.sampling.memory import plan_engine_memory, sharded_bytes, tree_bytes
from specrl_jax.sampling.hooks import RoundHook


@dataclasses.dataclass(frozen=True)
class Layout:
  """Static shapes of one compiled generate program."""
  num_slots: int
  page_size: int
  num_pages: int
  max_pages_per_seq: int
  max_new_tokens: int
  continuous: bool
  pages_always_enough: int
  kv_dtype: str = "float32"
  attention: str = "auto"     # EngineConfig.attention, resolved in init_state
  # The narrowest width slot compaction goes to (0: none; ``sampling.compaction``).
  compaction_min_width: int = 0


def group_prompts(prompts: list[list[int]]):
  """Distinct prompts (first-seen order), each request's prompt and each prompt's last request."""
  index_of: dict[tuple[int, ...], int] = {}
  prompt_of_request = []
  for prompt in prompts:
    prompt_of_request.append(index_of.setdefault(tuple(prompt), len(index_of)))
  unique = list(index_of)
  last_request = np.zeros(len(unique), np.int32)
  for request, prompt in enumerate(prompt_of_request):
    last_request[prompt] = request
  return unique, np.asarray(prompt_of_request, np.int32), last_request


def weight_bytes_for(params, engine: EngineConfig, mesh: Mesh | None) -> int | None:
  """The target's weights on one device as generate lays them out, when a memory budget
  needs them."""
  if engine.memory_fraction is None and engine.memory_budget_bytes is None:
    return None
  return tree_bytes(params) if mesh is None else sharded_bytes(params, mesh)


def tensor_shards_of(mesh: Mesh | None) -> int:
  return 1 if mesh is None else mesh.shape["tensor"]


def pack(config, prompts: list[list[int]], sampling: SamplingParams, engine: EngineConfig,
         *, rounds: RoundHook | None = None, weight_bytes: int | None = None, tensor_shards: int = 1):
  """Host-side packing of validated prompts into static-shape arrays.

  With a memory budget (``EngineConfig.memory_fraction`` / ``memory_budget_bytes``) the
  pool's pages and, for num_slots=0, the slots come from ``kv.planner``, and slots that
  cannot fit raise its MemoryBudgetError here, before anything compiles. rounds: the
  round hook whose weights and KV layers share the device (``engine_layout``);
  weight_bytes: the target's weights on one device (default: estimated from
  ``config``); tensor_shards: ways the KV heads are split.

  Returns (inputs, layout) where inputs = (tokens_UxT, lengths_U, prompt_of_request_R,
  last_request_U) as device arrays.
  """
  unique, prompt_of_request, last_request = group_prompts(prompts)
  tokens, lengths = pack_prompts(unique, padded_width(max(len(p) for p in unique), engine))
  layout = engine_layout(config, prompt_width=tokens.shape[1],
                         prompt_pages=int(np.sum(-(-lengths // engine.page_size))),
                         num_requests=len(prompts), sampling=sampling, engine=engine,
                         drafter=rounds, weight_bytes=weight_bytes,
                         tensor_shards=tensor_shards)
  inputs = tuple(jnp.asarray(a) for a in (tokens, lengths, prompt_of_request, last_request))
  return inputs, layout


def padded_width(longest_prompt: int, engine: EngineConfig) -> int:
  """Prompt arrays are padded to a multiple of the bucket, bounding recompilation."""
  return -(-longest_prompt // engine.prompt_bucket) * engine.prompt_bucket


def pack_prompts(unique: Sequence[Sequence[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
  """(tokens_UxT zero-padded to ``width``, lengths_U) on the host."""
  tokens = np.zeros((len(unique), width), np.int32)
  for row, prompt in enumerate(unique):
    tokens[row, :len(prompt)] = prompt
  return tokens, np.asarray([len(p) for p in unique], np.int32)


def engine_layout(config, *, prompt_width: int, prompt_pages: int, num_requests: int,
                  sampling: SamplingParams, engine: EngineConfig, drafter=None,
                  weight_bytes: int | None = None, tensor_shards: int = 1) -> Layout:
  """The static shape of a decode program, from shapes alone: prompts ``prompt_width``
  wide (padded) needing ``prompt_pages`` pages in all, and ``num_requests`` samples of
  the model ``config``. With a memory budget in ``engine`` the pool and (num_slots=0)
  the slots come from ``kv.planner`` (``drafter``'s weights and KV layers counted:
  anything with ``params()`` and ``kv_layers()``, a drafter or the round hook;
  weight_bytes: the target's on one device, default estimated from ``config``), and
  slots that cannot fit raise its MemoryBudgetError."""
  num_slots = engine.num_slots or min(num_requests, 256)
  page_size = engine.page_size
  # Room for the prompt and every emitted token: keys a speculative round commits past
  # that (accepted drafts beyond the budget, never emitted) go to the trash page.
  max_pages = -(-(prompt_width + sampling.max_new_tokens + 1) // page_size)
  # Pages every prompt holds until its last sample is admitted, and the trash page.
  reserved = 1 + prompt_pages
  plan = plan_engine_memory(config, engine, drafter, weight_bytes=weight_bytes,
                            tensor_shards=tensor_shards)
  if plan is not None:
    num_slots = plan.admit(num_slots, pages_per_sequence=max_pages, reserved_pages=reserved,
                           shrink=engine.num_slots == 0)
  enough = reserved + num_slots * max_pages
  return Layout(num_slots=num_slots, page_size=page_size,
                 num_pages=plan.num_pages if plan is not None else engine.num_pages or enough,
                 max_pages_per_seq=max_pages,
                 max_new_tokens=sampling.max_new_tokens,
                 continuous=engine.continuous_batching, pages_always_enough=enough,
                 kv_dtype=engine.kv_dtype or config.dtype, attention=engine.attention,
                 compaction_min_width=engine.compaction_min_width if engine.compaction else 0)
