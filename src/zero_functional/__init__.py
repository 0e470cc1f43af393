"""zero_functional: ZeRO stage-1 sharded optimizers with a pure functional core.

The public surface is what this module re-exports:

* the drop-in shell :class:`ZeroRedundancyOptimizer` and the overlap hooks
  :func:`hook_with_zero_step` / :func:`hook_with_zero_step_interleaved`;
* the pure core: partitions (:func:`sorted_greedy`, :func:`flat`, :func:`balance_report`),
  bucket layouts, and functional optimizers (:func:`sgd`, :func:`adam`, :func:`adamw`);
* ownership, the one value that says which rank owns which pieces of which parameters
  (:class:`Ownership`, built by :func:`sorted_greedy_ownership`, :func:`flat_ownership`,
  :func:`bucket_ownership`), and the collectives policy (:func:`choose_collectives`);
* the functional ZeRO step for custom loops (:func:`shard_init`, :func:`shard_update`) with
  its collectives :func:`reduce_to_owners` and :func:`sync_params`.
"""

from __future__ import annotations

from zero_functional.buckets import (
    BucketAssignment,
    BucketLayout,
    bucket_layout,
    ddp_bucket_assignments,
    flatten,
    views,
)
from zero_functional.collectives import bytes_sent, choose_collectives
from zero_functional.comm import reduce_to_owners, sync_params
from zero_functional.functional import (
    AdamState,
    FunctionalOptimizer,
    SGDState,
    adam,
    adamw,
    functional_spec,
    sgd,
)
from zero_functional.hooks import (
    hook_with_zero_step,
    hook_with_zero_step_interleaved,
    overlap_state,
    reduce_scatter_hook,
)
from zero_functional.optimizer import ZeroRedundancyOptimizer
from zero_functional.ownership import (
    Ownership,
    bucket_ownership,
    flat_ownership,
    piece_view,
    piece_views,
    sorted_greedy_ownership,
)
from zero_functional.partition import (
    BalanceReport,
    FlatPartition,
    Segment,
    balance_report,
    flat,
    owners,
    sorted_greedy,
    sorted_greedy_groups,
)
from zero_functional.sharded import ShardState, shard_init, shard_update

__all__ = [
    "AdamState",
    "BalanceReport",
    "BucketAssignment",
    "BucketLayout",
    "FlatPartition",
    "FunctionalOptimizer",
    "Ownership",
    "SGDState",
    "Segment",
    "ShardState",
    "ZeroRedundancyOptimizer",
    "adam",
    "adamw",
    "balance_report",
    "bucket_layout",
    "bucket_ownership",
    "bytes_sent",
    "choose_collectives",
    "ddp_bucket_assignments",
    "flat",
    "flat_ownership",
    "flatten",
    "functional_spec",
    "hook_with_zero_step",
    "hook_with_zero_step_interleaved",
    "overlap_state",
    "owners",
    "piece_view",
    "piece_views",
    "reduce_scatter_hook",
    "reduce_to_owners",
    "sgd",
    "shard_init",
    "shard_update",
    "sorted_greedy",
    "sorted_greedy_ownership",
    "sorted_greedy_groups",
    "sync_params",
    "views",
]
__version__ = "0.1.0"
