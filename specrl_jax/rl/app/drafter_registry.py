"""The drafters of `specrl train`, by name: ``--drafter.kind=NAME``.

Every reader of the drafter section asks this registry: the experiment config
(``DrafterSection`` validates its kind and options here), the warm start (which
network it distils, and which part of the section its cache depends on), the run
directory's warm-start key, the session (``build_drafter``: the drafter and, for a
learned one with ``--drafter.online``, its ``rl.loop.online_drafters`` trainer) and
the simulator (``simulator``: a key of ``specrl_jax.sim.DRAFTER_SPECS``; the
simulator never imports this module).

A new drafter is one file (its ``speculative.drafters.base.Drafter``) plus one
registration:

    register_drafter(DrafterKind(
        name="bigram", doc="a bigram table of the prompt",
        build=lambda context: Bigram(vocab_size=context.policy.config.vocab_size)))

The contract of a ``DrafterKind`` (every hook but ``build`` has a default):

  name, doc      ``--drafter.kind=name``; one line for --help and the docs.
  build(ctx)     the ``Drafter`` (or None: plain rollouts) for the warm-started policy
                 ``ctx.policy`` and the warm start's draft network ``ctx.draft``.
  learned(section)   whether it has weights: with ``--drafter.online`` they train
                 during RL (``rl.loop.online_drafters`` must have a builder for its class).
  takes_path(section)   whether ``--drafter.path`` may name its pretrained weights.
  simulator      its cost model's key in ``specrl_jax.sim.DRAFTER_SPECS`` (None: none).
  check(section, config)   config-time checks, reading no file: raise ConfigError
                 naming the field, the value and what is allowed.
  check_files(section, config)   checks of the files it will load (config.json,
                 tokenizer), run before any model is loaded or anything compiles.
  draft_network(section, config, vocab_size)   the network the warm start distils
                 from the policy (a fresh Transformer), or None; ``distils`` says whether.
  warm_start_key(section)   the part of the section the warm start depends on (None:
                 the warm start does not depend on the drafter).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from specrl_jax.config import ConfigError, SamplingParams, check
from specrl_jax.models import tokenizer
from specrl_jax.models.transformer import Transformer
from specrl_jax.speculative.drafters.base import Drafter

if TYPE_CHECKING:  # the config imports this module
  from specrl_jax.rl.app.drafter_section import DrafterSection
  from specrl_jax.rl.app.experiment import ExperimentConfig
  from specrl_jax.rl.loop.online_drafters import OnlineDrafter


@dataclasses.dataclass(frozen=True, kw_only=True)
class BuildContext:
  """What a kind's ``build`` reads: its section, the whole config, the warm-started
  policy, the warm start's draft network (None unless the kind has one), a log."""
  section: "DrafterSection"
  config: "ExperimentConfig"
  policy: Transformer
  draft: Transformer | None
  log: Callable[[str], None]


def _no_check(section, config) -> None:
  del section, config


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterKind:
  """One drafter of `specrl train` (the module docstring has the contract)."""
  name: str
  doc: str
  build: Callable[[BuildContext], Drafter | None]
  learned: Callable[["DrafterSection"], bool] = lambda section: False
  takes_path: Callable[["DrafterSection"], bool] = lambda section: False
  simulator: str | None = None
  check: Callable[["DrafterSection", "ExperimentConfig"], None] = _no_check
  check_files: Callable[["DrafterSection", "ExperimentConfig"], None] = _no_check
  draft_network: Callable[["DrafterSection", "ExperimentConfig", int],
                          Transformer | None] = lambda section, config, vocab_size: None
  distils: Callable[["DrafterSection"], bool] = lambda section: False
  warm_start_key: Callable[["DrafterSection"], dict[str, Any] | None] = lambda section: None


DRAFTERS: dict[str, DrafterKind] = {}


def register_drafter(kind: DrafterKind) -> DrafterKind:
  """Makes ``--drafter.kind=kind.name`` available to `specrl train`."""
  if kind.name in DRAFTERS:
    raise ValueError(f"drafter kind {kind.name!r} is already registered")
  if kind.simulator is not None:
    from specrl_jax.sim.model_spec import DRAFTER_SPECS
    if kind.simulator not in DRAFTER_SPECS:
      raise ValueError(f"drafter kind {kind.name!r} names simulator={kind.simulator!r}; "
                       f"expected one of {sorted(DRAFTER_SPECS)} (sim.register_drafter_spec)")
  DRAFTERS[kind.name] = kind
  return kind


def drafter_kind(name: str) -> DrafterKind:
  if name not in DRAFTERS:
    raise ConfigError(f"DrafterSection.kind={name!r} is invalid: expected one of "
                      f"{sorted(DRAFTERS)}.")
  return DRAFTERS[name]


# ----------------------------------------------------------------- what every kind reads

def check_section(section: "DrafterSection", config: "ExperimentConfig") -> None:
  """Config-time checks of the drafter section against the whole config."""
  kind = drafter_kind(section.kind)
  check(kind.takes_path(section) or section.path == "", "DrafterSection", "path",
        section.path, f"'' for kind={section.kind!r} (it reads no pretrained weights)")
  kind.check(section, config)


def check_files(config: "ExperimentConfig") -> None:
  """Checks of the files the drafter will load, before anything is loaded or compiled."""
  drafter_kind(config.drafter.kind).check_files(config.drafter, config)


def draft_network(config: "ExperimentConfig", vocab_size: int) -> Transformer | None:
  return drafter_kind(config.drafter.kind).draft_network(config.drafter, config, vocab_size)


def distils(config: "ExperimentConfig") -> bool:
  """Whether the warm start distils a draft network from the policy."""
  return drafter_kind(config.drafter.kind).distils(config.drafter)


def warm_start_key(drafter_record: dict[str, Any]) -> dict[str, Any] | None:
  """The warm-start key's drafter part, from the section as JSON data."""
  from specrl_jax.rl.app.drafter_section import DrafterSection
  from specrl_jax.rl.app.overrides import from_dict_of
  section = from_dict_of(DrafterSection, drafter_record)
  return drafter_kind(section.kind).warm_start_key(section)


def build_drafter(config: "ExperimentConfig", policy: Transformer, draft: Transformer | None,
                  *, sampling: SamplingParams, log: Callable[[str], None] = print
                  ) -> tuple[Drafter | None, "OnlineDrafter | None"]:
  """(drafter or None, its online trainer or None) as ``config.drafter`` asks."""
  from specrl_jax.rl.loop.online_drafters import online_drafter
  section = config.drafter
  kind = drafter_kind(section.kind)
  drafter = kind.build(BuildContext(section=section, config=config, policy=policy,
                                    draft=draft, log=log))
  if drafter is None or not (kind.learned(section) and section.online):
    return drafter, None
  return drafter, online_drafter(drafter, sampling=sampling, loss_weight=section.loss_weight)


# ----------------------------------------------------------------- file checks

def read_model_config(folder: str, owner: str) -> dict[str, Any]:
  path = os.path.join(folder, "config.json")
  if not os.path.isfile(path):
    raise ConfigError(f"{owner}={folder!r} is invalid: expected a Hugging Face model folder "
                      f"with a config.json (none at {path}).")
  with open(path) as f:
    return json.load(f)


def policy_sizes(config: "ExperimentConfig") -> tuple[int, int]:
  """(vocab_size, hidden_size) of the policy, from its config.json or its section."""
  if config.policy.path:
    hf = read_model_config(config.policy.path, "ModelSection.path")
    return int(hf["vocab_size"]), int(hf["hidden_size"])
  return tokenizer.VOCAB_SIZE, config.policy.hidden_size


def tokenizer_vocab(folder: str) -> dict[str, int] | None:
  """The token -> id map of a folder's tokenizer.json (None: the folder has none)."""
  path = os.path.join(folder, "tokenizer.json")
  if not os.path.isfile(path):
    return None
  import tokenizers
  return tokenizers.Tokenizer.from_file(path).get_vocab(with_added_tokens=True)


def policy_name(config: "ExperimentConfig") -> str:
  return (f"the policy {config.policy.path!r}" if config.policy.path
          else "the built-in policy (the built-in character vocabulary)")


import specrl_jax.rl.app.drafter_kinds  # noqa: E402,F401  (registers the built-in kinds)
