"""Reinforcement learning: GRPO advantages and losses, and the sharded learner."""

from specrl_jax.rl.advantages import group_advantages
from specrl_jax.rl.learner import (
    SCHEDULES, Batch, DrafterObjective, LearnerConfig, TrainState, TrainStep,
    abstract_train_state, init_train_state, learning_rate_schedule, make_log_prob_step, make_optimizer,
    make_train_step, train_state_shardings, validate_batch,
)
from specrl_jax.rl.logprobs import policy_log_probs, token_log_probs
from specrl_jax.rl.lora import LoRAConfig
from specrl_jax.rl.losses import (
    AGGREGATIONS, GRPOConfig, aggregation_weights, combine_metrics, grpo_loss, k3_kl,
    register_aggregation, valid_token_weights,
)

__all__ = [
    "AGGREGATIONS", "Batch", "DrafterObjective", "GRPOConfig", "LearnerConfig", "LoRAConfig",
    "SCHEDULES",
    "TrainState", "TrainStep", "abstract_train_state", "aggregation_weights", "combine_metrics", "group_advantages",
    "grpo_loss", "init_train_state", "k3_kl", "learning_rate_schedule", "make_log_prob_step",
    "make_optimizer", "make_train_step", "policy_log_probs", "register_aggregation",
    "token_log_probs", "train_state_shardings", "validate_batch", "valid_token_weights",
]
