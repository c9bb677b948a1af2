"""Model presets: the published Qwen3 / Llama-3 architectures at their real sizes."""

import pytest

import specrl_jax as sj
from specrl_jax.models.hf import hf_config_from_model

# Parameter totals as published on the models' cards (embeddings included).
PUBLISHED_PARAMS = {
    "qwen3-0.6b": 0.596e9,
    "qwen3-1.7b": 1.72e9,
    "qwen3-4b": 4.02e9,
    "qwen3-8b": 8.19e9,
    "llama-3.2-1b": 1.24e9,
    "llama-3.1-8b": 8.03e9,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_preset_parameter_count_matches_the_published_total(name):
  published = PUBLISHED_PARAMS[name]
  assert abs(sj.PRESETS[name].num_params() - published) <= 0.01 * published


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_preset_is_bfloat16_as_released(name):
  config = sj.PRESETS[name]
  assert (config.param_dtype, config.dtype) == ("bfloat16", "bfloat16")


@pytest.mark.parametrize("name,tied", [
    ("qwen3-0.6b", True), ("qwen3-1.7b", True), ("qwen3-4b", True), ("qwen3-8b", False),
    ("llama-3.2-1b", True), ("llama-3.1-8b", False)])
def test_preset_ties_embeddings_where_the_original_does(name, tied):
  assert sj.PRESETS[name].tie_embeddings is tied


def test_qwen3_presets_norm_queries_and_keys_and_llama_presets_scale_rope():
  for name, config in sj.PRESETS.items():
    if name.startswith("qwen3"):
      assert config.qk_norm and config.rope_llama3_scaling is None
      assert config.rope_theta == 1e6
    if name.startswith("llama"):
      assert not config.qk_norm and config.rope_llama3_scaling is not None
      assert config.rope_theta == 5e5


@pytest.mark.parametrize("name", ["qwen3-0.6b", "llama-3.2-1b", "qwen3-8b"])
def test_num_params_counts_what_transformers_builds_for_the_same_config(name):
  """The formula and transformers' own modules agree (built on the meta device: no
  memory, no weights)."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  config = sj.PRESETS[name]
  hf_config = transformers.AutoConfig.for_model(**hf_config_from_model(config))
  with torch.device("meta"):
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config)
  assert sum(p.numel() for p in hf_model.parameters()) == config.num_params()


def test_the_benchmark_preset_is_kept():
  assert sj.PRESETS["bench-160m"].num_layers == 8
