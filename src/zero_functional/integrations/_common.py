"""What the framework glue shares: finding our optimizer inside a framework's wrapper."""

from __future__ import annotations

from zero_functional import comm
from zero_functional.optimizer import ZeroRedundancyOptimizer


def unwrap(optimizer: object) -> ZeroRedundancyOptimizer | None:
    """The ZeroRedundancyOptimizer ``optimizer`` is, or wraps through ``.optimizer`` (Accelerate's
    and Lightning's wrappers), else None.

    Example:
        >>> class Wrapper:
        ...     optimizer = None
        >>> unwrap(Wrapper()) is None
        True
    """
    for _ in range(8):  # wrappers of wrappers, never a cycle
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None


def saved_on_each_node(setting: str) -> ValueError:
    """The error for a framework set to save on each node: the state is gathered on one."""
    return ValueError(
        f"{setting}(save_on_each_node=True) writes the optimizer on each node's first process, "
        "but a ZeroRedundancyOptimizer's state is gathered on one process: pass "
        "save_on_each_node=False (the default)"
    )


def rank_of_global_zero(zero: ZeroRedundancyOptimizer) -> int:
    """The rank, in ``zero``'s process group, of global rank 0: where frameworks save (a
    ValueError if the group lacks it)."""
    for rank in range(zero.world_size):
        if comm.global_rank(zero.process_group, rank) == 0:
            return rank
    raise ValueError(
        "the ZeroRedundancyOptimizer's process group does not contain global rank 0, the "
        "process that saves checkpoints: shard over a group that contains it (or the world)"
    )
