"""Hugging Face checkpoint import and export for the Llama / Qwen2 / Qwen3 family.

A Hugging Face folder is config.json plus either one model.safetensors or several
shards listed in model.safetensors.index.json. The pieces live in sibling modules:
hf_files (which files hold the weights, reading them, errors naming the file),
hf_config (config.json <-> ModelConfig) and hf_layout (tensor names and layouts).
Tensors are read and written with safetensors' numpy API, one tensor at a time, in
the checkpoint's own dtype.
"""

from __future__ import annotations

import json
import os
import re
import warnings

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import tokenizers
from flax import nnx
from safetensors.numpy import save_file

from specrl_jax.config import ConfigError, ModelConfig, check
from specrl_jax.models.hf_config import (  # noqa: F401  (the module's public names)
    ARCHITECTURES, Architecture, architecture_for, hf_config_from_model,
    model_config_from_hf)
from specrl_jax.models.hf_files import (  # noqa: F401
    CONFIG_FILE, FLOAT_DTYPES, INDEX_FILE, SINGLE_FILE, TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE, HFFormatError, read_json, read_tensors, refuse, tensor_infos,
    weights_dtype)
from specrl_jax.models.hf_layout import LAYOUTS, Layout, hf_name_and_layout  # noqa: F401
from specrl_jax.models.text_tokenizer import TextTokenizer
from specrl_jax.models.transformer import Transformer

# Token strings given the pad / bos / eos roles when a tokenizer is saved with a model
# (the conventions of the built-in tokenizer in specrl_jax.models.tokenizer).
SPECIAL_TOKEN_ROLES = {"pad": "<pad>", "bos": "<bos>", "eos": "<eos>"}

_NUMPY_DTYPES = {"float32": np.dtype(np.float32),
                 "bfloat16": np.dtype(ml_dtypes.bfloat16)}
# Buffers some older checkpoints carry; they are recomputed from the config.
_IGNORED_TENSORS = re.compile(r".*\.rotary_emb\.inv_freq$")


# --- Reading -------------------------------------------------------------------

def load_hf(path: str | os.PathLike, *, param_dtype: str | None = None,
            dtype: str | None = None) -> Transformer:
  """Loads a Llama / Qwen2 / Qwen3 Hugging Face folder as a Transformer.

  The weights come from the file transformers' from_pretrained would read (see
  hf_files). param_dtype: storage dtype ("float32" | "bfloat16"); default the
  checkpoint's (config.json's dtype / torch_dtype, else its weights'), bfloat16 kept,
  anything else float32. dtype: compute dtype; default param_dtype. Non-float tensors
  are refused; non-finite values are loaded, with a RuntimeWarning per tensor.
  """
  for field, value in (("param_dtype", param_dtype), ("dtype", dtype)):
    check(value is None or value in _NUMPY_DTYPES, "load_hf", field, value,
          f"None (the checkpoint's) or one of {tuple(_NUMPY_DTYPES)}")
  path = os.fspath(path)
  config, infos = _config_and_tensors(path, param_dtype=param_dtype, dtype=dtype)
  # Shapes only: no random initialisation of weights about to be overwritten.
  abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
  graphdef, abstract_state = nnx.split(abstract)
  wanted = {}  # checkpoint name -> (our path, layout, checkpoint shape, variable)
  for our_path, variable in nnx.to_flat_state(abstract_state):
    name, layout = hf_name_and_layout(our_path)
    wanted[name] = (our_path, layout, LAYOUTS[layout].hf_shape(variable.shape), variable)

  missing = sorted(set(wanted) - set(infos))
  refuse(bool(missing), f"{path} lacks tensors its config.json requires: {missing}")
  extra = sorted(n for n in set(infos) - set(wanted) if not _IGNORED_TENSORS.match(n))
  tied_head = config.tie_embeddings and "lm_head.weight" in extra
  if tied_head:  # Some tied checkpoints repeat the embedding; it must be a true copy.
    extra.remove("lm_head.weight")
  refuse(bool(extra), f"{path} holds tensors this model has no place for: {extra}")
  expected_shapes = {name: shape for name, (_, _, shape, _) in wanted.items()}
  if tied_head:
    expected_shapes["lm_head.weight"] = expected_shapes["model.embed_tokens.weight"]
  for name, expected in expected_shapes.items():  # from the headers, before any data
    info = infos[name]
    refuse(info.dtype not in FLOAT_DTYPES,
           f"{info.file}: tensor {name!r} has dtype {info.dtype}; expected a float "
           f"weight, one of {sorted(FLOAT_DTYPES)}.")
    refuse(info.shape != expected,
           f"{info.file}: tensor {name!r} has shape {info.shape}; expected {expected}.")

  target_dtype = _NUMPY_DTYPES[config.param_dtype]
  values = {}
  for name, array in read_tensors(infos, list(wanted)):
    non_finite = array.size - np.count_nonzero(np.isfinite(array))
    if non_finite:
      warnings.warn(f"{infos[name].file}: tensor {name!r} has {non_finite} non-finite "
                    f"values (NaN or inf) of {array.size}; loaded as they are.",
                    RuntimeWarning, stacklevel=2)
    our_path, layout, _, variable = wanted[name]
    ours = LAYOUTS[layout].to_ours(array, tuple(variable.shape))
    values[our_path] = jnp.asarray(np.ascontiguousarray(ours).astype(target_dtype,
                                                                     copy=False))
  if tied_head:
    (_, head), = read_tensors(infos, ["lm_head.weight"])
    refuse(not np.array_equal(head.astype(target_dtype), np.asarray(values[("embed",)]),
                              equal_nan=True),
           f"{infos['lm_head.weight'].file}: config.json ties embeddings but "
           "lm_head.weight differs from model.embed_tokens.weight; allowed: an identical "
           "copy or no lm_head.weight.")

  state = nnx.from_flat_state([(our_path, variable.replace(values[our_path]))
                               for our_path, _, _, variable in wanted.values()])
  return nnx.merge(graphdef, state)


def read_hf_model_config(path: str | os.PathLike) -> ModelConfig:
  """The ModelConfig of the Hugging Face folder ``path``, from its config.json and its
  weights' headers (no tensor data is read): the checks ``load_hf`` makes before any
  work, so a folder without weights or of an unsupported architecture is refused now."""
  return _config_and_tensors(os.fspath(path))[0]


def _config_and_tensors(path: str, *, param_dtype: str | None = None,
                        dtype: str | None = None):
  refuse(not os.path.exists(path), f"the model folder {path} does not exist.")
  config_file = os.path.join(path, CONFIG_FILE)
  refuse(not os.path.isfile(config_file),
         f"{path} has no {CONFIG_FILE}; expected a Hugging Face model folder.")
  hf_config = read_json(config_file)
  infos = tensor_infos(path, hf_config)
  try:
    config = model_config_from_hf(hf_config, param_dtype=param_dtype, dtype=dtype,
                                  weights_dtype=weights_dtype(infos))
  except (HFFormatError, ConfigError) as error:  # "config.json ..." -> its full path
    raise type(error)(re.sub(r"^config\.json\b", lambda _: config_file, str(error))
                      ) from error
  return config, infos


def load_tokenizer(path: str | os.PathLike) -> TextTokenizer | None:
  """The folder's tokenizer as a ``TextTokenizer`` (tokenizer.json with the chat
  template, special tokens and eos ids of its tokenizer_config.json,
  generation_config.json and config.json: what ``apply_chat_template`` and generate()
  read); None when the folder has no tokenizer.json. The raw ``tokenizers.Tokenizer``
  is its ``.tokenizer``."""
  file = os.path.join(os.fspath(path), TOKENIZER_FILE)
  return TextTokenizer.from_pretrained(path) if os.path.exists(file) else None


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
            tokenizer: tokenizers.Tokenizer | TextTokenizer | None = None,
            max_shard_bytes: int = 4 * 2**30) -> None:
  """Writes ``model`` as a Hugging Face folder that AutoModelForCausalLM loads.

  The architecture follows the config (qk_norm -> Qwen3, attention_bias -> Qwen2,
  else Llama). Weights larger than ``max_shard_bytes`` are split into shards listed
  in model.safetensors.index.json. With ``tokenizer``, tokenizer.json and a
  tokenizer_config.json are written too, and "<pad>"/"<bos>"/"<eos>" tokens, when the
  vocabulary has them, become the pad/bos/eos ids of config.json; a ``TextTokenizer``
  writes its own roles, chat template and generation_config.json eos ids.
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
    name, layout = hf_name_and_layout(our_path)
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

  if isinstance(tokenizer, TextTokenizer):  # its own roles, chat template and eos ids
    tokenizer.save(path)
    hf_config.update({"eos_token_id": tokenizer.eos_ids[0],
                      **{f"{role}_token_id": i for role, i in
                         (("bos", tokenizer.bos_id), ("pad", tokenizer.pad_id)) if i is not None}})
  elif tokenizer is not None:
    special = _special_token_ids(tokenizer)
    hf_config.update({f"{role}_token_id": i for role, i in special.items()})
    tokenizer.save(os.path.join(path, TOKENIZER_FILE))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast",
                        **{f"{role}_token": SPECIAL_TOKEN_ROLES[role] for role in special}}
    with open(os.path.join(path, TOKENIZER_CONFIG_FILE), "w") as f:
      json.dump(tokenizer_config, f, indent=2)
  with open(os.path.join(path, CONFIG_FILE), "w") as f:
    json.dump(hf_config, f, indent=2)
