"""specrl_jax: lossless speculative rollouts for RL post-training, in pure JAX.

``sj.rl``, ``sj.sim``, ``sj.testing`` and ``sj.parallel`` import on first access, so
``import specrl_jax`` does not pay for the RL stack.

Array names end in their shape, one letter per axis joined by "x" (``k_pages_PxKxSxD``).
Each letter means one thing across the package; G, P, R and A carry a second meaning
confined to named layers, as listed:

  B  rows of a forward pass            T  tokens per row (queries)
  L  tokens of a sequence: keys attended, a response, a context window
  D  feature width (hidden size, head dim)   F  a second width (MLP, rotary, fused features)
  V  vocabulary                        H  query heads    K  KV heads
  G  a group: query heads per KV head in attention; samples per prompt in GRPO
  N  decode slots                      U  requests (prompts to decode, finished rollouts)
  P  pages of the KV pool (kv/, kernels/); prompts of an RL batch or history bank (rl/, history)
  M  pages per sequence (page-table width)    S  tokens per page
  A  pages one call allocates (kv/, the engine); answer tokens of a task reward (rl/tasks)
  R  result rows: a request's output row, a GRPO response; in paged attention the T*G
     query rows one KV head serves
  C  tokens a slot's drafter can match against (its prompt and output, earlier rollouts)
  J  drafted tree nodes, the root excluded (a chain's k)   Y  tree nodes with the root (J + 1)
  I  internal tree nodes (a level's parents)   W  nodes of one tree level
  Z  draft depth                       E  candidates a round emits (Z + 1)
  Q  data shards of a sharded call     O  outcomes of a categorical test
"""

from specrl_jax import drafters
from specrl_jax.config import PRESETS, ConfigError, ModelConfig, SamplingParams, SpecConfig
from specrl_jax.kv.planner import MemoryBudgetError
from specrl_jax.lazy import lazy_face
from specrl_jax.models.hf import HFFormatError, load_hf, load_tokenizer, save_hf
from specrl_jax.models.text_tokenizer import TextTokenizer
from specrl_jax.models.transformer import ForwardOutput, Transformer
from specrl_jax.parallel.create import create_model
from specrl_jax.sampling.engine import EngineConfig
from specrl_jax.speculative.generate import GenerateOutput, PagePoolExhaustedError, generate

__all__ = [
    "ConfigError", "EngineConfig", "ForwardOutput", "GenerateOutput", "HFFormatError",
    "MemoryBudgetError", "ModelConfig", "PRESETS", "PagePoolExhaustedError", "SamplingParams",
    "SpecConfig", "TextTokenizer", "Transformer", "create_model", "drafters", "generate", "load_hf",
    "load_tokenizer", "parallel", "rl", "save_hf", "sim", "testing",
]
__getattr__, __dir__ = lazy_face(
    __name__, {"parallel": None, "rl": None, "sim": None, "testing": None})
