"""zero_functional: ZeRO stage-1 sharded optimizers with a pure functional core.

The public surface is what this module re-exports:

* the drop-in shell :class:`ZeroRedundancyOptimizer` and the overlap hooks
  :func:`hook_with_zero_step` / :func:`hook_with_zero_step_interleaved`;
* the pure core: partitions (:func:`sorted_greedy`, :func:`flat`, :func:`balance_report`),
  bucket layouts, and functional optimizers (:func:`sgd`, :func:`adam`, :func:`adamw`);
* the functional ZeRO step for custom loops (:func:`shard_init`, :func:`shard_update`) with
  :func:`sync_params`, its one collective.

Each name is imported from its module on first use (PEP 562), so that importing the package,
as ``zero-functional --help`` does, does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zero_functional.buckets import (
        BucketAssignment,
        BucketLayout,
        bucket_layout,
        ddp_bucket_assignments,
        flatten,
        views,
    )
    from zero_functional.comm import (
        sync_params,
    )
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
    )
    from zero_functional.optimizer import (
        ZeroRedundancyOptimizer,
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
    from zero_functional.sharded import (
        ShardState,
        shard_init,
        shard_owners,
        shard_update,
    )

_MODULES: dict[str, tuple[str, ...]] = {
    "zero_functional.buckets": (
        "BucketAssignment",
        "BucketLayout",
        "bucket_layout",
        "ddp_bucket_assignments",
        "flatten",
        "views",
    ),
    "zero_functional.comm": ("sync_params",),
    "zero_functional.functional": (
        "AdamState",
        "FunctionalOptimizer",
        "SGDState",
        "adam",
        "adamw",
        "functional_spec",
        "sgd",
    ),
    "zero_functional.hooks": ("hook_with_zero_step", "hook_with_zero_step_interleaved"),
    "zero_functional.optimizer": ("ZeroRedundancyOptimizer",),
    "zero_functional.partition": (
        "BalanceReport",
        "FlatPartition",
        "Segment",
        "balance_report",
        "flat",
        "owners",
        "sorted_greedy",
        "sorted_greedy_groups",
    ),
    "zero_functional.sharded": ("ShardState", "shard_init", "shard_owners", "shard_update"),
}
_HOME = {name: module for module, names in _MODULES.items() for name in names}

__all__ = [
    "AdamState",
    "BalanceReport",
    "BucketAssignment",
    "BucketLayout",
    "FlatPartition",
    "FunctionalOptimizer",
    "SGDState",
    "Segment",
    "ShardState",
    "ZeroRedundancyOptimizer",
    "adam",
    "adamw",
    "balance_report",
    "bucket_layout",
    "ddp_bucket_assignments",
    "flat",
    "flatten",
    "functional_spec",
    "hook_with_zero_step",
    "hook_with_zero_step_interleaved",
    "owners",
    "sgd",
    "shard_init",
    "shard_owners",
    "shard_update",
    "sorted_greedy",
    "sorted_greedy_groups",
    "sync_params",
    "views",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """Import a public name's module on first use of the name."""
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'zero_functional' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup does not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
