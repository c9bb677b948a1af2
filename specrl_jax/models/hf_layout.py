"""Where each of our parameters lives in a Hugging Face checkpoint, and in what layout.

Hugging Face stores ``nn.Linear`` weights as [out, in] with attention heads flattened;
we store [in, out] with explicit head axes. A Layout converts one way and the other
and says which shape the checkpoint must hold.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np


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

_LAYER_TENSORS = {
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


def hf_name_and_layout(path: tuple[Any, ...]) -> tuple[str, str]:
  """Checkpoint name and layout of the parameter at our nnx state ``path``."""
  if path == ("embed",):
    return "model.embed_tokens.weight", "same"
  if path == ("lm_head",):
    return "lm_head.weight", "linear"
  if path == ("final_norm", "scale"):
    return "model.norm.weight", "same"
  _, layer, *rest = path
  name, layout = _LAYER_TENSORS[tuple(rest)]
  return f"model.layers.{layer}.{name}", layout
