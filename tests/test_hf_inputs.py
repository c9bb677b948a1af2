"""load_hf on folders a careless or hostile hand put together.

It reads the weights transformers would read, never a file outside the folder, and
refuses (naming the file) what it cannot load as float weights. Folders are tiny ones
written by save_hf or transformers inside each test (offline).
"""

import json
import os
import re
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from specrl_jax.config import ConfigError, ModelConfig
from specrl_jax.models.hf import HFFormatError, load_hf, save_hf
from specrl_jax.models.hf_files import read_tensors, tensor_infos
from specrl_jax.models.transformer import Transformer

VOCAB = 101
TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, 9))
SHARD_BYTES = 16_000  # splits the tiny model below into several shards
OUTSIDE = "outside.safetensors"


def tiny_model(param_dtype: str = "float32") -> Transformer:
  config = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                       num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8,
                       qk_norm=False, param_dtype=param_dtype, dtype=param_dtype)
  return Transformer(config, rngs=nnx.Rngs(0))


def tiny_transformers_model(seed: int) -> torch.nn.Module:
  """A Llama whose weights are large enough for logits of several units."""
  config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=1, num_attention_heads=4,
                                    num_key_value_heads=2, tie_word_embeddings=False)
  model = transformers.LlamaForCausalLM(config)
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for param in model.parameters():
      param.copy_(0.3 * torch.randn(param.shape, generator=generator))
  return model.eval()


def torch_logits(model: torch.nn.Module) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(TOKENS)).logits.float().numpy()


def our_logits(model: Transformer) -> np.ndarray:
  return np.asarray(model(jnp.asarray(TOKENS, jnp.int32)))


def transformers_logits_of(path) -> np.ndarray:
  return torch_logits(transformers.AutoModelForCausalLM.from_pretrained(
      str(path), dtype=torch.float32))


@pytest.fixture
def single(tmp_path):
  """A folder with config.json and model.safetensors."""
  folder = tmp_path / "model"
  save_hf(tiny_model(), folder)
  return folder


@pytest.fixture
def sharded(tmp_path):
  """A folder with config.json, an index and several shards."""
  folder = tmp_path / "model"
  save_hf(tiny_model(), folder, max_shard_bytes=SHARD_BYTES)
  return folder


def read_index(folder) -> dict:
  return json.loads((folder / "model.safetensors.index.json").read_text())


def write_index(folder, index: dict) -> None:
  (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def edit_config(folder, **changes) -> None:
  path = folder / "config.json"
  config = {**json.loads(path.read_text()), **changes}
  path.write_text(json.dumps({k: v for k, v in config.items() if v is not None}))


def edit_tensors(folder, edit) -> None:
  path = str(folder / "model.safetensors")
  tensors = load_file(path)
  edit(tensors)
  save_file(tensors, path, metadata={"format": "pt"})


# --- Which weights: as transformers' from_pretrained ------------------------------

def folder_with_single_file_and_index(tmp_path):
  """model.safetensors from one model, an index and shards from another."""
  first, second = tiny_transformers_model(seed=1), tiny_transformers_model(seed=2)
  folder, other = tmp_path / "both", tmp_path / "other"
  first.save_pretrained(folder)
  second.save_pretrained(other, max_shard_size="20KB")
  shards = [f for f in os.listdir(other) if f.startswith("model-")]
  assert len(shards) > 1
  for file in shards + ["model.safetensors.index.json"]:
    shutil.copy(other / file, folder / file)
  return folder, first, second


def test_a_folder_with_both_single_file_and_index_loads_the_single_file(tmp_path):
  folder, first, second = folder_with_single_file_and_index(tmp_path)
  expected = transformers_logits_of(folder)
  np.testing.assert_allclose(expected, torch_logits(first), atol=1e-5, rtol=0)
  assert np.abs(expected - torch_logits(second)).max() > 0.1  # the two really differ
  np.testing.assert_allclose(our_logits(load_hf(folder)), expected, atol=1e-4, rtol=0)


def test_config_transformers_weights_chooses_the_file_as_in_transformers(tmp_path):
  folder, _, second = folder_with_single_file_and_index(tmp_path)
  edit_config(folder, transformers_weights="model.safetensors.index.json")
  expected = transformers_logits_of(folder)
  np.testing.assert_allclose(expected, torch_logits(second), atol=1e-5, rtol=0)
  np.testing.assert_allclose(our_logits(load_hf(folder)), expected, atol=1e-4, rtol=0)


def test_config_transformers_weights_outside_the_folder_is_refused(tmp_path, single):
  shutil.copy(single / "model.safetensors", tmp_path / OUTSIDE)
  edit_config(single, transformers_weights=f"../{OUTSIDE}")
  with pytest.raises(HFFormatError, match=re.escape(
      f"transformers_weights='../{OUTSIDE}' lies outside the model folder {single}")):
    load_hf(single)


# --- The index: only files inside the folder, all present -----------------------------

@pytest.mark.parametrize("entry", [
    "{outside}",                      # absolute
    f"../{OUTSIDE}",                  # parent
    f"nested/../../{OUTSIDE}",        # parent, hidden behind a folder
    "nested/../{shard}",              # '..' even where it would come back inside
])
def test_index_entries_outside_the_folder_are_refused(tmp_path, sharded, entry):
  index = read_index(sharded)
  name, shard = sorted(index["weight_map"].items())[0]
  shutil.copy(sharded / shard, tmp_path / OUTSIDE)  # a real file, were it read
  entry = entry.format(outside=tmp_path / OUTSIDE, shard=shard)
  index["weight_map"][name] = entry
  write_index(sharded, index)
  with pytest.raises(HFFormatError) as error:
    load_hf(sharded)
  assert f"weight_map[{name!r}]={entry!r} lies outside the model folder {sharded}" in str(
      error.value)


def test_missing_shard_files_are_named(sharded):
  shard = sorted(set(read_index(sharded)["weight_map"].values()))[1]
  os.remove(sharded / shard)
  with pytest.raises(HFFormatError, match=re.escape(
      f"model.safetensors.index.json lists shard files {sharded} lacks: ['{shard}']")):
    load_hf(sharded)


def test_a_tensor_in_two_shards_is_refused_naming_both(sharded):
  first, second = sorted(set(read_index(sharded)["weight_map"].values()))[:2]
  tensors = load_file(str(sharded / second))
  name, value = next(iter(load_file(str(sharded / first)).items()))
  save_file({**tensors, name: value}, str(sharded / second), metadata={"format": "pt"})
  with pytest.raises(HFFormatError, match=re.escape(
      f"tensor {name!r} is in both {sharded / first} and {sharded / second}")):
    load_hf(sharded)


def test_files_symlinked_from_outside_load_as_in_the_hub_cache(tmp_path, sharded):
  """The hub cache's snapshot folders hold symlinks into ../../blobs/; that is fine."""
  blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
  blobs.mkdir()
  snapshot.mkdir(parents=True)
  for file in os.listdir(sharded):
    shutil.move(sharded / file, blobs / file)
    os.symlink(os.path.join("..", "..", "blobs", file), snapshot / file)
  np.testing.assert_array_equal(our_logits(load_hf(snapshot)), our_logits(tiny_model()))


# --- Tensor values: floats only, non-finite ones reported ------------------------------

@pytest.mark.parametrize("dtype,kind", [(np.int32, "I32"), (np.int64, "I64"),
                                        (np.bool_, "BOOL")])
def test_non_float_weights_are_refused_naming_tensor_and_file(single, dtype, kind):
  edit_tensors(single, lambda t: t.update(
      {"model.norm.weight": np.ones(t["model.norm.weight"].shape, dtype)}))
  with pytest.raises(HFFormatError, match=re.escape(
      f"{single / 'model.safetensors'}: tensor 'model.norm.weight' has dtype {kind}; "
      "expected a float")):
    load_hf(single)


def test_non_finite_weights_warn_naming_tensor_and_count_and_still_load(single):
  name = "model.layers.0.mlp.up_proj.weight"

  def poison(tensors):
    tensors[name][0, :2] = np.nan
    tensors[name][3, 5] = -np.inf
  edit_tensors(single, poison)
  with pytest.warns(RuntimeWarning, match=re.escape(
      f"{single / 'model.safetensors'}: tensor {name!r} has 3 non-finite values")):
    model = load_hf(single)
  assert np.count_nonzero(~np.isfinite(np.asarray(model.layers[0].mlp.up_proj[...]))) == 3


# --- Parse errors name the file ----------------------------------------------------

def corrupt(folder, file: str, text: bytes) -> None:
  (folder / file).write_bytes(text)


def truncate(folder, file: str) -> None:
  data = (folder / file).read_bytes()
  (folder / file).write_bytes(data[:len(data) // 2])


@pytest.mark.parametrize("file,damage,fragment", [
    ("config.json", lambda f, n: corrupt(f, n, b'{"vocab_size": 101,'), "not valid JSON"),
    ("config.json", lambda f, n: corrupt(f, n, b"[1, 2]"), "holds a JSON list"),
    ("config.json", lambda f, n: corrupt(f, n, b"\xff\xfe"), "not valid JSON"),
    ("model.safetensors", lambda f, n: corrupt(f, n, b"not a safetensors file"),
     "not a readable safetensors file"),
    ("model.safetensors", lambda f, n: corrupt(f, n, b""), "not a readable safetensors"),
    ("model.safetensors", truncate, "not a readable safetensors file"),
])
def test_unparsable_files_are_named(single, file, damage, fragment):
  damage(single, file)
  with pytest.raises(HFFormatError, match=re.escape(f"{single / file}") + ".*" + fragment):
    load_hf(single)


@pytest.mark.parametrize("text,fragment", [
    (b'{"weight_map": {', "not valid JSON"),
    (b'{"metadata": {}}', "lacks a non-empty 'weight_map' object"),
    (b'{"weight_map": {"model.norm.weight": 7}}', "=7 is not a file name"),
])
def test_unparsable_index_is_named(sharded, text, fragment):
  corrupt(sharded, "model.safetensors.index.json", text)
  with pytest.raises(HFFormatError, match=re.escape(
      f"{sharded / 'model.safetensors.index.json'}") + ".*" + re.escape(fragment)):
    load_hf(sharded)


def test_truncated_shard_is_named(sharded):
  shard = sorted(set(read_index(sharded)["weight_map"].values()))[0]
  truncate(sharded, shard)
  with pytest.raises(HFFormatError, match=re.escape(
      f"{sharded / shard} is not a readable safetensors file")):
    load_hf(sharded)


@pytest.mark.parametrize("changes,fragment", [
    (dict(vocab_size=None), "lacks the required field 'vocab_size'"),
    (dict(num_hidden_layers=None), "lacks the required field 'num_hidden_layers'"),
    (dict(rms_norm_eps="tiny"), "rms_norm_eps='tiny' is invalid: expected a number"),
    (dict(rope_scaling="linear"), "rope_scaling='linear' is invalid: expected an object"),
    (dict(layer_types="full_attention"), "layer_types='full_attention'"),
])
def test_missing_or_malformed_config_fields_name_the_file(single, changes, fragment):
  edit_config(single, **changes)
  with pytest.raises(HFFormatError, match=re.escape(
      f"{single / 'config.json'} {fragment}")):
    load_hf(single)


def test_config_values_out_of_range_name_the_file(single):
  edit_config(single, num_attention_heads=3)
  with pytest.raises(ConfigError, match=re.escape(
      f"{single / 'config.json'} maps to an invalid ModelConfig") +
                     r".*num_kv_heads=2.*divisor of num_heads=3"):
    load_hf(single)


@pytest.mark.parametrize("field", ["param_dtype", "dtype"])
def test_caller_dtypes_other_than_float32_and_bfloat16_are_refused(single, field):
  with pytest.raises(ConfigError, match=f"load_hf.{field}='float16'.*'bfloat16'"):
    load_hf(single, **{field: "float16"})


# --- bfloat16 stays bfloat16 -------------------------------------------------------

def test_bfloat16_tensors_are_read_as_bfloat16_without_a_float32_copy(tmp_path):
  save_hf(tiny_model("bfloat16"), tmp_path)
  infos = tensor_infos(str(tmp_path), {})
  assert {info.dtype for info in infos.values()} == {"BF16"}
  for _, array in read_tensors(infos, list(infos)):
    assert array.dtype == ml_dtypes.bfloat16


def test_without_a_dtype_in_config_the_weights_dtype_is_used_as_transformers_does(
    tmp_path):
  save_hf(tiny_model("bfloat16"), tmp_path)
  edit_config(tmp_path, dtype=None, torch_dtype=None)
  assert transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).dtype == (
      torch.bfloat16)
  config = load_hf(tmp_path).config
  assert config.param_dtype == config.dtype == "bfloat16"


def test_config_dtype_wins_over_the_weights_dtype(tmp_path):
  save_hf(tiny_model("bfloat16"), tmp_path)
  edit_config(tmp_path, dtype="float32", torch_dtype="float32")
  model = load_hf(tmp_path)
  assert model.config.param_dtype == "float32"
  assert model.embed[...].dtype == jnp.float32
  with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
    assert f.get_slice("model.norm.weight").get_dtype() == "BF16"
