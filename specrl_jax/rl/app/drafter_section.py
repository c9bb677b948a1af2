"""The ``--drafter.*`` section of an experiment: which drafter the rollouts use, how
it is trained, and the in-loop draft-shape controller's menu and round costs."""

from __future__ import annotations

import dataclasses

from specrl_jax.config import (SpecConfig, check, check_finite_number, check_positive_int,
                               is_finite_number)
from specrl_jax.rl.app import drafter_registry
from specrl_jax.rl.app.model_section import ModelSection
from specrl_jax.speculative import inloop_calibration
from specrl_jax.speculative.drafters.history_store import HistoryConfig
from specrl_jax.speculative.inloop import MAX_TREES


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterSection:
  """The rollouts' drafter, by registry name (``rl.app.drafter_registry``):
  kind: "none" (plain rollouts), "ngram", "history", "draft_model", "eagle3" or "mtp".
  path: pretrained weights of a draft_model (a Hugging Face folder sharing the policy's
    tokenizer), eagle3 (a SpecForge checkpoint or a saved head) or mtp (a saved head);
    '' trains them: draft_model distilled from the policy in the warm start (drafter
    ``model``'s sizes), eagle3 / mtp from scratch on the policy's hidden states.
  online: learned drafters keep training on each step's rollouts during RL.
  fallback: for kind "history", the kind that drafts where the history has no match
    (path, model and online apply to it); history: the history drafter's sizes.

  adaptive: choose the draft shape per round inside the compiled rollout
  (``speculative.inloop``) among plain decoding, chains of 1..num_draft_tokens and
  ``adaptive_trees`` (at most two, children per depth joined by "x", e.g.
  ``--drafter.adaptive_trees=2x2x1,3x1``). round_seconds: the controller's round cost
  table, seconds per round of each shape (rows: plain, chains, trees) at each width of
  slot compaction (columns, widest first), row after row; empty: measured at the start
  of the run on its own device (``speculative.inloop_calibration``) with
  ``calibration_repeats`` timed rollouts per shape, the median kept (3: one pass let a
  single slow rollout set a cell). refresh_weight (async runs, a measured table): after
  each rollout, the cells it ran are rescaled by (its own round seconds / the table's
  prediction) ** (refresh_weight x the cell's share of the prediction)
  (``inloop_calibration.refresh``), so the table follows the device as the
  responses change; 0 keeps the calibration. A resumed run restores the refreshed table
  and chooses as the uninterrupted run did until its first rollout of its own; after that
  the two follow their own clocks."""
  kind: str = "draft_model"
  path: str = ""
  fallback: str = "none"
  num_draft_tokens: int = 3
  online: bool = True
  loss_weight: float = 1.0
  model: ModelSection = ModelSection(hidden_size=64, intermediate_size=128, num_layers=1,
                                     num_heads=2, num_kv_heads=1, head_dim=32, seed=1)
  ngram_n: int = 3
  history: HistoryConfig = HistoryConfig()
  adaptive: bool = False
  adaptive_trees: tuple[str, ...] = ()
  round_seconds: tuple[float, ...] = ()
  calibration_repeats: int = inloop_calibration.REPEATS
  refresh_weight: float = 0.0

  def __post_init__(self):
    owner = "DrafterSection"
    drafter_registry.drafter_kind(self.kind)  # names the registered kinds
    check(isinstance(self.path, str), owner, "path", self.path, "a folder path or ''")
    check(isinstance(self.fallback, str), owner, "fallback", self.fallback, "a drafter kind")
    check_positive_int(owner, "num_draft_tokens", self.num_draft_tokens)
    check_finite_number(owner, "loss_weight", self.loss_weight, at_least=0)
    check(isinstance(self.online, bool), owner, "online", self.online, "True or False")
    check_positive_int(owner, "ngram_n", self.ngram_n)
    check(isinstance(self.history, HistoryConfig), owner, "history", self.history,
          "a HistoryConfig")
    check(self.fallback == "none" or self.kind == "history", owner, "fallback",
          self.fallback, "'none' unless kind='history'")
    check(isinstance(self.model, ModelSection) and self.model.path == "", owner, "model.path",
          getattr(self.model, "path", self.model),
          "'' (a pretrained draft model is given by --drafter.path=HF_FOLDER)")
    check(isinstance(self.adaptive, bool), owner, "adaptive", self.adaptive, "True or False")
    check(not (self.adaptive and self.kind == "none"), owner, "adaptive", self.adaptive,
          "False with kind='none' (adaptive speculation needs a drafter)")
    check_positive_int(owner, "calibration_repeats", self.calibration_repeats)
    check(all(is_finite_number(x) and x > 0 for x in self.round_seconds), owner,
          "round_seconds", self.round_seconds, "positive seconds per round")
    check(not (self.round_seconds or self.adaptive_trees) or self.adaptive, owner,
          "adaptive", self.adaptive, "True when round_seconds or adaptive_trees are given")
    check_finite_number(owner, "refresh_weight", self.refresh_weight, at_least=0)
    check(self.refresh_weight <= 1, owner, "refresh_weight", self.refresh_weight,
          "at most 1 (1 moves the cells a rollout ran all the way to its measurement)")
    check(not self.refresh_weight or (self.adaptive and not self.round_seconds), owner,
          "refresh_weight", self.refresh_weight, "0 unless adaptive=True with a measured "
          "table (round_seconds empty): a given table stays as given")
    self.spec()  # the menu's own checks (trees), now

  def spec(self) -> SpecConfig:
    """The rollouts' SpecConfig."""
    trees = []
    for text in self.adaptive_trees:
      parts = text.split("x")
      check(all(p.isdigit() for p in parts), "DrafterSection", "adaptive_trees", text,
            "children per depth joined by 'x', e.g. 2x2x1")
      trees.append(tuple(int(p) for p in parts))
    check(len(trees) <= MAX_TREES, "DrafterSection", "adaptive_trees", self.adaptive_trees,
          f"at most {MAX_TREES} trees")
    return SpecConfig(num_draft_tokens=self.num_draft_tokens, adaptive=self.adaptive,
                      adaptive_trees=tuple(trees))
