"""Training hidden-state drafters (MTP, EAGLE-3), one name space for its three parts:
the training-time-test loss (``training_time_test``), offline training on the target's
rollouts (``offline``) and native checkpoints (``checkpoints``). Online training
inside the RL learner lives in ``specrl_jax.rl.loop.online_drafters``."""

from specrl_jax.speculative.drafters.checkpoints import load_drafter, save_drafter
from specrl_jax.speculative.drafters.hidden_state import HiddenStateDrafter
from specrl_jax.speculative.drafters.offline import (
    DrafterTrainingConfig, RolloutData, build_draft_vocab, evaluate, make_update,
    rollout_data, sequences_to_data, train_offline)
from specrl_jax.speculative.drafters.training_time_test import (
    LABELS, UnrollKV, expected_acceptance_length, target_forward, unroll, unrolled_loss)

__all__ = [
    "DrafterTrainingConfig", "HiddenStateDrafter", "LABELS", "RolloutData", "UnrollKV",
    "build_draft_vocab", "evaluate", "expected_acceptance_length", "load_drafter",
    "make_update", "rollout_data", "save_drafter", "sequences_to_data", "target_forward",
    "train_offline", "unroll", "unrolled_loss",
]
