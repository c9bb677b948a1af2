"""The built-in drafter kinds of `specrl train` (``rl.app.drafter_registry`` has the
contract): none, ngram, history, draft_model, eagle3, mtp."""

from __future__ import annotations

import dataclasses
import json
import os

from flax import nnx

from specrl_jax.config import ConfigError, check
from specrl_jax.models.hf import load_hf
from specrl_jax.models.transformer import Transformer
from specrl_jax.rl.app.drafter_registry import (
    DRAFTERS, BuildContext, DrafterKind, drafter_kind, policy_name, policy_sizes,
    read_model_config, register_drafter, tokenizer_vocab)
from specrl_jax.speculative.drafters.checkpoints import load_drafter
from specrl_jax.speculative.drafters.draft_model import DraftModel
from specrl_jax.speculative.drafters.eagle3 import Eagle3
from specrl_jax.speculative.drafters.history import History
from specrl_jax.speculative.drafters.mtp import MTP
from specrl_jax.speculative.drafters.ngram import NGram
from specrl_jax.speculative.drafters.specforge import load_specforge

SPECFORGE_CONFIG = "config.json"
NATIVE_HEAD = "drafter.json"  # speculative.drafters.checkpoints.save_drafter


def always(section) -> bool:
  del section
  return True

register_drafter(DrafterKind(name="none", doc="plain rollouts, no speculation",
                             build=lambda context: None))

register_drafter(DrafterKind(
    name="ngram", doc="prompt lookup: n-gram matches in the sequence itself (ngram_n)",
    simulator="ngram", build=lambda context: NGram(n=context.section.ngram_n)))


# ----------------------------------------------------------------- draft_model

def _draft_model_check(section, config) -> None:
  if section.path:
    return
  distilling = config.warm_start.distill_steps > 0
  if distilling and config.data.path and not config.data.solution_field:
    raise ConfigError(
        f"WarmStartSection.distill_steps={config.warm_start.distill_steps} is invalid with a "
        "dataset without worked solutions (distillation trains the draft model on them): "
        "set --data.solution_field=COLUMN, give a pretrained draft model with "
        "--drafter.path=HF_FOLDER, or --warm_start.distill_steps=0 --drafter.online=true "
        "(trained from the rollouts during RL)")
  if not distilling and not section.online:
    raise ConfigError(
        "DrafterSection.kind='draft_model' with no --drafter.path, no distillation "
        "(warm_start.distill_steps=0) and online=False would draft with an untrained network "
        "for the whole run: give --drafter.path=HF_FOLDER (a pretrained model sharing the "
        "policy's tokenizer), --warm_start.distill_steps=N, or --drafter.online=true.")


def _draft_model_files(section, config) -> None:
  if not section.path:
    return
  hf = read_model_config(section.path, "DrafterSection.path")
  vocab_size, _ = policy_sizes(config)
  if int(hf.get("vocab_size", -1)) != vocab_size:
    raise ConfigError(
        f"DrafterSection.path={section.path!r} is a model of vocab_size="
        f"{hf.get('vocab_size')} but {policy_name(config)} has vocab_size={vocab_size}: a "
        "draft model must share the policy's vocabulary.")
  draft_vocab = tokenizer_vocab(section.path)
  policy_vocab = tokenizer_vocab(config.policy.path) if config.policy.path else None
  if draft_vocab is not None and draft_vocab != policy_vocab:
    differing = sorted(set(draft_vocab.items()) ^ set((policy_vocab or {}).items()))[:3]
    raise ConfigError(
        f"the tokenizer of DrafterSection.path={section.path!r} is not the tokenizer of "
        f"{policy_name(config)} (e.g. token/id pairs {differing} are in one only): a draft "
        "model must share the policy's tokenizer.")


def _draft_network(section, config, vocab_size: int) -> Transformer:
  if section.path:
    return load_hf(section.path)
  model = section.model
  return Transformer(model.model_config(vocab_size=vocab_size), rngs=nnx.Rngs(model.seed))


def _draft_model_build(context: BuildContext) -> DraftModel:
  section, config = context.section, context.config
  if not section.path and config.warm_start.distill_steps == 0:
    context.log("warning: drafter: the draft model starts untrained (no --drafter.path, "
                "warm_start.distill_steps=0) and learns online from the rollouts: acceptance "
                "starts near 1. Give --drafter.path=HF_FOLDER for a useful drafter from step 0.")
  return DraftModel(context.draft)


register_drafter(DrafterKind(
    name="draft_model", learned=always, takes_path=always,
    simulator="draft_model",
    doc="a small model: --drafter.path=HF_FOLDER (pretrained, the policy's tokenizer) or "
        "drafter.model's sizes distilled from the policy in the warm start",
    build=_draft_model_build, check=_draft_model_check, check_files=_draft_model_files,
    draft_network=_draft_network, distils=lambda section: not section.path,
    warm_start_key=lambda section: ({"kind": "draft_model", "path": section.path}
                                    if section.path else
                                    {"kind": "draft_model",
                                     "model": dataclasses.asdict(section.model)})))


# ----------------------------------------------------------------- eagle3 and mtp

def _head_files(name: str, specforge: bool):
  def check_files(section, config) -> None:
    if not section.path:
      return
    native = os.path.join(section.path, NATIVE_HEAD)
    if os.path.isfile(native):
      with open(native) as f:
        saved = json.load(f).get("kind")
      expected = "Eagle3" if name == "eagle3" else "MTP"
      check(saved == expected, "DrafterSection", "path", section.path,
            f"a saved {expected} head (save_drafter); it holds a {saved} head")
      return
    check(specforge and os.path.isfile(os.path.join(section.path, SPECFORGE_CONFIG)),
          "DrafterSection", "path", section.path,
          f"a folder with {NATIVE_HEAD} (a head saved by sj.drafters.save_drafter)"
          + (f" or {SPECFORGE_CONFIG} (a SpecForge / EAGLE-3 checkpoint)" if specforge else ""))
    hf = read_model_config(section.path, "DrafterSection.path")
    vocab_size, hidden_size = policy_sizes(config)
    if (hf.get("vocab_size"), hf.get("hidden_size")) != (vocab_size, hidden_size):
      raise ConfigError(
          f"DrafterSection.path={section.path!r} is an EAGLE-3 head for vocab_size="
          f"{hf.get('vocab_size')}, hidden_size={hf.get('hidden_size')} but "
          f"{policy_name(config)} has vocab_size={vocab_size}, hidden_size={hidden_size}: "
          "a head reads its own target's hidden states.")
  return check_files


def _eagle3_build(context: BuildContext) -> Eagle3:
  section, policy = context.section, context.policy
  if section.path and not os.path.isfile(os.path.join(section.path, NATIVE_HEAD)):
    return load_specforge(section.path, policy)
  fresh = Eagle3(policy, seed=section.model.seed)
  return load_drafter(section.path, fresh) if section.path else fresh


def _mtp_build(context: BuildContext) -> MTP:
  fresh = MTP(context.policy, seed=context.section.model.seed)
  return load_drafter(context.section.path, fresh) if context.section.path else fresh


def _head_check(section, config) -> None:
  if not section.path and not section.online:
    raise ConfigError(
        f"DrafterSection.kind={section.kind!r} with no --drafter.path and online=False would "
        "draft with an untrained head for the whole run: give --drafter.path (a trained "
        "head) or --drafter.online=true (trained on the policy's hidden states during RL).")


register_drafter(DrafterKind(
    name="eagle3", learned=always, takes_path=always,
    simulator="eagle3",
    doc="an EAGLE-3 head on the policy's hidden states: trained from scratch during RL, or "
        "--drafter.path=a SpecForge checkpoint or a saved head",
    build=_eagle3_build, check=_head_check, check_files=_head_files("eagle3", True)))

register_drafter(DrafterKind(
    name="mtp", learned=always, takes_path=always,
    simulator="mtp",
    doc="a multi-token-prediction head on the policy's last hidden state: trained from "
        "scratch during RL, or --drafter.path=a saved head",
    build=_mtp_build, check=_head_check, check_files=_head_files("mtp", False)))


# ----------------------------------------------------------------- history

def _fallback(section):
  """The section as its fallback kind sees it."""
  return dataclasses.replace(section, kind=section.fallback, fallback="none")


def _history_check(section, config) -> None:
  allowed = sorted(k for k in DRAFTERS if k not in ("history",))
  check(section.fallback in allowed, "DrafterSection", "fallback", section.fallback,
        f"one of {allowed} (where the history has no match)")
  check(config.rl.mode == "sync", "RLSection", "mode", config.rl.mode,
        "'sync' with drafter.kind='history' (its bank of earlier rollouts is filled between "
        "sync steps; the async pipeline does not feed it yet)")
  if section.fallback != "none":
    drafter_kind(section.fallback).check(_fallback(section), config)


def _history_build(context: BuildContext) -> History:
  section = context.section
  fallback = None
  if section.fallback != "none":
    fallback = drafter_kind(section.fallback).build(
        dataclasses.replace(context, section=_fallback(section)))
  return History(fallback, config=section.history)


def _delegate(hook: str, default):
  def call(section, *args):
    if section.fallback == "none":
      return default
    return getattr(drafter_kind(section.fallback), hook)(_fallback(section), *args)
  return call


register_drafter(DrafterKind(
    name="history", simulator="history",
    doc="earlier rollouts of the same prompt (bank), its siblings and the sequence itself; "
        "--drafter.fallback=KIND drafts where they have no match",
    build=_history_build, check=_history_check,
    learned=lambda section: (section.fallback != "none"
                             and drafter_kind(section.fallback).learned(_fallback(section))),
    takes_path=_delegate("takes_path", False), check_files=_delegate("check_files", None),
    draft_network=_delegate("draft_network", None), distils=_delegate("distils", False),
    warm_start_key=_delegate("warm_start_key", None)))

