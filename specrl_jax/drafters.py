"""``sj.drafters``: the proposal mechanisms speculative decoding can use."""

from specrl_jax.speculative.drafters.base import Drafter, RoundInputs, TreeLevel
from specrl_jax.speculative.drafters.draft_model import DraftModel
from specrl_jax.speculative.drafters.eagle3 import Eagle3
from specrl_jax.speculative.drafters.history import History
from specrl_jax.speculative.drafters.mtp import MTP
from specrl_jax.speculative.drafters.ngram import NGram

__all__ = ["Drafter", "DraftModel", "Eagle3", "History", "MTP", "NGram", "RoundInputs",
           "TreeLevel"]
