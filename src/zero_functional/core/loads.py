"""What a partition puts on each rank (pure): elements and their balance, memory, traffic."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from zero_functional.core._validate import check_numels, check_world_size
from zero_functional.core.partition import FlatPartition


def rank_loads(numels: Sequence[int], partition: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """Elements per rank of ``partition`` (per rank, the indices it owns).

    Example:
        >>> rank_loads([5, 1, 7, 3], ((2, 1), (0, 3)))
        (8, 8)
    """
    n = len(numels)
    for rank, indices in enumerate(partition):
        for i in indices:
            if not 0 <= i < n:
                raise ValueError(
                    f"rank {rank} owns index {i}, outside 0..{n - 1}: "
                    "the partition was computed for other numels"
                )
    return tuple(sum(numels[i] for i in indices) for indices in partition)


def max_over_mean(loads: Sequence[int]) -> float:
    """The busiest rank's load over the mean load (1.0 is perfect, and where all are 0).

    Example:
        >>> max_over_mean([3, 5]), max_over_mean([0, 0])
        (1.25, 1.0)
    """
    if not loads:
        raise ValueError("no loads: pass one load per rank")
    total = sum(loads)
    return max(loads) * len(loads) / total if total else 1.0


@dataclass(frozen=True, slots=True)
class BalanceReport:
    """How evenly a partition spreads elements: loads against the best possible."""

    loads: tuple[int, ...]
    max_load: int
    mean_load: float
    largest: int
    lower_bound: float

    @property
    def max_over_mean(self) -> float:
        return max_over_mean(self.loads)

    @property
    def max_over_lower_bound(self) -> float:
        """Max load / ``max(largest, total / world_size)`` (1.0 is the best any split can do)."""
        return self.max_load / self.lower_bound if self.lower_bound else 1.0

    def __str__(self) -> str:
        return (
            f"{len(self.loads)} ranks: max {self.max_load:,} mean {self.mean_load:,.0f} "
            f"bound {self.lower_bound:,.0f} max/mean {self.max_over_mean:.3f} "
            f"max/bound {self.max_over_lower_bound:.3f}"
        )


def balance_report(
    numels: Sequence[int], partition: Sequence[Sequence[int]] | FlatPartition
) -> BalanceReport:
    """The balance of a whole-parameter or flat ``partition``, in O(P + N). The lower bound
    ``max(largest, total / world_size)`` holds for whole parameters; a flat split may beat it.

    Example:
        >>> r = balance_report([5, 1, 7, 3], ((2, 1), (0, 3)))  # sorted_greedy's
        >>> r.max_load, r.lower_bound, r.max_over_lower_bound
        (8, 8.0, 1.0)
    """
    check_numels(numels)
    if isinstance(partition, FlatPartition):
        if partition.numels != tuple(numels):
            raise ValueError(
                "the FlatPartition was computed for other numels: pass the numels given to flat()"
            )
        loads = partition.loads
    else:
        loads = rank_loads(numels, partition)
    n = len(loads)
    if n == 0:
        raise ValueError("the partition has no ranks: pass one index list per rank")
    largest = max(numels, default=0)
    return BalanceReport(
        loads=tuple(loads),
        max_load=max(loads),
        mean_load=sum(loads) / n,
        largest=largest,
        lower_bound=float(max(largest, sum(numels) / n)),
    )


@dataclass(frozen=True, slots=True)
class RankBytes:
    """One rank's training memory in bytes: ``params`` and ``grads`` whole on every rank,
    ``main`` (copies) and ``state`` only for the elements it owns."""

    params: int
    grads: int
    main: int
    state: int


def rank_bytes(load: int, total: int, *, param_bytes: int, main_bytes: int = 0) -> RankBytes:
    """The bytes of a rank owning ``load`` of ``total`` elements (ZeRO-1): AdamW's two
    per-element states in the main copy's dtype where ``main_bytes > param_bytes``.

    Example:
        >>> rank_bytes(6, 12, param_bytes=2, main_bytes=4)  # bf16, fp32 main copy, AdamW
        RankBytes(params=24, grads=24, main=24, state=48)
    """
    if load < 0 or total < load:
        raise ValueError(f"need 0 <= load <= total, got load {load} and total {total}")
    if param_bytes < 1 or main_bytes < 0:
        raise ValueError(
            f"param_bytes must be >= 1 and main_bytes >= 0 (0: no main copy), got "
            f"{param_bytes} and {main_bytes}"
        )
    main = main_bytes if main_bytes > param_bytes else 0
    return RankBytes(
        params=param_bytes * total,
        grads=param_bytes * total,
        main=main * load,
        state=2 * (main or param_bytes) * load,
    )


def hybrid_shape(world_size: int, shard_size: int) -> tuple[int, int]:
    """The mesh ``(replicas, shard_size)`` of hybrid sharding; a ValueError listing the
    divisors of ``world_size`` where ``shard_size`` is not one.

    Example:
        >>> hybrid_shape(64, 8)
        (8, 8)
    """
    check_world_size(world_size)
    if shard_size < 1 or world_size % shard_size:
        small = [d for d in range(1, int(world_size**0.5) + 1) if world_size % d == 0]
        divisors = sorted({*small, *(world_size // d for d in small)})
        shown = ", ".join(map(str, divisors[:12])) + (", ..." if len(divisors) > 12 else "")
        raise ValueError(
            f"shard size {shard_size} does not divide world size {world_size}: pass one of its "
            f"divisors, {shown}"
        )
    return world_size // shard_size, shard_size


@dataclass(frozen=True, slots=True)
class RankTraffic:
    """Bytes one rank sends per step under hybrid sharding: ``within`` its shard group (a
    node), ``across`` its replicate group."""

    within: float
    across: float

    @property
    def total(self) -> float:
        return self.within + self.across


def rank_traffic(nbytes: int, shard_size: int, replicas: int = 1) -> RankTraffic:
    """Bytes per rank and step for ``nbytes`` of gradients (and of parameters) on a
    ``replicas x shard_size`` mesh, by bandwidth-optimal rings: the reduce onto owners and the
    gather ``2 B (S-1)/S`` within, each owner's piece all-reduced ``2 (B/S) (R-1)/R`` across.

    Example:
        >>> rank_traffic(800, shard_size=8, replicas=8)  # 64 ranks, 8 per node
        RankTraffic(within=1400.0, across=175.0)
    """
    if nbytes < 0 or shard_size < 1 or replicas < 1:
        raise ValueError(
            f"need nbytes >= 0, shard_size >= 1 and replicas >= 1, got {nbytes}, {shard_size} "
            f"and {replicas}"
        )
    return RankTraffic(
        within=2 * nbytes * (shard_size - 1) / shard_size,
        across=2 * (nbytes / shard_size) * (replicas - 1) / replicas,
    )
