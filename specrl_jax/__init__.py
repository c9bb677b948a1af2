"""specrl_jax: lossless speculative rollouts for RL post-training, in pure JAX."""

from specrl_jax.config import ConfigError, ModelConfig, SamplingParams, SpecConfig
from specrl_jax.models.transformer import ForwardOutput, Transformer

__all__ = [
    "ConfigError", "ForwardOutput", "ModelConfig", "SamplingParams", "SpecConfig",
    "Transformer",
]
