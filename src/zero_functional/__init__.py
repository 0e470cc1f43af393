"""zero_functional: ZeRO stage-1 sharded optimizers with a pure functional core.

The public surface, listed once in ``_MODULES`` (``__all__`` follows): the drop-in
:class:`ZeroRedundancyOptimizer` and its DDP hooks, the pure core (partitions, ownership,
layouts, functional optimizers), :class:`ShardedEMA`, and the functional step for custom loops
(:func:`shard_update`). Each name is imported on first use (PEP 562): ``zero-functional --help``
imports no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_MODULES: dict[str, tuple[str, ...]] = {
    "zero_functional.core.layout": (
        "BucketLayout",
        "bucket_layout",
        "flatten",
        "piece_view",
        "piece_views",
        "views",
    ),
    "zero_functional.core.plans": ("bytes_sent", "choose_collectives"),
    "zero_functional.comm": ("reduce_to_owners", "sync_params"),
    "zero_functional.functional": (
        "AdamState",
        "FunctionalOptimizer",
        "SGDState",
        "adam",
        "adamw",
        "functional_spec",
        "register_optimizer",
        "sgd",
    ),
    "zero_functional.hooks": (
        "hook_with_zero_step",
        "hook_with_zero_step_interleaved",
        "overlap_state",
        "reduce_scatter_hook",
    ),
    "zero_functional.optimizer": ("ZeroRedundancyOptimizer",),
    "zero_functional.ema": ("ShardedEMA",),
    "zero_functional.core.loads": ("BalanceReport", "balance_report"),
    "zero_functional.core.ownership": (
        "Ownership",
        "bucket_ownership",
        "flat_ownership",
        "sorted_greedy_ownership",
        "whole_ownership",
    ),
    "zero_functional.core.partition": (
        "BucketAssignment",
        "FlatPartition",
        "Piece",
        "ddp_bucket_assignments",
        "flat",
        "owners",
        "sorted_greedy",
        "sorted_greedy_groups",
    ),
    "zero_functional.core.sharded": ("ShardState", "shard_init", "shard_update"),
}
_HOME = {name: module for module, names in _MODULES.items() for name in names}
__all__ = sorted(_HOME)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use of the name.

    Example:
        >>> import zero_functional
        >>> zero_functional.flat([6, 3], 2).bounds
        ((0, 5), (5, 9))
    """
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'zero_functional' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup does not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
