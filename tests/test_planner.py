"""Memory planning: the page pool sized from a byte budget, and batches that cannot fit
refused before anything compiles.

What must hold: a page is K and V of every layer, split over tensor shards where they
divide the KV heads; a budget holds budget-less-weights over bytes-per-page pages; a
batch the planner admits decodes to the end without exhausting the pool (plain and
speculative, long responses, more requests than slots); one slot more is refused with
the numbers, before compiling.
"""

import jax
import numpy as np
import pytest
from flax import nnx

import specrl_jax as sj
from specrl_jax import testing
from specrl_jax.config import ConfigError, ModelConfig, SamplingParams, SpecConfig
from specrl_jax.kv.planner import (MemoryBudgetError, bytes_per_page, kv_heads_per_device,
                                   plan_memory)
from specrl_jax.parallel.create import create_model
from specrl_jax.sampling.programs import PROGRAMS
from specrl_jax.sampling.engine import EngineConfig
from specrl_jax.speculative.generate import generate, prepare

PAGE = 4
MAX_NEW = 22  # several pages per response
PROMPTS = [[5], [3, 14, 15], [9, 2, 6, 5, 1, 1], [3, 5, 8, 9, 7], [3, 14, 15],
           [11, 0, 13, 2, 4, 4, 12, 10, 1], [7, 7], [2, 4, 6, 8, 10, 12, 14]]
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def model():
  config = ModelConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64)
  return testing.peaked_random_model(config, seed=0)


def weight_bytes(model) -> int:
  return sum(leaf.nbytes for leaf in jax.tree.leaves(nnx.state(model)))


def budget_for_slots(model, num_slots: int) -> int:
  """The exact byte budget whose pool holds the prompts and ``num_slots`` sequences."""
  _, layout, *_ = prepare(model.config, PROMPTS, SAMPLING,
                          EngineConfig(page_size=PAGE, num_slots=num_slots))
  config = model.config
  page_bytes = bytes_per_page(((config.num_kv_heads, config.head_dim),) * config.num_layers,
                              page_size=PAGE, kv_dtype=config.dtype)
  return weight_bytes(model) + layout.pages_always_enough * page_bytes


# --- the arithmetic ------------------------------------------------------------------

def test_a_page_holds_keys_and_values_of_every_layer():
  config = sj.PRESETS["qwen3-8b"]
  layers = ((config.num_kv_heads, config.head_dim),) * config.num_layers
  # 36 layers x (K, V) x 8 heads x 16 tokens x 128 dims x 2 bytes.
  assert bytes_per_page(layers, page_size=16, kv_dtype="bfloat16") == 36 * 2 * 8 * 16 * 128 * 2
  assert bytes_per_page(layers, page_size=16, kv_dtype="float32") == 36 * 2 * 8 * 16 * 128 * 4
  assert bytes_per_page(layers, page_size=16, kv_dtype="bfloat16", tensor_shards=4) == (
      36 * 2 * 2 * 16 * 128 * 2)


@pytest.mark.parametrize("heads,shards,per_device", [
    (8, 1, 8), (8, 2, 4), (8, 8, 1), (2, 4, 2), (8, 16, 8), (6, 4, 6)])
def test_kv_heads_split_where_the_shards_divide_them_and_are_replicated_otherwise(
    heads, shards, per_device):
  assert kv_heads_per_device(heads, shards) == per_device


def test_a_byte_budget_holds_what_the_weights_leave_in_whole_pages():
  config = sj.PRESETS["qwen3-8b"]
  weights = config.num_params() * 2
  page_bytes = 36 * 2 * 8 * 16 * 128 * 2
  plan = plan_memory(config, kv_dtype="bfloat16", page_size=16, weight_bytes=weights,
                     memory_budget_bytes=weights + 1000 * page_bytes + page_bytes // 2)
  assert plan.num_pages == 1000
  # Sequences of 4096 tokens: 256 pages each; the trash page is reserved.
  assert plan.max_sequences(plan.pages_for(4096)) == 3
  assert plan.max_sequences(plan.pages_for(4096), reserved_pages=1 + 500) == 1


def test_a_memory_fraction_takes_its_share_of_the_free_memory_after_weights():
  """qwen3-8b in bf16 on an H200-sized device (141 GB) whose weights are resident."""
  config = sj.PRESETS["qwen3-8b"]
  weights = config.num_params() * 2
  stats = {"bytes_limit": 141 * 10**9, "bytes_in_use": weights + 10**9}
  plan = plan_memory(config, kv_dtype="bfloat16", page_size=16, weight_bytes=weights,
                     memory_fraction=0.5, memory_stats=stats)
  free = stats["bytes_limit"] - stats["bytes_in_use"]
  assert plan.num_pages == int(0.5 * free) // plan.bytes_per_page
  # Weights not resident yet (bytes_in_use below them) are subtracted themselves.
  early = plan_memory(config, kv_dtype="bfloat16", page_size=16, weight_bytes=weights,
                      memory_fraction=0.5, memory_stats={"bytes_limit": 141 * 10**9,
                                                         "bytes_in_use": 0})
  assert early.num_pages == int(0.5 * (141 * 10**9 - weights)) // plan.bytes_per_page


def test_a_memory_fraction_without_device_statistics_asks_for_a_byte_budget():
  config = sj.PRESETS["qwen3-0.6b"]
  with pytest.raises(MemoryBudgetError, match="memory_budget_bytes instead"):
    plan_memory(config, kv_dtype="bfloat16", page_size=16, weight_bytes=10,
                memory_fraction=0.9, memory_stats=None)


def test_a_budget_below_the_weights_is_refused_with_the_numbers():
  config = sj.PRESETS["llama-3.1-8b"]
  weights = config.num_params() * 2
  with pytest.raises(MemoryBudgetError) as error:
    plan_memory(config, kv_dtype="bfloat16", page_size=16, weight_bytes=weights,
                memory_budget_bytes=16 * 10**9)
  message = str(error.value)
  assert "memory_budget_bytes=16000000000" in message and str(weights) in message
  assert "0 pages" in message


@pytest.mark.parametrize("fields,fragment", [
    (dict(memory_fraction=0.0), "memory_fraction=0.0"),
    (dict(memory_fraction=1.5), "memory_fraction=1.5"),
    (dict(memory_fraction=True), "memory_fraction=True"),
    (dict(memory_budget_bytes=0), "memory_budget_bytes=0"),
    (dict(memory_budget_bytes=2.5e9), "memory_budget_bytes=2500000000.0"),
    (dict(memory_budget_bytes=10**9, num_pages=64), "at most one of num_pages"),
    (dict(memory_budget_bytes=10**9, memory_fraction=0.5), "at most one of num_pages"),
])
def test_bad_memory_settings_name_the_field(fields, fragment):
  with pytest.raises(ConfigError, match=f"EngineConfig.*{fragment}"):
    EngineConfig(**fields)


# --- the engine ----------------------------------------------------------------------

def test_without_a_slot_count_the_engine_takes_as_many_slots_as_fit(model):
  engine = EngineConfig(page_size=PAGE, memory_budget_bytes=budget_for_slots(model, 3))
  _, layout, *_ = prepare(model.config, PROMPTS, SAMPLING, engine,
                          weight_bytes=weight_bytes(model))
  assert layout.num_slots == 3
  assert layout.num_pages == layout.pages_always_enough


@pytest.mark.parametrize("drafter", [None, sj.drafters.NGram(n=2)], ids=["plain", "ngram"])
def test_a_batch_the_planner_admits_decodes_to_the_end(model, drafter):
  """At the admitted limit the pool is exactly what the slots and prompts can take:
  every response runs its full length (no stop tokens) with requests queued for slots."""
  engine = EngineConfig(page_size=PAGE, num_slots=3,
                        memory_budget_bytes=budget_for_slots(model, 3))
  out = generate(model, PROMPTS, sampling=SAMPLING, rng=jax.random.key(0), engine=engine,
                 drafter=drafter, spec=SpecConfig(num_draft_tokens=3) if drafter else None)
  np.testing.assert_array_equal(out.lengths, MAX_NEW)


def test_one_slot_more_is_refused_before_compiling_with_the_numbers(model):
  engine = EngineConfig(page_size=PAGE, num_slots=4,
                        memory_budget_bytes=budget_for_slots(model, 3))
  compiled = PROGRAMS.info()["compiles"]
  with pytest.raises(MemoryBudgetError) as error:
    generate(model, PROMPTS, sampling=SAMPLING, engine=engine)
  assert PROGRAMS.info()["compiles"] == compiled
  message = str(error.value)
  config = model.config
  page_bytes = config.num_layers * 2 * config.num_kv_heads * PAGE * config.head_dim * 4
  pages_per_sequence = -(-(16 + MAX_NEW + 1) // PAGE)  # prompts padded to the bucket of 16
  for number in (f"4 x {pages_per_sequence} pages", f"{page_bytes} bytes",
                 f"memory_budget_bytes={engine.memory_budget_bytes}",
                 str(weight_bytes(model)), "At most 3 sequences"):
    assert number in message, number


def test_a_draft_models_weights_and_pages_count_against_the_budget(model):
  """The drafter's layers share the target's pages, so each page is larger, and its
  weights take from the budget: the budget that holds three plain slots holds fewer."""
  small = create_model(model.config.replace(num_layers=1, hidden_size=16, intermediate_size=16,
                                            num_heads=2, num_kv_heads=1), rng=1)
  draft = sj.drafters.DraftModel(small)
  engine = EngineConfig(page_size=PAGE, memory_budget_bytes=budget_for_slots(model, 3))
  _, layout, *_ = prepare(model.config, PROMPTS, SAMPLING, engine, draft, SpecConfig(),
                          weight_bytes=weight_bytes(model))
  config = model.config
  page_bytes = (config.num_layers * config.num_kv_heads + 1) * 2 * PAGE * config.head_dim * 4
  pool_bytes = engine.memory_budget_bytes - weight_bytes(model) - weight_bytes(small)
  assert layout.num_pages == pool_bytes // page_bytes
  assert 1 <= layout.num_slots < 3


def test_a_memory_fraction_on_a_backend_without_memory_statistics_is_refused(model):
  """CPU reports no memory_stats(): the fraction cannot be taken of anything."""
  with pytest.raises(MemoryBudgetError, match="memory_budget_bytes instead"):
    generate(model, PROMPTS, sampling=SAMPLING, engine=EngineConfig(memory_fraction=0.5))


def test_splitting_kv_heads_over_tensor_shards_halves_each_page(model):
  """Two KV heads over two tensor shards: each device stores one head of every page."""
  engine = EngineConfig(page_size=PAGE, memory_budget_bytes=budget_for_slots(model, 3))
  layouts = [prepare(model.config, PROMPTS, SAMPLING, engine, weight_bytes=weight_bytes(model),
                     tensor_shards=shards)[1] for shards in (1, 2)]
  pool_bytes = engine.memory_budget_bytes - weight_bytes(model)
  config = model.config
  whole_page = config.num_layers * 2 * config.num_kv_heads * PAGE * config.head_dim * 4
  assert [layout.num_pages for layout in layouts] == [pool_bytes // whole_page,
                                                      pool_bytes // (whole_page // 2)]
