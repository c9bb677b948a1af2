"""Decoder-only transformer (Llama / Qwen2 / Qwen3 family) in flax.nnx.

Weights are stored with head axes explicit (``q_proj: [D, H, Dh]``) so partition
rules can shard heads and MLP columns by name without reshapes.
"""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from specrl_jax.config import ConfigError, ModelConfig
from specrl_jax.models.attention import CausalNoCache, KVBackend

Array = jax.Array

# Activation rematerialisation of each decoder block under differentiation, by name:
# "none" keeps every activation for the backward pass; "full" keeps only each block's
# input and recomputes the rest; "dots_saveable" keeps every matmul output (attention
# scores included) and recomputes the elementwise rest; "dots_with_no_batch_dims_
# saveable" keeps only the projections' outputs (not the batched attention matmuls).
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _init(rngs: nnx.Rngs, shape, dtype, std: float = 0.02) -> nnx.Param:
  # Drawn in the param dtype itself: a bfloat16 model never has a float32 copy.
  return nnx.Param(jax.random.normal(rngs.params(), shape, dtype) * jnp.asarray(std, dtype))


class RMSNorm(nnx.Module):
  """Root-mean-square norm computed in float32, scaled by a learned weight."""

  def __init__(self, dim: int, *, eps: float, param_dtype):
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
    self.eps = eps

  def __call__(self, x: Array) -> Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.scale[...].astype(x.dtype) * x32.astype(x.dtype)


def rope_inverse_frequencies(config: ModelConfig) -> Array:
  """Per-pair rotation frequencies [head_dim / 2], with optional Llama-3 scaling."""
  dim = config.head_dim
  inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  if config.rope_llama3_scaling is None:
    return inv_freq
  factor, low_freq_factor, high_freq_factor, original_max = config.rope_llama3_scaling
  low_wavelen = original_max / low_freq_factor
  high_wavelen = original_max / high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  smooth = (original_max / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
  smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
  scaled = jnp.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
  is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return jnp.where(is_medium, smoothed, scaled)


def rope_tables(config: ModelConfig, positions_BxT: Array) -> tuple[Array, Array]:
  """cos and sin [B, T, head_dim / 2] for the given absolute positions."""
  angles_BxTxF = positions_BxT.astype(jnp.float32)[..., None] * rope_inverse_frequencies(config)
  return jnp.cos(angles_BxTxF), jnp.sin(angles_BxTxF)


def apply_rope(x_BxTxNxD: Array, cos_BxTxF: Array, sin_BxTxF: Array) -> Array:
  """Rotates the two halves of each head (the Hugging Face "rotate_half" layout)."""
  half = x_BxTxNxD.shape[-1] // 2
  x1, x2 = x_BxTxNxD[..., :half].astype(jnp.float32), x_BxTxNxD[..., half:].astype(jnp.float32)
  cos, sin = cos_BxTxF[:, :, None, :], sin_BxTxF[:, :, None, :]
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x_BxTxNxD.dtype)


class Attention(nnx.Module):
  """Grouped-query self-attention; storage and masking are delegated to a KVBackend."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c, pd = config, jnp.dtype(config.param_dtype)
    self.config = config
    self.q_proj = _init(rngs, (c.hidden_size, c.num_heads, c.head_dim), pd)
    self.k_proj = _init(rngs, (c.hidden_size, c.num_kv_heads, c.head_dim), pd)
    self.v_proj = _init(rngs, (c.hidden_size, c.num_kv_heads, c.head_dim), pd)
    self.o_proj = _init(rngs, (c.num_heads, c.head_dim, c.hidden_size), pd)
    if c.attention_bias:
      self.q_bias = nnx.Param(jnp.zeros((c.num_heads, c.head_dim), pd))
      self.k_bias = nnx.Param(jnp.zeros((c.num_kv_heads, c.head_dim), pd))
      self.v_bias = nnx.Param(jnp.zeros((c.num_kv_heads, c.head_dim), pd))
    if c.qk_norm:
      self.q_norm = RMSNorm(c.head_dim, eps=c.rms_norm_eps, param_dtype=pd)
      self.k_norm = RMSNorm(c.head_dim, eps=c.rms_norm_eps, param_dtype=pd)

  def __call__(self, x_BxTxD: Array, cos_BxTxF: Array, sin_BxTxF: Array, layer: int,
               kv: KVBackend) -> tuple[Array, KVBackend]:
    c, dt = self.config, x_BxTxD.dtype
    q_BxTxHxD = jnp.einsum("btd,dhk->bthk", x_BxTxD, self.q_proj[...].astype(dt))
    k_BxTxKxD = jnp.einsum("btd,dhk->bthk", x_BxTxD, self.k_proj[...].astype(dt))
    v_BxTxKxD = jnp.einsum("btd,dhk->bthk", x_BxTxD, self.v_proj[...].astype(dt))
    if c.attention_bias:
      q_BxTxHxD = q_BxTxHxD + self.q_bias[...].astype(dt)
      k_BxTxKxD = k_BxTxKxD + self.k_bias[...].astype(dt)
      v_BxTxKxD = v_BxTxKxD + self.v_bias[...].astype(dt)
    if c.qk_norm:
      q_BxTxHxD = self.q_norm(q_BxTxHxD)
      k_BxTxKxD = self.k_norm(k_BxTxKxD)
    q_BxTxHxD = apply_rope(q_BxTxHxD, cos_BxTxF, sin_BxTxF)
    k_BxTxKxD = apply_rope(k_BxTxKxD, cos_BxTxF, sin_BxTxF)
    out_BxTxHxD, kv = kv.attend(layer, q_BxTxHxD, k_BxTxKxD, v_BxTxKxD)
    return jnp.einsum("bthk,hkd->btd", out_BxTxHxD, self.o_proj[...].astype(dt)), kv


class MLP(nnx.Module):
  """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c, pd = config, jnp.dtype(config.param_dtype)
    self.gate_proj = _init(rngs, (c.hidden_size, c.intermediate_size), pd)
    self.up_proj = _init(rngs, (c.hidden_size, c.intermediate_size), pd)
    self.down_proj = _init(rngs, (c.intermediate_size, c.hidden_size), pd)

  def __call__(self, x_BxTxD: Array) -> Array:
    dt = x_BxTxD.dtype
    gate_BxTxF = x_BxTxD @ self.gate_proj[...].astype(dt)
    up_BxTxF = x_BxTxD @ self.up_proj[...].astype(dt)
    return (jax.nn.silu(gate_BxTxF) * up_BxTxF) @ self.down_proj[...].astype(dt)


class Block(nnx.Module):
  """Pre-norm decoder layer: x + attn(norm(x)), then x + mlp(norm(x))."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    pd = jnp.dtype(config.param_dtype)
    self.input_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, param_dtype=pd)
    self.attn = Attention(config, rngs=rngs)
    self.post_attention_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps,
                                       param_dtype=pd)
    self.mlp = MLP(config, rngs=rngs)

  def __call__(self, x_BxTxD, cos_BxTxF, sin_BxTxF, layer: int, kv: KVBackend):
    attn_out, kv = self.attn(self.input_norm(x_BxTxD), cos_BxTxF, sin_BxTxF, layer, kv)
    x_BxTxD = x_BxTxD + attn_out
    return x_BxTxD + self.mlp(self.post_attention_norm(x_BxTxD)), kv


def _run_block(block: Block, remat: str, x_BxTxD, cos_BxTxF, sin_BxTxF, layer: int,
               kv: KVBackend):
  if REMAT_POLICIES[remat] is None:
    return block(x_BxTxD, cos_BxTxF, sin_BxTxF, layer, kv)
  # Functional around the block: jax.checkpoint needs its weights as arguments.
  graphdef, weights = nnx.split(block)

  def run(weights, x_BxTxD, cos_BxTxF, sin_BxTxF, kv):
    return nnx.merge(graphdef, weights)(x_BxTxD, cos_BxTxF, sin_BxTxF, layer, kv)

  return jax.checkpoint(run, policy=REMAT_POLICIES[remat])(weights, x_BxTxD, cos_BxTxF,
                                                            sin_BxTxF, kv)


@flax.struct.dataclass
class ForwardOutput:
  """What one forward pass produces.

  logits: float32 [B, T, V] (None when the caller asked for hidden states only).
  hidden: [B, T, D] output of the last layer before the final norm (MTP reads it).
  layer_hidden: outputs of the layers named in ``hidden_layers`` (EAGLE-3 reads them).
  kv: the KV backend after this call stored its keys and values.
  """
  logits: Array | None
  hidden: Array
  layer_hidden: tuple[Array, ...]
  kv: KVBackend


class Transformer(nnx.Module):
  """The policy / target model. ``model(tokens)`` is the plain causal forward."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    c, pd = config, jnp.dtype(config.param_dtype)
    self.config = config
    self.embed = _init(rngs, (c.vocab_size, c.hidden_size), pd)
    self.layers = nnx.List([Block(c, rngs=rngs) for _ in range(c.num_layers)])
    self.final_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, param_dtype=pd)
    if not c.tie_embeddings:
      self.lm_head = _init(rngs, (c.hidden_size, c.vocab_size), pd)

  def __call__(self, tokens_BxT: Array) -> Array:
    """Causal forward over whole sequences: int32 [B, T] -> float32 logits [B, T, V]."""
    return self.forward(tokens_BxT).logits

  def embed_tokens(self, tokens_BxT: Array) -> Array:
    return jnp.take(self.embed[...], tokens_BxT, axis=0).astype(jnp.dtype(self.config.dtype))

  def unembed(self, hidden_BxTxD: Array) -> Array:
    """Final norm and LM head: pre-norm hidden states -> float32 logits."""
    h = self.final_norm(hidden_BxTxD)
    head_DxV = self.embed[...].T if self.config.tie_embeddings else self.lm_head[...]
    return jnp.einsum("btd,dv->btv", h, head_DxV.astype(h.dtype),
                      preferred_element_type=jnp.float32)

  def forward(self, tokens_BxT: Array, *, positions_BxT: Array | None = None,
              kv: KVBackend | None = None, hidden_layers: tuple[int, ...] = (),
              compute_logits: bool = True, inputs_embeds_BxTxD: Array | None = None,
              remat: str = "none") -> ForwardOutput:
    """Runs the decoder.

    positions_BxT: absolute positions (default 0..T-1), used by RoPE and by KV backends.
    kv: where keys/values go; default is causal attention over this call's tokens only.
    hidden_layers: 0-based indices of layers whose outputs to return.
    inputs_embeds_BxTxD: replaces the token embedding lookup when given.
    remat: a name in REMAT_POLICIES: what each block keeps for differentiation (the
      values are the same whatever it is; only memory and recomputation change).
    """
    c = self.config
    if remat not in REMAT_POLICIES:
      raise ConfigError(f"remat={remat!r} is invalid: expected one of {sorted(REMAT_POLICIES)}.")
    for index in hidden_layers:
      if not 0 <= index < c.num_layers:
        raise ConfigError(f"hidden_layers contains {index}: expected indices in "
                          f"[0, {c.num_layers - 1}] for a {c.num_layers}-layer model.")
    batch, length = tokens_BxT.shape
    if positions_BxT is None:
      positions_BxT = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    kv = CausalNoCache() if kv is None else kv
    x_BxTxD = self.embed_tokens(tokens_BxT) if inputs_embeds_BxTxD is None else inputs_embeds_BxTxD
    cos_BxTxF, sin_BxTxF = rope_tables(c, positions_BxT)
    layer_hidden = []
    for layer, block in enumerate(self.layers):
      x_BxTxD, kv = _run_block(block, remat, x_BxTxD, cos_BxTxF, sin_BxTxF, layer, kv)
      if layer in hidden_layers:
        layer_hidden.append(x_BxTxD)
    ordered = tuple(layer_hidden[sorted(hidden_layers).index(i)] for i in hidden_layers)
    logits = self.unembed(x_BxTxD) if compute_logits else None
    return ForwardOutput(logits=logits, hidden=x_BxTxD, layer_hidden=ordered, kv=kv)
