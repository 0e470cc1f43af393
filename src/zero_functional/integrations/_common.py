"""What the framework glue shares: finding our optimizer inside a framework's wrapper."""

from __future__ import annotations

from zero_functional import comm
from zero_functional.optimizer import ZeroRedundancyOptimizer


def unwrap(optimizer: object) -> ZeroRedundancyOptimizer | None:
    """The ZeroRedundancyOptimizer ``optimizer`` is, or wraps through ``.optimizer`` (as
    Accelerate's ``AcceleratedOptimizer`` and Lightning's ``LightningOptimizer`` do); else None.

    Example:
        >>> class Wrapper:
        ...     optimizer = None
        >>> unwrap(Wrapper()) is None
        True
    """
    seen = 0
    while optimizer is not None and seen < 8:  # wrappers of wrappers, never a cycle
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
        seen += 1
    return None


def rank_of_global_zero(zero: ZeroRedundancyOptimizer) -> int:
    """The rank, in ``zero``'s process group, of global rank 0: where frameworks save.

    Raises:
        ValueError: Global rank 0 is not in the group (the framework would never save it).
    """
    for rank in range(zero.world_size):
        if comm.global_rank(zero.process_group, rank) == 0:
            return rank
    raise ValueError(
        "the ZeroRedundancyOptimizer's process group does not contain global rank 0, the "
        "process that saves checkpoints: shard over a group that contains it (or the world)"
    )
