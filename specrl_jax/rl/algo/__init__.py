"""Algorithm: advantages, policy objectives and loss aggregation (pure functions)."""
