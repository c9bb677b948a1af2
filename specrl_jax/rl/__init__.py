"""Reinforcement learning: advantages, policy objectives and losses, and the sharded learner.

Three layers, each importing only those below it: ``rl.app`` (commands, experiment
configs, run directories and data, warm start) -> ``rl.loop`` (rollout, learner, sync
and async RL) -> ``rl.algo`` (advantages, objectives, aggregation); ``rl.tasks`` holds
tasks and rewards and knows none of them."""

from specrl_jax.rl.algo.advantages import (
    ADVANTAGES, estimate_advantages, group_advantages, register_advantage,
)
from specrl_jax.rl.algo.logprobs import policy_log_probs, token_log_probs
from specrl_jax.rl.algo.aggregation import (
    AGGREGATIONS, aggregation_weights, register_aggregation, valid_token_weights,
)
from specrl_jax.rl.algo.losses import GRPOConfig, combine_metrics, grpo_loss, k3_kl
from specrl_jax.rl.algo.objectives import OBJECTIVES, ObjectiveTerms, register_objective
from specrl_jax.rl.loop.learner import (
    SCHEDULES, Batch, DrafterObjective, LearnerConfig, TrainState, TrainStep,
    abstract_train_state, init_train_state, learning_rate_schedule, make_log_prob_step, make_optimizer,
    make_train_step, train_state_shardings, validate_batch,
)
from specrl_jax.rl.loop.lora import LoRAConfig

__all__ = [
    "ADVANTAGES", "AGGREGATIONS", "Batch", "DrafterObjective", "GRPOConfig",
    "LearnerConfig", "LoRAConfig", "OBJECTIVES", "ObjectiveTerms", "SCHEDULES",
    "TrainState", "TrainStep", "abstract_train_state", "aggregation_weights",
    "combine_metrics", "estimate_advantages", "group_advantages", "grpo_loss",
    "init_train_state", "k3_kl", "learning_rate_schedule", "make_log_prob_step",
    "make_optimizer", "make_train_step", "policy_log_probs", "register_advantage",
    "register_aggregation", "register_objective", "token_log_probs",
    "train_state_shardings", "valid_token_weights", "validate_batch",
]
