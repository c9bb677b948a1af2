"""EAGLE-3 heads in the public EAGLE / SpecForge checkpoint layout.

A head is a folder with config.json (a Llama config with ``draft_vocab_size``, one
hidden layer, ``architectures: ["LlamaForCausalLMEagle3"]``) and model.safetensors:
  fc.weight [H, 3H]; midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}
  .weight; midlayer.self_attn.{q,k,v}_proj.weight [heads * Dh, 2H]; o_proj [H, heads *
  Dh]; midlayer.mlp.{gate,up,down}_proj.weight; norm.weight; lm_head.weight [Vd, H];
  d2t [Vd] int64 *offsets* (target id = i + d2t[i]); t2d [V] bool (in the draft vocab).
The embedding is the target's and is usually absent (``embed_tokens.weight``, if
present, must match the target's shape and is used). The fused layers are read from
``eagle_config.eagle_aux_hidden_state_layer_ids`` when present (the key vLLM and SGLang
read), else EAGLE-3's default for the target's depth.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from specrl_jax.config import ConfigError
from specrl_jax.models.hf import LAYOUTS, HFFormatError
from specrl_jax.models.transformer import Transformer
from specrl_jax.speculative.drafters.eagle3 import (
    Eagle3, Eagle3Config, default_target_layers)

ARCHITECTURE = "LlamaForCausalLMEagle3"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
EMBEDDING = "embed_tokens.weight"

# Our path in the head -> (checkpoint name, layout in models.hf.LAYOUTS).
TENSORS: dict[tuple[str, ...], tuple[str, str]] = {
    ("fc",): ("fc.weight", "linear"),
    ("layer", "embed_norm", "scale"): ("midlayer.input_layernorm.weight", "same"),
    ("layer", "hidden_norm", "scale"): ("midlayer.hidden_norm.weight", "same"),
    ("layer", "attn", "q_proj"): ("midlayer.self_attn.q_proj.weight", "heads_out"),
    ("layer", "attn", "k_proj"): ("midlayer.self_attn.k_proj.weight", "heads_out"),
    ("layer", "attn", "v_proj"): ("midlayer.self_attn.v_proj.weight", "heads_out"),
    ("layer", "attn", "o_proj"): ("midlayer.self_attn.o_proj.weight", "heads_in"),
    ("layer", "post_attention_norm", "scale"): ("midlayer.post_attention_layernorm.weight",
                                                "same"),
    ("layer", "mlp", "gate_proj"): ("midlayer.mlp.gate_proj.weight", "linear"),
    ("layer", "mlp", "up_proj"): ("midlayer.mlp.up_proj.weight", "linear"),
    ("layer", "mlp", "down_proj"): ("midlayer.mlp.down_proj.weight", "linear"),
    ("final_norm", "scale"): ("norm.weight", "same"),
    ("lm_head",): ("lm_head.weight", "linear"),
}
_NUMPY_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def _config_json(config: Eagle3Config) -> dict[str, Any]:
  return {
      "architectures": [ARCHITECTURE],
      "model_type": "llama",
      "hidden_act": "silu",
      "hidden_size": config.hidden_size,
      "intermediate_size": config.intermediate_size,
      "num_attention_heads": config.num_heads,
      "num_key_value_heads": config.num_kv_heads,
      "head_dim": config.head_dim,
      "num_hidden_layers": 1,
      "rms_norm_eps": config.rms_norm_eps,
      "rope_theta": config.rope_theta,
      "rope_scaling": None,
      "max_position_embeddings": config.max_position_embeddings,
      "vocab_size": config.vocab_size,
      "draft_vocab_size": config.draft_vocab_size,
      "tie_word_embeddings": False,
      "torch_dtype": config.param_dtype,
      "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(config.target_layers),
                       "use_aux_hidden_state": True},
  }


def save_specforge(drafter: Eagle3, path: str | os.PathLike) -> None:
  """Writes ``drafter`` as an EAGLE / SpecForge folder (config.json, model.safetensors)."""
  if not isinstance(drafter, Eagle3):
    raise TypeError(f"save_specforge writes Eagle3 heads, got {type(drafter).__name__}.")
  path = os.fspath(path)
  os.makedirs(path, exist_ok=True)
  flat = dict(nnx.to_flat_state(drafter.weights["trainable"]))
  tensors = {}
  for our_path, (name, layout) in TENSORS.items():
    value = np.asarray(flat[our_path][...])
    tensors[name] = np.ascontiguousarray(LAYOUTS[layout].to_hf(value))
  table = np.asarray(drafter.draft_to_target, np.int64)
  tensors["d2t"] = table - np.arange(table.size, dtype=np.int64)
  t2d = np.zeros(drafter.vocab_size, bool)
  t2d[table] = True
  tensors["t2d"] = t2d
  save_file(tensors, os.path.join(path, WEIGHTS_FILE), metadata={"format": "pt"})
  with open(os.path.join(path, CONFIG_FILE), "w") as f:
    json.dump(_config_json(drafter.config), f, indent=2)


def _refuse(condition: bool, message: str) -> None:
  if condition:
    raise HFFormatError(message)


def _eagle3_config(hf: dict[str, Any], target: Transformer, path: str) -> Eagle3Config:
  names = hf.get("architectures") or []
  _refuse(names != [ARCHITECTURE] and not any("Eagle3" in n for n in names),
          f"{path}/config.json names architectures={names!r}; expected [{ARCHITECTURE!r}].")
  _refuse(hf.get("num_hidden_layers", 1) != 1,
          f"{path}/config.json has num_hidden_layers={hf.get('num_hidden_layers')}; an "
          "EAGLE-3 head has exactly 1.")
  _refuse(hf.get("hidden_act", "silu") != "silu",
          f"{path}/config.json hidden_act={hf.get('hidden_act')!r}; allowed: 'silu'.")
  _refuse(hf.get("rope_scaling") not in (None, {}),
          f"{path}/config.json rope_scaling={hf.get('rope_scaling')!r}; allowed: none.")
  t = target.config
  for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
    _refuse(key not in hf, f"{path}/config.json lacks the required field {key!r}.")
  hidden = hf["hidden_size"]
  fused_from = hf.get("target_hidden_size", hidden)
  if hidden != t.hidden_size or fused_from != t.hidden_size:
    raise ConfigError(
        f"{path} is an EAGLE-3 head for hidden_size={hidden} (target_hidden_size="
        f"{fused_from}) but the target has hidden_size={t.hidden_size}: a head trained "
        "for another target cannot read this one's hidden states.")
  if hf["vocab_size"] != t.vocab_size:
    raise ConfigError(
        f"{path} is an EAGLE-3 head for vocab_size={hf['vocab_size']} but the target has "
        f"vocab_size={t.vocab_size}: its draft vocabulary maps into another vocabulary.")
  eagle = hf.get("eagle_config") or {}
  layers = eagle.get("eagle_aux_hidden_state_layer_ids")
  layers = default_target_layers(t.num_layers) if layers is None else tuple(int(i) for i in layers)
  heads = hf["num_attention_heads"]
  stored = hf.get("torch_dtype") or hf.get("dtype")
  return Eagle3Config(
      hidden_size=hidden, intermediate_size=hf["intermediate_size"], num_heads=heads,
      num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hidden // heads, vocab_size=hf["vocab_size"],
      draft_vocab_size=hf.get("draft_vocab_size", hf["vocab_size"]), target_layers=layers,
      rope_theta=float(hf.get("rope_theta", 10000.0)),
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      max_position_embeddings=hf.get("max_position_embeddings", t.max_position_embeddings),
      param_dtype="bfloat16" if stored == "bfloat16" else "float32",
      dtype=t.dtype)


def load_specforge(path: str | os.PathLike, target: Transformer) -> Eagle3:
  """Reads an EAGLE / SpecForge EAGLE-3 folder as an ``Eagle3`` for ``target``."""
  path = os.fspath(path)
  _refuse(not os.path.exists(os.path.join(path, CONFIG_FILE)),
          f"{path} has no {CONFIG_FILE}; expected an EAGLE-3 head folder.")
  _refuse(not os.path.exists(os.path.join(path, WEIGHTS_FILE)),
          f"{path} has no {WEIGHTS_FILE}.")
  with open(os.path.join(path, CONFIG_FILE)) as f:
    config = _eagle3_config(json.load(f), target, path)
  with safe_open(os.path.join(path, WEIGHTS_FILE), framework="numpy") as f:
    tensors = {name: f.get_tensor(name) for name in f.keys()}
  wanted = {name for name, _ in TENSORS.values()} | {"d2t"}
  missing = sorted(wanted - set(tensors))
  _refuse(bool(missing), f"{path}/{WEIGHTS_FILE} lacks tensors {missing}.")
  extra = sorted(set(tensors) - wanted - {"t2d", EMBEDDING})
  _refuse(bool(extra), f"{path}/{WEIGHTS_FILE} holds tensors an EAGLE-3 head has no "
          f"place for: {extra}")

  offsets = np.asarray(tensors["d2t"]).astype(np.int64)
  table = offsets + np.arange(offsets.size, dtype=np.int64)
  if "t2d" in tensors:
    t2d = np.asarray(tensors["t2d"]).astype(bool)
    in_table = np.zeros(t2d.shape, bool)
    in_table[table[(table >= 0) & (table < t2d.size)]] = True
    _refuse(t2d.shape != (config.vocab_size,) or not np.array_equal(t2d, in_table),
            f"{path}: t2d (shape {t2d.shape}) does not mark exactly the target ids that d2t "
            "maps to.")
  # A fresh head: its weight variables are filled in place below.
  template = Eagle3.from_config(config, target, table)
  dtype = _NUMPY_DTYPES[config.param_dtype]
  flat = dict(nnx.to_flat_state(template.weights["trainable"]))
  for our_path, (name, layout_name) in TENSORS.items():
    variable = flat[our_path]
    shape = tuple(variable.shape)
    layout = LAYOUTS[layout_name]
    expected = layout.hf_shape(shape)
    if tuple(tensors[name].shape) != expected:
      raise ConfigError(f"{path}: tensor {name!r} has shape {tuple(tensors[name].shape)}; a "
                        f"head of this config.json for this target needs {expected}.")
    variable[...] = jnp.asarray(np.ascontiguousarray(
        layout.to_ours(tensors[name], shape)).astype(dtype))
  if EMBEDDING in tensors:
    embed = tensors[EMBEDDING]
    expected = (config.vocab_size, config.hidden_size)
    if tuple(embed.shape) != expected:
      raise ConfigError(f"{path}: {EMBEDDING} has shape {tuple(embed.shape)}; expected "
                        f"{expected}.")
    dict(nnx.to_flat_state(template.weights["shared"]))[("embed",)][...] = jnp.asarray(
        embed.astype(dtype))
  return template
