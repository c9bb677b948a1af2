"""Loops: the rollout, the learner and its step, sync and async RL, drafter training."""
