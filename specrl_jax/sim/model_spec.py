"""What the roofline needs to know about a model: parameter counts, FLOPs, bytes.

A ModelSpec is built from an ``sj.ModelConfig`` (dense models this project runs) or
taken from ``MODELS`` (public architectures, including the Qwen3 MoE). Drafters are
described by a ``DrafterSpec``: the network run once per draft step, plus per-round
extras (EAGLE-3's fusion of three target layers, an n-gram lookup on the host).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from specrl_jax.config import (ModelConfig, check, check_finite_number, check_non_negative_int,
                               check_positive_int)
from specrl_jax.sim import validation


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
  """A decoder-only transformer; MoE when ``num_experts`` > 0 (every layer MoE)."""

  name: str
  num_layers: int
  hidden_size: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  intermediate_size: int  # dense MLP width; unused when num_experts > 0
  vocab_size: int
  tie_embeddings: bool = False
  num_experts: int = 0
  experts_per_token: int = 0
  expert_intermediate_size: int = 0
  # EAGLE-3's layer projects concat(embedding, fused hidden) to q, k, v: 2x wider input.
  attention_input_multiple: int = 1

  def __post_init__(self):
    owner = f"ModelSpec({self.name!r})"
    for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                  "vocab_size", "attention_input_multiple"):
      check_positive_int(owner, field, getattr(self, field))
    for field in ("intermediate_size", "num_experts", "experts_per_token",
                  "expert_intermediate_size"):
      check_non_negative_int(owner, field, getattr(self, field))
    check(self.num_heads % self.num_kv_heads == 0, owner, "num_kv_heads",
          self.num_kv_heads, f"a divisor of num_heads={self.num_heads}")
    if self.is_moe:
      check(0 < self.experts_per_token <= self.num_experts, owner, "experts_per_token",
            self.experts_per_token, f"in [1, num_experts={self.num_experts}]")
      check_positive_int(owner, "expert_intermediate_size", self.expert_intermediate_size)
    else:
      check_positive_int(owner, "intermediate_size", self.intermediate_size)

  @property
  def is_moe(self) -> bool:
    return self.num_experts > 0

  # Parameter counts (norms are negligible and left out).
  @property
  def attention_params_per_layer(self) -> int:
    d_in = self.hidden_size * self.attention_input_multiple
    qkv = d_in * self.head_dim * (self.num_heads + 2 * self.num_kv_heads)
    return qkv + self.num_heads * self.head_dim * self.hidden_size

  @property
  def params_per_expert(self) -> int:
    return 3 * self.hidden_size * self.expert_intermediate_size

  @property
  def dense_mlp_params_per_layer(self) -> int:
    """MLP weights every token reads: the dense MLP, or the MoE router."""
    if self.is_moe:
      return self.hidden_size * self.num_experts
    return 3 * self.hidden_size * self.intermediate_size

  @property
  def lm_head_params(self) -> int:
    return self.hidden_size * self.vocab_size

  @property
  def embedding_params(self) -> int:
    return self.hidden_size * self.vocab_size

  @property
  def total_params(self) -> int:
    per_layer = (self.attention_params_per_layer + self.dense_mlp_params_per_layer
                 + self.num_experts * self.params_per_expert)
    head = 0 if self.tie_embeddings else self.lm_head_params
    return self.embedding_params + self.num_layers * per_layer + head

  @property
  def active_matmul_params(self) -> int:
    """Weights one token multiplies through: 2x this is its forward matmul FLOPs."""
    per_layer = (self.attention_params_per_layer + self.dense_mlp_params_per_layer
                 + self.experts_per_token * self.params_per_expert)
    return self.num_layers * per_layer + self.lm_head_params

  @property
  def active_params(self) -> int:
    """Active parameters as usually quoted (e.g. the 22B of Qwen3-235B-A22B)."""
    embedding = 0 if self.tie_embeddings else self.embedding_params
    return self.active_matmul_params + embedding

  def kv_bytes_per_token(self, bytes_per_element: float) -> float:
    return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element

  def attention_flops(self, num_query_tokens: float, context_tokens: float) -> float:
    """Scores and weighted sum: 4 * layers * heads * head_dim per (query, key) pair."""
    return (4.0 * self.num_layers * self.num_heads * self.head_dim
            * num_query_tokens * context_tokens)

  def forward_matmul_flops(self, num_tokens: float) -> float:
    return 2.0 * self.active_matmul_params * num_tokens

  def weights_read(self, num_tokens: float) -> float:
    """Parameters one forward over ``num_tokens`` tokens streams from memory.

    Dense weights are read once per call whatever the batch; an MoE layer reads only
    the experts some token was routed to, E * (1 - (1 - top_k / E) ** tokens) in
    expectation under uniform routing, which is why small MoE batches are cheap.
    """
    per_layer = self.attention_params_per_layer + self.dense_mlp_params_per_layer
    if self.is_moe:
      untouched = (1.0 - self.experts_per_token / self.num_experts) ** num_tokens
      per_layer += self.num_experts * (1.0 - untouched) * self.params_per_expert
    return self.num_layers * per_layer + self.lm_head_params

  @classmethod
  def from_model_config(cls, config: ModelConfig, *, name: str = "custom") -> "ModelSpec":
    return cls(name=name, num_layers=config.num_layers, hidden_size=config.hidden_size,
               num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
               head_dim=config.head_dim, intermediate_size=config.intermediate_size,
               vocab_size=config.vocab_size, tie_embeddings=config.tie_embeddings)


# Public architectures (numbers from each model's config.json on the Hugging Face hub).
MODELS: dict[str, ModelSpec] = {
    "qwen3-0.6b": ModelSpec(name="qwen3-0.6b", num_layers=28, hidden_size=1024,
                            num_heads=16, num_kv_heads=8, head_dim=128,
                            intermediate_size=3072, vocab_size=151936, tie_embeddings=True),
    "qwen3-8b": ModelSpec(name="qwen3-8b", num_layers=36, hidden_size=4096, num_heads=32,
                          num_kv_heads=8, head_dim=128, intermediate_size=12288,
                          vocab_size=151936),
    "qwen3-32b": ModelSpec(name="qwen3-32b", num_layers=64, hidden_size=5120, num_heads=64,
                           num_kv_heads=8, head_dim=128, intermediate_size=25600,
                           vocab_size=151936),
    "qwen3-235b-a22b": ModelSpec(name="qwen3-235b-a22b", num_layers=94, hidden_size=4096,
                                 num_heads=64, num_kv_heads=4, head_dim=128,
                                 intermediate_size=0, vocab_size=151936, num_experts=128,
                                 experts_per_token=8, expert_intermediate_size=1536),
    "llama-3.1-8b": ModelSpec(name="llama-3.1-8b", num_layers=32, hidden_size=4096,
                              num_heads=32, num_kv_heads=8, head_dim=128,
                              intermediate_size=14336, vocab_size=128256),
    "llama-3.1-70b": ModelSpec(name="llama-3.1-70b", num_layers=80, hidden_size=8192,
                               num_heads=64, num_kv_heads=8, head_dim=128,
                               intermediate_size=28672, vocab_size=128256),
}


def get_model(name: str) -> ModelSpec:
  check(name in MODELS, "ModelSpec", "name", name, f"one of {sorted(MODELS)}")
  return MODELS[name]


DRAFTER_KINDS = ("draft_model", "mtp", "eagle3", "ngram", "history")
# Drafters that match tokens and run no network of their own.
MATCHING_KINDS = ("ngram", "history")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterSpec:
  """How a drafter spends time: ``step_network`` runs once per draft step (None for
  the n-gram drafter, which never touches the accelerator); ``round_matmul_params``
  are weights applied once per round to the verified tokens (EAGLE-3's 3H -> H
  fusion, MTP's 2H -> H projection); ``host_seconds_per_round`` is CPU-side work."""

  kind: str
  step_network: ModelSpec | None
  round_matmul_params: int = 0
  host_seconds_per_round: float = 0.0

  def __post_init__(self):
    owner = "DrafterSpec"
    validation.one_of(owner, "kind", self.kind, DRAFTER_KINDS)
    check((self.step_network is None) == (self.kind in MATCHING_KINDS), owner, "step_network",
          self.step_network, f"None exactly when kind is one of {MATCHING_KINDS}")
    check_non_negative_int(owner, "round_matmul_params", self.round_matmul_params)
    check_finite_number(owner, "host_seconds_per_round", self.host_seconds_per_round, at_least=0)

  @property
  def params(self) -> int:
    """Trainable drafter parameters (what online drafter training updates)."""
    if self.step_network is None:
      return 0
    network = self.step_network
    # EAGLE-3 and MTP share (and freeze) the target's embedding.
    shared = network.embedding_params if self.kind in ("eagle3", "mtp") else 0
    return network.total_params - shared + self.round_matmul_params


def eagle3_drafter(target: ModelSpec, *, draft_vocab_size: int = 32000) -> DrafterSpec:
  """One decoder layer over [norm(embedding); norm(fused hidden)] and a reduced-vocab
  head. For an MoE target the drafter layer is dense, 3x hidden wide (as in the
  public EAGLE-3 heads for Qwen3 MoE models)."""
  intermediate = target.intermediate_size if not target.is_moe else 3 * target.hidden_size
  layer = ModelSpec(name=f"eagle3({target.name})", num_layers=1,
                    hidden_size=target.hidden_size, num_heads=target.num_heads,
                    num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
                    intermediate_size=intermediate, vocab_size=draft_vocab_size,
                    attention_input_multiple=2)
  return DrafterSpec(kind="eagle3", step_network=layer,
                     round_matmul_params=3 * target.hidden_size * target.hidden_size)


def mtp_drafter(target: ModelSpec) -> DrafterSpec:
  """DeepSeek-V3-style MTP module: one block of the target's own kind (MoE for an MoE
  target) and the shared full-vocabulary head."""
  block = dataclasses.replace(target, name=f"mtp({target.name})", num_layers=1)
  return DrafterSpec(kind="mtp", step_network=block,
                     round_matmul_params=2 * target.hidden_size * target.hidden_size)


def draft_model_drafter(draft: ModelSpec) -> DrafterSpec:
  return DrafterSpec(kind="draft_model", step_network=draft)


def ngram_drafter(*, host_seconds_per_round: float = 2e-4) -> DrafterSpec:
  """Prompt-lookup n-gram drafting: a suffix match on the host per round (about
  0.2 ms for a batch, assumed). Only that lookup is charged, so this model predicts
  n-gram drafting faster than plain decoding at the paper's acceptance lengths, where
  the paper measured it slower (0.7x / 0.5x): its engine paid costs not modelled here."""
  return DrafterSpec(kind="ngram", step_network=None,
                     host_seconds_per_round=host_seconds_per_round)


def history_drafter() -> DrafterSpec:
  """Rollout-history drafting (bank, siblings, the sequence itself): a suffix match
  inside the compiled round, charged nothing beyond the target's verification."""
  return DrafterSpec(kind="history", step_network=None)


# `specrl simulate --drafter=NAME[:OPTION]`: NAME -> (target, OPTION) -> DrafterSpec.
# `specrl train`'s drafter registry (rl/app/drafter_registry.py) names its kinds'
# simulator specs by these keys, so the simulator never imports the RL stack.
SimulatedDrafter = Callable[[ModelSpec, str], DrafterSpec]
DRAFTER_SPECS: dict[str, SimulatedDrafter] = {}


def register_drafter_spec(name: str) -> Callable[[SimulatedDrafter], SimulatedDrafter]:
  """Registers how the simulator costs drafter ``name`` (``--drafter=name[:option]``)."""
  def register(function: SimulatedDrafter) -> SimulatedDrafter:
    if name in DRAFTER_SPECS:
      raise ValueError(f"simulated drafter {name!r} is already registered")
    DRAFTER_SPECS[name] = function
    return function
  return register


def _no_option(name: str, option: str) -> None:
  check(option == "", "DrafterSpec", name, option, f"no option (--drafter={name})")


@register_drafter_spec("eagle3")
def _eagle3(target: ModelSpec, option: str) -> DrafterSpec:
  return eagle3_drafter(target, **({"draft_vocab_size": int(option)} if option else {}))


@register_drafter_spec("mtp")
def _mtp(target: ModelSpec, option: str) -> DrafterSpec:
  _no_option("mtp", option)
  return mtp_drafter(target)


@register_drafter_spec("ngram")
def _ngram(target: ModelSpec, option: str) -> DrafterSpec:
  _no_option("ngram", option)
  return ngram_drafter()


@register_drafter_spec("history")
def _history(target: ModelSpec, option: str) -> DrafterSpec:
  _no_option("history", option)
  return history_drafter()


@register_drafter_spec("draft_model")
def _draft_model(target: ModelSpec, option: str) -> DrafterSpec:
  check(option != "", "DrafterSpec", "draft_model", option,
        f"a model name after a colon, e.g. draft_model:qwen3-0.6b (one of {sorted(MODELS)})")
  return draft_model_drafter(get_model(option))


def drafter_spec(text: str, target: ModelSpec) -> DrafterSpec:
  """The DrafterSpec of ``--drafter=NAME[:OPTION]`` for ``target`` ("draft:M" is the
  older spelling of "draft_model:M")."""
  name, _, option = text.partition(":")
  name = "draft_model" if name == "draft" else name
  check(name in DRAFTER_SPECS, "DrafterSpec", "kind", name,
        f"one of {sorted(DRAFTER_SPECS)} (draft_model:<model name>)")
  return DRAFTER_SPECS[name](target, option)
