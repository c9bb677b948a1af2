"""The decoder-only transformer, the attention math its KV backends share, Hugging
Face import and export, and the built-in character tokenizer (``models.tokenizer``)."""

from specrl_jax.models import tokenizer
from specrl_jax.models.attention import MASK_VALUE, CausalNoCache, KVBackend, grouped_attention
from specrl_jax.models.hf import (ARCHITECTURES, Architecture, HFFormatError,
                                  hf_config_from_model, load_hf, load_tokenizer,
                                  model_config_from_hf, save_hf)
from specrl_jax.models.transformer import (MLP, Attention, Block, ForwardOutput, RMSNorm,
                                           Transformer, apply_rope, rope_inverse_frequencies,
                                           rope_tables)

__all__ = [
    "ARCHITECTURES", "Architecture", "Attention", "Block", "CausalNoCache", "ForwardOutput",
    "HFFormatError", "KVBackend", "MASK_VALUE", "MLP", "RMSNorm", "Transformer", "apply_rope",
    "grouped_attention", "hf_config_from_model", "load_hf", "load_tokenizer",
    "model_config_from_hf", "rope_inverse_frequencies", "rope_tables", "save_hf", "tokenizer",
]
