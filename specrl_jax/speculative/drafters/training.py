"""Training drafters offline, one name space for its parts: the training-time-test loss
of hidden-state drafters (MTP, EAGLE-3; ``training_time_test``), their offline training
on the target's rollouts (``offline``) and native checkpoints (``checkpoints``), and a
draft model distilled on the same rollouts (``draft_model_offline``). Online training
inside the RL learner lives in ``specrl_jax.rl.loop.online_drafters``."""

from specrl_jax.speculative.drafters.checkpoints import load_drafter, save_drafter
from specrl_jax.speculative.drafters.draft_model_offline import (distill_draft_model,
                                                                 distillation_loss)
from specrl_jax.speculative.drafters.hidden_state import HiddenStateDrafter
from specrl_jax.speculative.drafters.offline import (
    DrafterTrainingConfig, RolloutData, build_draft_vocab, evaluate, make_update,
    rollout_data, sequences_to_data, train_offline)
from specrl_jax.speculative.drafters.training_time_test import (
    LABELS, UnrollKV, expected_acceptance_length, target_forward, unroll, unrolled_loss)

__all__ = [
    "DrafterTrainingConfig", "HiddenStateDrafter", "LABELS", "RolloutData", "UnrollKV",
    "build_draft_vocab", "distill_draft_model", "distillation_loss", "evaluate",
    "expected_acceptance_length", "load_drafter",
    "make_update", "rollout_data", "save_drafter", "sequences_to_data", "target_forward",
    "train_offline", "unroll", "unrolled_loss",
]
