"""Pallas paged attention per platform, each tested against kv/'s pure-JAX reference
(interpret=True on CPU), and the choice of which runs where."""

from specrl_jax.kernels.dispatch import (ATTENTION_CHOICES, AttentionPlan, paged_attention,
                                         paged_attention_gpu_interpret,
                                         paged_attention_tpu_interpret, prefill_attention,
                                         resolve_attention)
from specrl_jax.kernels.paged_attention_gpu import paged_attention_gpu
from specrl_jax.kernels.paged_attention_tpu import paged_attention_tpu
from specrl_jax.kernels.platform import LOWERING_PLATFORMS, attention_backend, lowering_for
from specrl_jax.kernels.split_heads import SplitHeads

__all__ = ["ATTENTION_CHOICES", "AttentionPlan", "LOWERING_PLATFORMS", "SplitHeads",
           "attention_backend", "lowering_for", "paged_attention", "paged_attention_gpu",
           "paged_attention_gpu_interpret", "paged_attention_tpu",
           "paged_attention_tpu_interpret", "prefill_attention", "resolve_attention"]
