"""Mesh construction and partition rules (layers never name mesh axes themselves)."""

from specrl_jax.parallel.mesh import (
    AXES, BATCH_AXES, batch_sharding, data_parallel_size, make_mesh, process_batch_rows,
    replicated, shard_batch,
)
from specrl_jax.parallel.rules import (
    TRANSFORMER_RULES, PartitionRules, named_shardings, partition_specs, path_string,
    spec_for,
)

__all__ = [
    "AXES", "BATCH_AXES", "PartitionRules", "TRANSFORMER_RULES", "batch_sharding",
    "data_parallel_size", "make_mesh", "named_shardings", "partition_specs", "path_string",
    "process_batch_rows", "replicated", "shard_batch", "spec_for",
]
