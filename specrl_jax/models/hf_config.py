"""config.json <-> ModelConfig for the Llama / Qwen2 / Qwen3 family.

Anything this model cannot represent exactly (an o_proj bias, sliding windows, other
RoPE scalings, other activations) is refused with an error that says what was found
and what is allowed, never silently approximated. Messages name fields as
"config.json <field>"; load_hf adds the folder.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from specrl_jax.config import ConfigError, ModelConfig
from specrl_jax.models.hf_files import HFFormatError, refuse

_SUPPORTED_ROPE_TYPES = ("default", "llama3")


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


# --- config.json -> ModelConfig ----------------------------------------------------

def _architecture_of(hf_config: dict[str, Any]) -> Architecture:
  """The architecture named by ``architectures`` (or, when absent, ``model_type``)."""
  names = hf_config.get("architectures") or []
  model_type = hf_config.get("model_type")
  if isinstance(names, list) and names:
    known = [ARCHITECTURES[n] for n in names if isinstance(n, str) and n in ARCHITECTURES]
    found = len(names) == 1 and len(known) == 1
  else:
    known = [a for a in ARCHITECTURES.values() if a.model_type == model_type]
    found = isinstance(names, list) and len(known) == 1
  refuse(not found,
         f"config.json names architectures={names!r} model_type={model_type!r}; expected "
         f"exactly one of {sorted(ARCHITECTURES)} (or, without architectures, model_type "
         f"one of {sorted(a.model_type for a in ARCHITECTURES.values())}).")
  return known[0]


def _required(hf_config: dict[str, Any], key: str) -> Any:
  refuse(key not in hf_config, f"config.json lacks the required field {key!r}.")
  return hf_config[key]


def _number(value: Any, field: str) -> float:
  refuse(isinstance(value, bool) or not isinstance(value, (int, float)),
         f"config.json {field}={value!r} is invalid: expected a number.")
  return float(value)


def _mapping(value: Any, field: str) -> dict[str, Any]:
  refuse(value is not None and not isinstance(value, dict),
         f"config.json {field}={value!r} is invalid: expected an object or null.")
  return dict(value or {})


def _rope(hf_config: dict[str, Any]) -> tuple[float, tuple[float, float, float, int] | None]:
  """(rope_theta, Llama-3 scaling) from either the transformers 5 ``rope_parameters``
  dict or the transformers 4 ``rope_theta`` + ``rope_scaling`` fields."""
  field = "rope_scaling" if hf_config.get("rope_scaling") else "rope_parameters"
  params = _mapping(hf_config.get(field), field)
  theta = _number(params.get("rope_theta", hf_config.get("rope_theta", 10000.0)),
                  "rope_theta")
  rope_type = params.get("rope_type", params.get("type", "default"))
  refuse(rope_type not in _SUPPORTED_ROPE_TYPES,
         f"config.json RoPE type {rope_type!r} is unsupported; allowed: "
         f"{_SUPPORTED_ROPE_TYPES}.")
  partial = params.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0))
  refuse(partial not in (None, 1, 1.0),
         f"config.json partial_rotary_factor={partial!r} is unsupported; allowed: 1.0.")
  if rope_type == "default":
    return theta, None
  for key in ("factor", "low_freq_factor", "high_freq_factor"):
    refuse(key not in params, f"config.json llama3 RoPE scaling lacks {key!r}.")
  original_max = params.get("original_max_position_embeddings",
                            hf_config.get("max_position_embeddings"))
  refuse(original_max is None, "config.json llama3 RoPE scaling lacks "
         "'original_max_position_embeddings' (and there is no max_position_embeddings).")
  refuse(isinstance(original_max, bool) or not isinstance(original_max, int),
         f"config.json original_max_position_embeddings={original_max!r} is invalid: "
         "expected an integer.")
  scaling = (_number(params["factor"], "factor"),
             _number(params["low_freq_factor"], "low_freq_factor"),
             _number(params["high_freq_factor"], "high_freq_factor"), original_max)
  return theta, scaling


def checkpoint_dtype(hf_config: dict[str, Any], weights_dtype: str | None) -> str:
  """The param_dtype a checkpoint loads as when the caller names none.

  As transformers' dtype="auto": config.json's ``dtype`` (transformers 5) or
  ``torch_dtype`` (4.x), else ``weights_dtype``, the dtype of the checkpoint's first
  floating tensor. bfloat16 stays bfloat16; everything else (float16, float64) is
  loaded as float32, the one other storage dtype this model has.
  """
  stored = hf_config.get("dtype") or hf_config.get("torch_dtype") or weights_dtype
  return "bfloat16" if stored == "bfloat16" else "float32"


def model_config_from_hf(hf_config: dict[str, Any], *, param_dtype: str | None = None,
                         dtype: str | None = None,
                         weights_dtype: str | None = None) -> ModelConfig:
  """ModelConfig equivalent to a parsed config.json; refuses what we cannot run exactly.

  param_dtype defaults to checkpoint_dtype(hf_config, weights_dtype); dtype (compute)
  defaults to param_dtype.
  """
  arch = _architecture_of(hf_config)
  refuse(hf_config.get("hidden_act", "silu") != "silu",
         f"config.json hidden_act={hf_config.get('hidden_act')!r} is unsupported; "
         "allowed: 'silu'.")
  refuse(bool(hf_config.get("mlp_bias", False)),
         "config.json mlp_bias=True is unsupported; allowed: false.")
  if arch.bias_switch is not None:
    refuse(bool(hf_config.get(arch.bias_switch, False)),
           f"config.json {arch.bias_switch}=True is unsupported for {arch.name}: it adds an "
           "o_proj bias this model does not have; allowed: false (q/k/v-only biases are "
           "Qwen2ForCausalLM).")
  refuse(bool(hf_config.get("use_sliding_window", False)),
         "config.json use_sliding_window=True is unsupported; allowed: false (full "
         "attention in every layer).")
  layer_types = hf_config.get("layer_types") or []
  refuse(not isinstance(layer_types, list)
         or any(kind != "full_attention" for kind in layer_types),
         f"config.json layer_types={layer_types!r} is unsupported; allowed: a list of "
         "only 'full_attention'.")
  theta, llama3_scaling = _rope(hf_config)
  hidden = _required(hf_config, "hidden_size")
  heads = _required(hf_config, "num_attention_heads")
  param_dtype = param_dtype or checkpoint_dtype(hf_config, weights_dtype)
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
        rms_norm_eps=_number(hf_config.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
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


# --- ModelConfig -> config.json ----------------------------------------------------

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
