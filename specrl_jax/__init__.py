"""specrl_jax: lossless speculative rollouts for RL post-training, in pure JAX.

``sj.rl``, ``sj.sim``, ``sj.testing`` and ``sj.parallel`` import on first access, so
``import specrl_jax`` does not pay for the RL stack.
"""

from specrl_jax import drafters
from specrl_jax.config import PRESETS, ConfigError, ModelConfig, SamplingParams, SpecConfig
from specrl_jax.kv.planner import MemoryBudgetError
from specrl_jax.lazy import lazy_face
from specrl_jax.models.hf import HFFormatError, load_hf, load_tokenizer, save_hf
from specrl_jax.models.transformer import ForwardOutput, Transformer
from specrl_jax.parallel.create import create_model
from specrl_jax.sampling.engine import EngineConfig
from specrl_jax.speculative.generate import GenerateOutput, PagePoolExhaustedError, generate

__all__ = [
    "ConfigError", "EngineConfig", "ForwardOutput", "GenerateOutput", "HFFormatError",
    "MemoryBudgetError", "ModelConfig", "PRESETS", "PagePoolExhaustedError", "SamplingParams",
    "SpecConfig", "Transformer", "create_model", "drafters", "generate", "load_hf",
    "load_tokenizer", "parallel", "rl", "save_hf", "sim", "testing",
]
__getattr__, __dir__ = lazy_face(
    __name__, {"parallel": None, "rl": None, "sim": None, "testing": None})
