"""Mesh construction and partition rules (layers never name mesh axes themselves), and
multi-process start-up and transfers (``parallel.distributed``)."""

from specrl_jax.parallel import distributed
from specrl_jax.parallel.distributed import DistributedConfig, DistributedError, transfer
from specrl_jax.parallel.mesh import (
    AXES, BATCH_AXES, batch_sharding, data_parallel_size, make_mesh, process_batch_rows,
    replicated, shard_batch,
)
from specrl_jax.parallel.rules import (
    TRANSFORMER_RULES, PartitionRules, named_shardings, partition_specs, path_string,
    rollout_rules, spec_for,
)

__all__ = [
    "AXES", "BATCH_AXES", "DistributedConfig", "DistributedError", "PartitionRules",
    "TRANSFORMER_RULES", "batch_sharding", "data_parallel_size", "distributed", "make_mesh",
    "named_shardings", "partition_specs", "path_string", "process_batch_rows", "replicated",
    "rollout_rules", "shard_batch", "spec_for", "transfer",
]
