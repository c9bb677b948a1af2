"""The drafters (``sj.drafters`` is their short public face) and their checkpoints and
offline training. Lazy, so that importing a drafter does not import training's
dependencies."""

from specrl_jax.lazy import lazy_face

_SOURCES = {
    "DraftModel": "draft_model",
    "Drafter": "base",
    "DrafterTrainingConfig": "offline",
    "Eagle3": "eagle3",
    "Eagle3Config": "eagle3",
    "HiddenStateDrafter": "hidden_state",
    "History": "history",
    "HistoryConfig": "history_store",
    "HistoryStore": "history_store",
    "MTP": "mtp",
    "NGram": "ngram",
    "RoundInputs": "base",
    "TreeLevel": "base",
    "load_drafter": "checkpoints",
    "load_specforge": "specforge",
    "save_drafter": "checkpoints",
    "save_specforge": "specforge",
    "train_offline": "offline",
}
__all__ = sorted(_SOURCES)
__getattr__, __dir__ = lazy_face(__name__, _SOURCES)
