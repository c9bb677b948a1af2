"""Hugging Face checkpoint import and export for the Llama / Qwen2 / Qwen3 family.

A Hugging Face folder is config.json plus either one model.safetensors or several
shards listed in model.safetensors.index.json. Tensors are read and written with
safetensors' numpy API, one tensor at a time, and converted between Hugging Face's
``nn.Linear`` layout ([out, in], heads flattened) and ours (explicit head axes).

Anything this model cannot represent exactly (an o_proj bias, sliding windows, other
RoPE scalings, other activations) is refused with an error that says what was found
and what is allowed, never silently approximated.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import tokenizers
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from specrl_jax.config import ConfigError, ModelConfig
from specrl_jax.models.transformer import Transformer

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# Token strings given the pad / bos / eos roles when a tokenizer is saved with a model
# (the conventions of the built-in tokenizer in specrl_jax.models.tokenizer).
SPECIAL_TOKEN_ROLES = {"pad": "<pad>", "bos": "<bos>", "eos": "<eos>"}

_NUMPY_DTYPES = {"float32": np.dtype(np.float32),
                 "bfloat16": np.dtype(ml_dtypes.bfloat16)}
_SUPPORTED_ROPE_TYPES = ("default", "llama3")
# Buffers some older checkpoints carry; they are recomputed from the config.
_IGNORED_TENSORS = re.compile(r".*\.rotary_emb\.inv_freq$")


class HFFormatError(ValueError):
  """A Hugging Face folder this library cannot read, or a model it cannot write."""


# --- Architectures ---------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class Architecture:
  """One Hugging Face model class and the fixed features of its attention.

  qkv_bias: q/k/v projections always carry biases (Qwen2 has no config switch).
  bias_switch: name of the config flag that would add q/k/v *and o_proj* biases; we
    have no o_proj bias, so that flag must be false.
  """
  name: str
  model_type: str
  qk_norm: bool
  qkv_bias: bool
  bias_switch: str | None


ARCHITECTURES: dict[str, Architecture] = {
    arch.name: arch for arch in (
        Architecture(name="LlamaForCausalLM", model_type="llama", qk_norm=False,
                     qkv_bias=False, bias_switch="attention_bias"),
        Architecture(name="Qwen2ForCausalLM", model_type="qwen2", qk_norm=False,
                     qkv_bias=True, bias_switch=None),
        Architecture(name="Qwen3ForCausalLM", model_type="qwen3", qk_norm=True,
                     qkv_bias=False, bias_switch="attention_bias"),
    )
}


def architecture_for(config: ModelConfig) -> Architecture:
  """The Hugging Face class that represents ``config`` exactly."""
  if config.qk_norm and config.attention_bias:
    raise HFFormatError(
        "ModelConfig with qk_norm=True and attention_bias=True has no Hugging Face "
        "architecture: Qwen3ForCausalLM (qk_norm) only has q/k/v biases together with an "
        "o_proj bias. Allowed: qk_norm alone (Qwen3), attention_bias alone (Qwen2), neither "
        "(Llama).")
  if config.qk_norm:
    return ARCHITECTURES["Qwen3ForCausalLM"]
  if config.attention_bias:
    return ARCHITECTURES["Qwen2ForCausalLM"]
  return ARCHITECTURES["LlamaForCausalLM"]


# --- config.json <-> ModelConfig -------------------------------------------------

def _architecture_of(hf_config: dict[str, Any]) -> Architecture:
  """The architecture named by ``architectures`` (or, when absent, ``model_type``)."""
  names = hf_config.get("architectures") or []
  model_type = hf_config.get("model_type")
  if names:
    known = [ARCHITECTURES[n] for n in names if n in ARCHITECTURES]
    found = len(names) == 1 and len(known) == 1
  else:
    known = [a for a in ARCHITECTURES.values() if a.model_type == model_type]
    found = len(known) == 1
  _refuse(not found,
          f"config.json names architectures={names!r} model_type={model_type!r}; expected "
          f"exactly one of {sorted(ARCHITECTURES)} (or, without architectures, model_type "
          f"one of {sorted(a.model_type for a in ARCHITECTURES.values())}).")
  return known[0]


def _required(hf_config: dict[str, Any], key: str) -> Any:
  if key not in hf_config:
    raise HFFormatError(f"config.json lacks the required field {key!r}.")
  return hf_config[key]


def _refuse(condition: bool, message: str) -> None:
  if condition:
    raise HFFormatError(message)


def _rope(hf_config: dict[str, Any]) -> tuple[float, tuple[float, float, float, int] | None]:
  """(rope_theta, Llama-3 scaling) from either the transformers 5 ``rope_parameters``
  dict or the transformers 4 ``rope_theta`` + ``rope_scaling`` fields."""
  params = dict(hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {})
  theta = params.get("rope_theta", hf_config.get("rope_theta", 10000.0))
  rope_type = params.get("rope_type", params.get("type", "default"))
  _refuse(rope_type not in _SUPPORTED_ROPE_TYPES,
          f"config.json RoPE type {rope_type!r} is unsupported; allowed: "
          f"{_SUPPORTED_ROPE_TYPES}.")
  partial = params.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0))
  _refuse(partial not in (None, 1, 1.0),
          f"config.json partial_rotary_factor={partial!r} is unsupported; allowed: 1.0.")
  if rope_type == "default":
    return float(theta), None
  for key in ("factor", "low_freq_factor", "high_freq_factor"):
    _refuse(key not in params, f"config.json llama3 RoPE scaling lacks {key!r}.")
  original_max = params.get("original_max_position_embeddings",
                            hf_config.get("max_position_embeddings"))
  _refuse(original_max is None, "config.json llama3 RoPE scaling lacks "
          "'original_max_position_embeddings' (and there is no max_position_embeddings).")
  scaling = (float(params["factor"]), float(params["low_freq_factor"]),
             float(params["high_freq_factor"]), int(original_max))
  return float(theta), scaling


def _checkpoint_dtype(hf_config: dict[str, Any]) -> str:
  stored = hf_config.get("dtype") or hf_config.get("torch_dtype")
  return "bfloat16" if stored == "bfloat16" else "float32"


def model_config_from_hf(hf_config: dict[str, Any], *, param_dtype: str | None = None,
                         dtype: str | None = None) -> ModelConfig:
  """ModelConfig equivalent to a parsed config.json; refuses what we cannot run exactly.

  param_dtype defaults to the checkpoint's dtype when it is bfloat16, else float32
  (float16 is upcast losslessly); dtype (compute) defaults to param_dtype.
  """
  arch = _architecture_of(hf_config)
  _refuse(hf_config.get("hidden_act", "silu") != "silu",
          f"config.json hidden_act={hf_config.get('hidden_act')!r} is unsupported; "
          "allowed: 'silu'.")
  _refuse(bool(hf_config.get("mlp_bias", False)),
          "config.json mlp_bias=True is unsupported; allowed: false.")
  if arch.bias_switch is not None:
    _refuse(bool(hf_config.get(arch.bias_switch, False)),
            f"config.json {arch.bias_switch}=True is unsupported for {arch.name}: it adds an "
            "o_proj bias this model does not have; allowed: false (q/k/v-only biases are "
            "Qwen2ForCausalLM).")
  _refuse(bool(hf_config.get("use_sliding_window", False)),
          "config.json use_sliding_window=True is unsupported; allowed: false (full "
          "attention in every layer).")
  layer_types = set(hf_config.get("layer_types") or ())
  _refuse(not layer_types <= {"full_attention"},
          f"config.json layer_types contains {sorted(layer_types - {'full_attention'})}; "
          "allowed: only 'full_attention'.")
  theta, llama3_scaling = _rope(hf_config)
  hidden = _required(hf_config, "hidden_size")
  heads = _required(hf_config, "num_attention_heads")
  param_dtype = param_dtype or _checkpoint_dtype(hf_config)
  try:
    return ModelConfig(
        vocab_size=_required(hf_config, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_required(hf_config, "intermediate_size"),
        num_layers=_required(hf_config, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=hf_config.get("num_key_value_heads") or heads,
        head_dim=hf_config.get("head_dim") or (
            hidden // heads if isinstance(hidden, int) and isinstance(heads, int)
            and heads > 0 else 0),
        rope_theta=theta,
        rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        qk_norm=arch.qk_norm,
        attention_bias=arch.qkv_bias,
        max_position_embeddings=hf_config.get("max_position_embeddings", 32768),
        rope_llama3_scaling=llama3_scaling,
        param_dtype=param_dtype,
        dtype=dtype or param_dtype,
    )
  except ConfigError as error:
    raise ConfigError(f"config.json maps to an invalid ModelConfig: {error}") from error


def hf_config_from_model(config: ModelConfig) -> dict[str, Any]:
  """config.json contents that transformers' AutoModelForCausalLM loads as ``config``.

  RoPE is written in both the transformers 5 (``rope_parameters``) and the 4.x
  (``rope_theta`` + ``rope_scaling``) spellings so either version reads it.
  """
  arch = architecture_for(config)
  rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
  rope_scaling = None
  if config.rope_llama3_scaling is not None:
    factor, low, high, original_max = config.rope_llama3_scaling
    rope_scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": original_max}
    rope_parameters = {**rope_scaling, "rope_theta": config.rope_theta}
  hf_config: dict[str, Any] = {
      "architectures": [arch.name],
      "model_type": arch.model_type,
      "vocab_size": config.vocab_size,
      "hidden_size": config.hidden_size,
      "intermediate_size": config.intermediate_size,
      "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads,
      "num_key_value_heads": config.num_kv_heads,
      "head_dim": config.head_dim,
      "hidden_act": "silu",
      "rms_norm_eps": config.rms_norm_eps,
      "tie_word_embeddings": config.tie_embeddings,
      "max_position_embeddings": config.max_position_embeddings,
      "rope_theta": config.rope_theta,
      "rope_scaling": rope_scaling,
      "rope_parameters": rope_parameters,
      "attention_dropout": 0.0,
      "dtype": config.param_dtype,
      "torch_dtype": config.param_dtype,
  }
  if arch.bias_switch is not None:
    hf_config[arch.bias_switch] = False
  if arch.model_type == "llama":
    hf_config["mlp_bias"] = False
  else:
    hf_config["use_sliding_window"] = False
  return hf_config


# --- Tensor layouts ----------------------------------------------------------------

@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
  """How one of our tensors is laid out in a Hugging Face checkpoint.

  to_ours(hf_array, our_shape) and to_hf(our_array) convert values; hf_shape(our_shape)
  is what the checkpoint must hold.
  """
  to_ours: Callable[[np.ndarray, tuple[int, ...]], np.ndarray]
  to_hf: Callable[[np.ndarray], np.ndarray]
  hf_shape: Callable[[tuple[int, ...]], tuple[int, ...]]


LAYOUTS: dict[str, Layout] = {
    # Norm scales and the [V, D] embedding are stored identically.
    "same": Layout(to_ours=lambda w, shape: w, to_hf=lambda w: w,
                   hf_shape=lambda shape: shape),
    # nn.Linear stores [out, in]; we store [in, out] (lm_head, MLP projections).
    "linear": Layout(to_ours=lambda w, shape: w.T, to_hf=lambda w: w.T,
                     hf_shape=lambda shape: shape[::-1]),
    # q/k/v: [heads * head_dim, D] -> [D, heads, head_dim].
    "heads_out": Layout(to_ours=lambda w, shape: w.T.reshape(shape),
                        to_hf=lambda w: w.reshape(w.shape[0], -1).T,
                        hf_shape=lambda shape: (shape[1] * shape[2], shape[0])),
    # o_proj: [D, heads * head_dim] -> [heads, head_dim, D].
    "heads_in": Layout(to_ours=lambda w, shape: w.T.reshape(shape),
                       to_hf=lambda w: w.reshape(-1, w.shape[-1]).T,
                       hf_shape=lambda shape: (shape[2], shape[0] * shape[1])),
    # q/k/v biases: [heads * head_dim] -> [heads, head_dim].
    "head_bias": Layout(to_ours=lambda w, shape: w.reshape(shape),
                        to_hf=lambda w: w.reshape(-1),
                        hf_shape=lambda shape: (shape[0] * shape[1],)),
}


def _hf_name_and_layout(path: tuple[Any, ...]) -> tuple[str, str]:
  """Checkpoint name and layout of the parameter at our nnx state ``path``."""
  if path == ("embed",):
    return "model.embed_tokens.weight", "same"
  if path == ("lm_head",):
    return "lm_head.weight", "linear"
  if path == ("final_norm", "scale"):
    return "model.norm.weight", "same"
  _, layer, *rest = path
  prefix = f"model.layers.{layer}"
  names = {
      ("input_norm", "scale"): ("input_layernorm.weight", "same"),
      ("post_attention_norm", "scale"): ("post_attention_layernorm.weight", "same"),
      ("attn", "q_proj"): ("self_attn.q_proj.weight", "heads_out"),
      ("attn", "k_proj"): ("self_attn.k_proj.weight", "heads_out"),
      ("attn", "v_proj"): ("self_attn.v_proj.weight", "heads_out"),
      ("attn", "o_proj"): ("self_attn.o_proj.weight", "heads_in"),
      ("attn", "q_bias"): ("self_attn.q_proj.bias", "head_bias"),
      ("attn", "k_bias"): ("self_attn.k_proj.bias", "head_bias"),
      ("attn", "v_bias"): ("self_attn.v_proj.bias", "head_bias"),
      ("attn", "q_norm", "scale"): ("self_attn.q_norm.weight", "same"),
      ("attn", "k_norm", "scale"): ("self_attn.k_norm.weight", "same"),
      ("mlp", "gate_proj"): ("mlp.gate_proj.weight", "linear"),
      ("mlp", "up_proj"): ("mlp.up_proj.weight", "linear"),
      ("mlp", "down_proj"): ("mlp.down_proj.weight", "linear"),
  }
  name, layout = names[tuple(rest)]
  return f"{prefix}.{name}", layout


# --- Reading -------------------------------------------------------------------

def _read_json(path: str) -> dict[str, Any]:
  with open(path) as f:
    return json.load(f)


def _tensor_files(path: str) -> dict[str, str]:
  """Checkpoint tensor name -> the safetensors file holding it."""
  index_path = os.path.join(path, INDEX_FILE)
  if os.path.exists(index_path):
    weight_map = _read_json(index_path).get("weight_map")
    _refuse(not isinstance(weight_map, dict),
            f"{index_path} lacks a 'weight_map' object.")
    return {name: os.path.join(path, file) for name, file in weight_map.items()}
  single = os.path.join(path, SINGLE_FILE)
  _refuse(not os.path.exists(single),
          f"{path} holds neither {SINGLE_FILE} nor {INDEX_FILE}.")
  with safe_open(single, framework="numpy") as f:
    return {name: single for name in f.keys()}


def _read_tensors(files: dict[str, str], names: list[str]) -> Iterator[tuple[str, np.ndarray]]:
  """Yields (name, array) opening each file once, in the order of the files."""
  by_file: dict[str, list[str]] = {}
  for name in names:
    by_file.setdefault(files[name], []).append(name)
  for file, file_names in by_file.items():
    with safe_open(file, framework="numpy") as f:
      for name in file_names:
        yield name, f.get_tensor(name)


def load_hf(path: str | os.PathLike, *, param_dtype: str | None = None,
            dtype: str | None = None) -> Transformer:
  """Loads a Llama / Qwen2 / Qwen3 Hugging Face folder as a Transformer.

  param_dtype: storage dtype ("float32" | "bfloat16"); default the checkpoint's
  bfloat16, else float32. dtype: compute dtype; default param_dtype.
  """
  path = os.fspath(path)
  _refuse(not os.path.exists(os.path.join(path, CONFIG_FILE)),
          f"{path} has no {CONFIG_FILE}; expected a Hugging Face model folder.")
  config = model_config_from_hf(_read_json(os.path.join(path, CONFIG_FILE)),
                                param_dtype=param_dtype, dtype=dtype)
  # Shapes only: no random initialisation of weights about to be overwritten.
  abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
  graphdef, abstract_state = nnx.split(abstract)
  wanted = {}  # checkpoint name -> (our path, layout, our shape, variable)
  for our_path, variable in nnx.to_flat_state(abstract_state):
    name, layout = _hf_name_and_layout(our_path)
    wanted[name] = (our_path, layout, tuple(variable.shape), variable)

  files = _tensor_files(path)
  present = set(files)
  missing = sorted(set(wanted) - present)
  _refuse(bool(missing), f"{path} lacks tensors its config.json requires: {missing}")
  extra = sorted(n for n in present - set(wanted) if not _IGNORED_TENSORS.match(n))
  tied_head = config.tie_embeddings and "lm_head.weight" in extra
  if tied_head:  # Some tied checkpoints repeat the embedding; it must be a true copy.
    extra.remove("lm_head.weight")
  _refuse(bool(extra), f"{path} holds tensors this model has no place for: {extra}")

  target_dtype = _NUMPY_DTYPES[config.param_dtype]
  values = {}
  for name, array in _read_tensors(files, sorted(wanted)):
    our_path, layout_name, shape, _ = wanted[name]
    layout = LAYOUTS[layout_name]
    expected = layout.hf_shape(shape)
    _refuse(tuple(array.shape) != expected,
            f"tensor {name!r} has shape {tuple(array.shape)}; expected {expected}.")
    values[our_path] = jnp.asarray(
        np.ascontiguousarray(layout.to_ours(array, shape)).astype(target_dtype))
  if tied_head:
    (_, head), = _read_tensors(files, ["lm_head.weight"])
    embed = values[("embed",)]
    _refuse(head.shape != embed.shape or not np.array_equal(
        head.astype(target_dtype), np.asarray(embed)),
            "config.json ties embeddings but lm_head.weight differs from "
            "model.embed_tokens.weight; allowed: an identical copy or no lm_head.weight.")

  state = nnx.from_flat_state([(our_path, variable.replace(values[our_path]))
                               for our_path, _, _, variable in wanted.values()])
  return nnx.merge(graphdef, state)


def load_tokenizer(path: str | os.PathLike) -> tokenizers.Tokenizer | None:
  """The folder's tokenizer.json as a ``tokenizers.Tokenizer``; None when absent."""
  file = os.path.join(os.fspath(path), TOKENIZER_FILE)
  return tokenizers.Tokenizer.from_file(file) if os.path.exists(file) else None


# --- Writing -------------------------------------------------------------------

def _shards(sizes: list[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
  """Greedy packing in order; a tensor larger than the limit gets a shard alone."""
  shards: list[list[str]] = [[]]
  used = 0
  for name, size in sizes:
    if shards[-1] and used + size > max_shard_bytes:
      shards.append([])
      used = 0
    shards[-1].append(name)
    used += size
  return shards


def _special_token_ids(tokenizer: tokenizers.Tokenizer) -> dict[str, int]:
  ids = {role: tokenizer.token_to_id(token) for role, token in SPECIAL_TOKEN_ROLES.items()}
  return {role: i for role, i in ids.items() if i is not None}


def _remove_old_weights(path: str) -> None:
  """Stale shards from an earlier save would otherwise mix with the new ones."""
  for file in os.listdir(path):
    if file in (SINGLE_FILE, INDEX_FILE) or re.fullmatch(
        r"model-\d+-of-\d+\.safetensors", file):
      os.remove(os.path.join(path, file))


def save_hf(model: Transformer, path: str | os.PathLike, *,
            tokenizer: tokenizers.Tokenizer | None = None,
            max_shard_bytes: int = 4 * 2**30) -> None:
  """Writes ``model`` as a Hugging Face folder that AutoModelForCausalLM loads.

  The architecture follows the config (qk_norm -> Qwen3, attention_bias -> Qwen2,
  else Llama). Weights larger than ``max_shard_bytes`` are split into shards listed
  in model.safetensors.index.json. With ``tokenizer``, tokenizer.json and a
  tokenizer_config.json are written too, and "<pad>"/"<bos>"/"<eos>" tokens, when the
  vocabulary has them, become the pad/bos/eos ids of config.json.
  """
  if not (isinstance(max_shard_bytes, int) and max_shard_bytes > 0):
    raise ConfigError(f"save_hf.max_shard_bytes={max_shard_bytes!r} is invalid: "
                      "expected a positive integer.")
  config = model.config
  path = os.fspath(path)
  hf_config = hf_config_from_model(config)
  os.makedirs(path, exist_ok=True)
  _remove_old_weights(path)

  params = {p: v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  names = {}
  for our_path in params:
    name, layout = _hf_name_and_layout(our_path)
    names[name] = (our_path, layout)
  ordered = sorted(names)
  sizes = [(n, params[names[n][0]].size * params[names[n][0]].dtype.itemsize) for n in ordered]
  shards = _shards(sizes, max_shard_bytes)
  metadata = {"format": "pt"}  # transformers refuses safetensors without it

  def hf_array(name: str) -> np.ndarray:
    our_path, layout = names[name]
    return np.ascontiguousarray(LAYOUTS[layout].to_hf(np.asarray(params[our_path][...])))

  if len(shards) == 1:
    save_file({n: hf_array(n) for n in ordered}, os.path.join(path, SINGLE_FILE),
              metadata=metadata)
  else:
    weight_map = {}
    for i, shard in enumerate(shards):
      file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      save_file({n: hf_array(n) for n in shard}, os.path.join(path, file), metadata=metadata)
      weight_map.update({n: file for n in shard})
    index = {"metadata": {"total_size": sum(size for _, size in sizes)},
             "weight_map": weight_map}
    with open(os.path.join(path, INDEX_FILE), "w") as f:
      json.dump(index, f, indent=2)

  if tokenizer is not None:
    special = _special_token_ids(tokenizer)
    hf_config.update({f"{role}_token_id": i for role, i in special.items()})
    tokenizer.save(os.path.join(path, TOKENIZER_FILE))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast",
                        **{f"{role}_token": SPECIAL_TOKEN_ROLES[role] for role in special}}
    with open(os.path.join(path, TOKENIZER_CONFIG_FILE), "w") as f:
      json.dump(tokenizer_config, f, indent=2)
  with open(os.path.join(path, CONFIG_FILE), "w") as f:
    json.dump(hf_config, f, indent=2)
