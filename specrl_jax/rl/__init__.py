"""Reinforcement learning: GRPO advantages and losses, and the sharded learner.

Three layers, each importing only those below it: ``rl.app`` (commands, experiment
configs, run directories and data, warm start) -> ``rl.loop`` (rollout, learner, sync
and async RL) -> ``rl.algo`` (advantages, objectives, aggregation); ``rl.tasks`` holds
tasks and rewards and knows none of them."""

from specrl_jax.rl.algo.advantages import group_advantages
from specrl_jax.rl.algo.logprobs import policy_log_probs, token_log_probs
from specrl_jax.rl.algo.losses import (
    AGGREGATIONS, GRPOConfig, aggregation_weights, combine_metrics, grpo_loss, k3_kl,
    register_aggregation, valid_token_weights,
)
from specrl_jax.rl.loop.learner import (
    SCHEDULES, Batch, DrafterObjective, LearnerConfig, TrainState, TrainStep,
    abstract_train_state, init_train_state, learning_rate_schedule, make_log_prob_step, make_optimizer,
    make_train_step, train_state_shardings, validate_batch,
)
from specrl_jax.rl.loop.lora import LoRAConfig

__all__ = [
    "AGGREGATIONS", "Batch", "DrafterObjective", "GRPOConfig", "LearnerConfig", "LoRAConfig",
    "SCHEDULES",
    "TrainState", "TrainStep", "abstract_train_state", "aggregation_weights", "combine_metrics", "group_advantages",
    "grpo_loss", "init_train_state", "k3_kl", "learning_rate_schedule", "make_log_prob_step",
    "make_optimizer", "make_train_step", "policy_log_probs", "register_aggregation",
    "token_log_probs", "train_state_shardings", "validate_batch", "valid_token_weights",
]
