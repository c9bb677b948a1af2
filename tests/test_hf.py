"""Hugging Face import/export: logit parity with transformers, round trips, refusals.

Every reference model is a tiny random one built and saved by transformers inside the
test (offline). Norm weights and biases are randomised too, so a swapped or dropped
norm or bias cannot hide behind HF's ones/zeros initialisation.
"""

import json
import os
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import specrl_jax as sj
from specrl_jax.config import ConfigError, ModelConfig
from specrl_jax.models import tokenizer as tok
from specrl_jax.models.hf import HFFormatError, load_hf, load_tokenizer, save_hf
from specrl_jax.models.transformer import Transformer

VOCAB = 101
PROMPT_LENGTHS = (1, 7, 33)
TOLERANCE = 1e-4
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               # Small so that, with head_dim 8, some frequencies are scaled, some
               # smoothed and some kept: every branch of the Llama-3 rule is used.
               "original_max_position_embeddings": 16}
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, rms_norm_eps=1e-5)

HF_CASES = {
    "llama-mha-untied": (transformers.LlamaForCausalLM, dict(
        num_key_value_heads=4, tie_word_embeddings=False, rope_parameters={
            "rope_type": "default", "rope_theta": 500.0})),
    "llama-gqa4-tied-llama3-rope": (transformers.LlamaForCausalLM, dict(
        num_key_value_heads=1, tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE,
        max_position_embeddings=128)),
    "qwen2-gqa2-biases-untied": (transformers.Qwen2ForCausalLM, dict(
        num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen2-gqa4-biases-tied": (transformers.Qwen2ForCausalLM, dict(
        num_key_value_heads=1, tie_word_embeddings=True)),
    "qwen3-gqa4-qknorm-wide-heads-untied": (transformers.Qwen3ForCausalLM, dict(
        num_key_value_heads=1, head_dim=16, tie_word_embeddings=False)),
    "qwen3-mha-qknorm-tied": (transformers.Qwen3ForCausalLM, dict(
        num_key_value_heads=4, head_dim=8, tie_word_embeddings=True)),
}


def randomize_torch(model: torch.nn.Module, seed: int) -> torch.nn.Module:
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, param in model.named_parameters():
      noise = torch.randn(param.shape, generator=generator)
      param.copy_(1.0 + 0.2 * noise if "norm" in name else 0.15 * noise)
  return model.eval()


def randomize_ours(model: Transformer, seed: int) -> Transformer:
  """Weights large enough that logits spread over several units, norms away from 1."""
  state = nnx.state(model, nnx.Param)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  new = []
  for (path, leaf), key in zip(leaves, keys):
    noise = jax.random.normal(key, leaf.shape, jnp.float32)
    is_norm = "scale" in jax.tree_util.keystr(path)
    new.append((1.0 + 0.2 * noise if is_norm else 0.15 * noise).astype(leaf.dtype))
  nnx.update(model, jax.tree_util.tree_unflatten(treedef, new))
  return model


def torch_logits(model: torch.nn.Module, tokens: np.ndarray) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


def prompts(seed: int):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, VOCAB, (2, length)) for length in PROMPT_LENGTHS]


def assert_same_logits(ours: Transformer, reference: torch.nn.Module, seed: int = 0):
  for tokens in prompts(seed):
    expected = torch_logits(reference, tokens)
    got = np.asarray(ours(jnp.asarray(tokens, jnp.int32)))
    assert np.abs(expected).max() > 1.0  # the comparison is not between near-zeros
    np.testing.assert_allclose(got, expected, atol=TOLERANCE, rtol=0,
                               err_msg=f"prompt length {tokens.shape[1]}")


def save_reference(tmp_path, case: str):
  model_class, fields = HF_CASES[case]
  reference = randomize_torch(model_class(model_class.config_class(**COMMON, **fields)),
                              seed=len(case))
  path = str(tmp_path / case)
  reference.save_pretrained(path)
  return reference, path


# --- Import -----------------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_loaded_transformers_checkpoint_gives_the_same_logits(tmp_path, case):
  reference, path = save_reference(tmp_path, case)
  ours = load_hf(path)
  config = ours.config
  fields = HF_CASES[case][1]
  assert config.num_kv_heads == fields["num_key_value_heads"]
  assert config.tie_embeddings == fields["tie_word_embeddings"]
  assert config.qk_norm == case.startswith("qwen3")
  assert config.attention_bias == case.startswith("qwen2")
  assert (config.rope_llama3_scaling is not None) == ("llama3" in case)
  assert config.head_dim == fields.get("head_dim", 8)
  assert_same_logits(ours, reference)


def test_llama3_rope_scaling_changes_the_logits(tmp_path):
  """Guards the parity test above: dropping the scaling would be visible."""
  reference, path = save_reference(tmp_path, "llama-gqa4-tied-llama3-rope")
  loaded = load_hf(path)
  unscaled = Transformer(loaded.config.replace(rope_llama3_scaling=None), rngs=nnx.Rngs(0))
  nnx.update(unscaled, nnx.state(loaded))
  tokens = prompts(0)[-1]
  assert np.abs(np.asarray(unscaled(jnp.asarray(tokens))) - torch_logits(reference, tokens)
                ).max() > 100 * TOLERANCE


def test_bfloat16_checkpoint_loads_as_bfloat16_unless_asked_otherwise(tmp_path):
  reference, path = save_reference(tmp_path, "qwen3-mha-qknorm-tied")
  reference.to(torch.bfloat16).save_pretrained(path)
  default = load_hf(path)
  assert default.config.param_dtype == default.config.dtype == "bfloat16"
  assert default.embed[...].dtype == jnp.bfloat16
  upcast = load_hf(path, param_dtype="float32")
  assert upcast.config.dtype == "float32"
  # bf16 -> f32 is exact, so the upcast model matches the bf16 weights run in f32
  # (reloaded rather than cast back: casting would also round HF's RoPE buffer).
  assert_same_logits(upcast, load_in_transformers(path))
  mixed = load_hf(path, param_dtype="float32", dtype="bfloat16")
  assert mixed.config.dtype == "bfloat16"


# bf16 keeps 8 significant bits, so every rounding moves a value by up to 2^-9 of it.
# Two bf16 implementations (ours, transformers') round in different places: on these
# logits of magnitude ~3 they differ by 0.02-0.07, as much as transformers' bf16 model
# differs from its own float32 run on the same weights.
BF16_TOLERANCE = 0.1


def test_bfloat16_transformers_checkpoint_runs_in_bfloat16_like_transformers(tmp_path):
  reference, path = save_reference(tmp_path, "qwen3-mha-qknorm-tied")
  reference = reference.to(torch.bfloat16)
  reference.save_pretrained(path)
  ours = load_hf(path)
  assert ours.config.param_dtype == ours.config.dtype == "bfloat16"
  params = dict(nnx.to_flat_state(nnx.state(ours, nnx.Param)))
  assert {leaf[...].dtype for leaf in params.values()} == {jnp.dtype(jnp.bfloat16)}
  # Bit-exact weights: nothing was rounded on the way in.
  embed = reference.model.embed_tokens.weight.detach().float().numpy()
  np.testing.assert_array_equal(np.asarray(ours.embed[...], np.float32), embed)
  for tokens in prompts(0):
    expected = torch_logits(reference, tokens)
    got = np.asarray(ours(jnp.asarray(tokens, jnp.int32)))
    assert got.dtype == np.float32 and np.abs(expected).max() > 1.0
    np.testing.assert_allclose(got, expected, atol=BF16_TOLERANCE, rtol=0,
                               err_msg=f"prompt length {tokens.shape[1]}")


def test_sharded_transformers_checkpoint_loads(tmp_path):
  reference, _ = save_reference(tmp_path, "qwen2-gqa2-biases-untied")
  path = str(tmp_path / "sharded")
  reference.save_pretrained(path, max_shard_size="20KB")
  assert "model.safetensors.index.json" in os.listdir(path)
  assert "model.safetensors" not in os.listdir(path)
  assert_same_logits(load_hf(path), reference)


# --- Export -----------------------------------------------------------------------

EXPORT_CASES = {
    "Qwen3ForCausalLM": dict(qk_norm=True, attention_bias=False, tie_embeddings=False,
                             num_kv_heads=1),
    "Qwen2ForCausalLM": dict(qk_norm=False, attention_bias=True, tie_embeddings=True,
                             num_kv_heads=2),
    "LlamaForCausalLM": dict(qk_norm=False, attention_bias=False, tie_embeddings=False,
                             num_kv_heads=4, rope_llama3_scaling=(8.0, 1.0, 4.0, 16),
                             max_position_embeddings=128),
}


def our_model(architecture: str, **changes) -> Transformer:
  config = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=4, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-5,
                       **{**EXPORT_CASES[architecture], **changes})
  return randomize_ours(Transformer(config, rngs=nnx.Rngs(0)), seed=len(architecture))


def load_in_transformers(path: str) -> torch.nn.Module:
  return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("architecture", sorted(EXPORT_CASES))
def test_saved_model_loads_in_transformers_with_the_same_logits(tmp_path, architecture):
  ours = our_model(architecture)
  save_hf(ours, tmp_path)
  assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
  reference = load_in_transformers(str(tmp_path))
  assert type(reference).__name__ == architecture
  assert_same_logits(ours, reference)


@pytest.mark.parametrize("architecture", sorted(EXPORT_CASES))
def test_save_then_load_restores_config_and_weights_exactly(tmp_path, architecture):
  ours = our_model(architecture)
  save_hf(ours, tmp_path)
  restored = load_hf(tmp_path)
  assert restored.config == ours.config
  chex.assert_trees_all_equal(nnx.state(restored, nnx.Param), nnx.state(ours, nnx.Param))


def test_sharded_save_loads_in_both_libraries(tmp_path):
  ours = our_model("Qwen3ForCausalLM")
  save_hf(ours, tmp_path, max_shard_bytes=16_000)
  files = sorted(os.listdir(tmp_path))
  shards = [f for f in files if re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", f)]
  assert len(shards) > 2 and "model.safetensors" not in files
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  assert sorted(set(index["weight_map"].values())) == shards
  for shard in shards:  # only a tensor larger than the limit may exceed it alone
    tensors = load_file(str(tmp_path / shard))
    assert len(tensors) == 1 or sum(t.nbytes for t in tensors.values()) <= 16_000
  assert index["metadata"]["total_size"] == 4 * ours.config.num_params()
  chex.assert_trees_all_equal(nnx.state(load_hf(tmp_path), nnx.Param),
                              nnx.state(ours, nnx.Param))
  assert_same_logits(ours, load_in_transformers(str(tmp_path)))


def test_resaving_unsharded_removes_stale_shards(tmp_path):
  ours = our_model("LlamaForCausalLM")
  save_hf(ours, tmp_path, max_shard_bytes=16_000)
  save_hf(ours, tmp_path)
  assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]


def test_bfloat16_model_saves_as_bfloat16(tmp_path):
  ours = our_model("Qwen2ForCausalLM", param_dtype="bfloat16", dtype="bfloat16")
  save_hf(ours, tmp_path)
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["dtype"] == config["torch_dtype"] == "bfloat16"
  with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
    assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"BF16"}
  reference = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
  assert reference.dtype == torch.bfloat16
  chex.assert_trees_all_equal(nnx.state(load_hf(tmp_path), nnx.Param),
                              nnx.state(ours, nnx.Param))


def test_qk_norm_with_attention_bias_has_no_hf_architecture(tmp_path):
  with pytest.raises(HFFormatError, match="qk_norm=True and attention_bias=True"):
    save_hf(our_model("Qwen3ForCausalLM", attention_bias=True), tmp_path)


def test_max_shard_bytes_must_be_positive(tmp_path):
  with pytest.raises(ConfigError, match="max_shard_bytes=0"):
    save_hf(our_model("LlamaForCausalLM"), tmp_path, max_shard_bytes=0)


# --- Tokenizer --------------------------------------------------------------------

def test_tokenizer_saved_with_the_model_loads_in_both_libraries(tmp_path):
  ours = Transformer(ModelConfig(vocab_size=tok.VOCAB_SIZE, hidden_size=32,
                                 intermediate_size=64, num_layers=1, num_heads=2,
                                 num_kv_heads=1, head_dim=16), rngs=nnx.Rngs(0))
  save_hf(ours, tmp_path, tokenizer=tok.builtin_tokenizer())
  text = "12+30=42\nanswer: 42"
  loaded = load_tokenizer(tmp_path)
  assert isinstance(loaded, sj.TextTokenizer)  # the chat-template-aware tokenizer
  assert loaded.encode(text) == tok.encode(text)
  assert loaded.eos_ids == (tok.EOS_ID,) and loaded.pad_id == tok.PAD_ID
  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  assert hf_tokenizer(text, add_special_tokens=False).input_ids == tok.encode(text)
  assert (hf_tokenizer.pad_token_id, hf_tokenizer.bos_token_id,
          hf_tokenizer.eos_token_id) == (tok.PAD_ID, tok.BOS_ID, tok.EOS_ID)
  config = json.loads((tmp_path / "config.json").read_text())
  assert (config["pad_token_id"], config["bos_token_id"],
          config["eos_token_id"]) == (tok.PAD_ID, tok.BOS_ID, tok.EOS_ID)


def test_folder_without_tokenizer_has_none(tmp_path):
  save_hf(our_model("LlamaForCausalLM"), tmp_path)
  assert load_tokenizer(tmp_path) is None


# --- Refusals ---------------------------------------------------------------------

@pytest.fixture
def folder(tmp_path):
  """A valid Llama folder written by save_hf, for tests to break one thing in."""
  save_hf(Transformer(ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                                  qk_norm=False), rngs=nnx.Rngs(0)), tmp_path)
  return tmp_path


def edit_config(folder, **changes):
  path = folder / "config.json"
  config = {**json.loads(path.read_text()), **changes}
  path.write_text(json.dumps({k: v for k, v in config.items() if v is not None}))


def edit_tensors(folder, edit):
  path = str(folder / "model.safetensors")
  tensors = load_file(path)
  edit(tensors)
  save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize("changes,fragments", [
    (dict(architectures=["MistralForCausalLM"], model_type="mistral"),
     ["MistralForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]),
    (dict(architectures=["MistralForCausalLM"]), ["MistralForCausalLM", "LlamaForCausalLM"]),
    (dict(architectures=None, model_type="gemma"), ["'gemma'", "'llama', 'qwen2', 'qwen3'"]),
    (dict(attention_bias=True), ["attention_bias=True", "o_proj bias", "allowed: false"]),
    (dict(mlp_bias=True), ["mlp_bias=True", "allowed: false"]),
    (dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=True,
          sliding_window=4), ["use_sliding_window=True", "allowed: false"]),
    (dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3",
          layer_types=["full_attention", "sliding_attention"]),
     ["sliding_attention", "full_attention"]),
    (dict(rope_scaling=None, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                              "rope_theta": 1e4}),
     ["'yarn'", "'default', 'llama3'"]),
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), ["'linear'", "'llama3'"]),
    (dict(hidden_act="gelu"), ["hidden_act='gelu'", "'silu'"]),
    (dict(partial_rotary_factor=0.5), ["partial_rotary_factor=0.5", "1.0"]),
    (dict(intermediate_size=None), ["'intermediate_size'"]),
])
def test_unsupported_configs_are_refused_naming_what_and_what_is_allowed(
    folder, changes, fragments):
  edit_config(folder, **changes)
  with pytest.raises(HFFormatError) as error:
    load_hf(folder)
  for fragment in fragments:
    assert fragment in str(error.value)


def test_config_values_out_of_range_name_the_model_config_field(folder):
  edit_config(folder, num_key_value_heads=3)
  with pytest.raises(ConfigError, match=r"config\.json.*num_kv_heads=3.*divisor of num_heads=4"):
    load_hf(folder)


def test_missing_tensor_is_named(folder):
  edit_tensors(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
  with pytest.raises(HFFormatError, match=r"lacks tensors.*model\.layers\.1\.mlp\.up_proj\.weight"):
    load_hf(folder)


def test_wrong_shape_is_named_with_expected_and_found_shapes(folder):
  def transpose(tensors):
    name = "model.layers.0.self_attn.k_proj.weight"
    tensors[name] = np.ascontiguousarray(tensors[name].T)
  edit_tensors(folder, transpose)
  with pytest.raises(HFFormatError, match=re.escape(
      "'model.layers.0.self_attn.k_proj.weight' has shape (32, 16); expected (16, 32)")):
    load_hf(folder)


def test_unexpected_extra_tensor_is_named(folder):
  edit_tensors(folder, lambda t: t.update({"model.layers.0.self_attn.o_proj.bias":
                                           np.zeros(32, np.float32)}))
  with pytest.raises(HFFormatError, match=r"no place for.*o_proj\.bias"):
    load_hf(folder)


def test_tied_checkpoint_may_repeat_the_embedding_but_not_differ_from_it(folder):
  edit_config(folder, tie_word_embeddings=True)
  edit_tensors(folder, lambda t: t.pop("lm_head.weight"))
  edit_tensors(folder, lambda t: t.update(
      {"lm_head.weight": t["model.embed_tokens.weight"].copy()}))
  assert load_hf(folder).config.tie_embeddings
  edit_tensors(folder, lambda t: t.update(
      {"lm_head.weight": t["model.embed_tokens.weight"] + 1}))
  with pytest.raises(HFFormatError, match="lm_head.weight differs"):
    load_hf(folder)


def test_folder_without_config_or_weights_is_refused(tmp_path, folder):
  with pytest.raises(HFFormatError, match="model folder .*nowhere does not exist"):
    load_hf(tmp_path / "nowhere")
  (tmp_path / "empty").mkdir()
  with pytest.raises(HFFormatError, match="no config.json"):
    load_hf(tmp_path / "empty")
  os.remove(folder / "model.safetensors")
  with pytest.raises(HFFormatError, match="neither model.safetensors nor"):
    load_hf(folder)


def test_model_type_alone_identifies_the_architecture(folder):
  edit_config(folder, architectures=None)
  assert load_hf(folder).config.qk_norm is False
