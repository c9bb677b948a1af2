"""The ``--policy.*`` (and ``--drafter.model.*``) section of an experiment: a decoder
given by its Hugging Face folder or by the sizes of a fresh model."""

from __future__ import annotations

import dataclasses

from specrl_jax.config import ModelConfig, check, check_non_negative_int
from specrl_jax.models import tokenizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSection:
  """A decoder (the policy, or a draft model): a Hugging Face folder at ``path``
  (its own tokenizer drives prompts, stop tokens and decoding), else ("") a fresh
  model of these sizes over the built-in vocabulary."""
  path: str = ""
  hidden_size: int = 192  # width of the residual stream
  intermediate_size: int = 512  # width of each MLP
  num_layers: int = 3  # decoder blocks
  num_heads: int = 6  # query heads
  num_kv_heads: int = 2  # key/value heads (grouped-query attention)
  head_dim: int = 32  # width of each head
  seed: int = 0  # initialisation seed of a fresh model

  def __post_init__(self):
    check_non_negative_int("ModelSection", "seed", self.seed)
    check(isinstance(self.path, str), "ModelSection", "path", self.path,
          "a path to a Hugging Face model folder, or '' for a fresh built-in-vocabulary model")
    self.model_config()  # its own checks name the bad size

  def model_config(self, vocab_size: int = tokenizer.VOCAB_SIZE) -> ModelConfig:
    return ModelConfig(vocab_size=vocab_size, hidden_size=self.hidden_size,
                       intermediate_size=self.intermediate_size, num_layers=self.num_layers,
                       num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                       head_dim=self.head_dim, max_position_embeddings=512)
