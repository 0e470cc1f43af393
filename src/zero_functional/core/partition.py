"""Which rank owns what: pure partitions of parameter sizes, and their balance.

Two partitions:

* :func:`sorted_greedy` keeps parameters whole, as torch's ``ZeroRedundancyOptimizer`` does
  (largest first, each to the least-loaded rank), so state dicts line up with torch's.
* :func:`flat` splits the concatenation of all parameters evenly (a parameter may straddle
  ranks, as in DeepSpeed and Apex): perfect balance whatever the largest parameter.

:func:`balance_report` says how far a partition is from the best possible.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from zero_functional.core._validate import (
    ceil_div,
    check_align,
    check_numels,
    check_world_size,
    first_of,
    prefix_sums,
    round_up,
)

__all__ = [
    "BalanceReport",
    "max_over_mean",
    "FlatPartition",
    "RankBytes",
    "RankTraffic",
    "Piece",
    "balance_report",
    "check_tiling",
    "block_bounds",
    "flat",
    "hybrid_shape",
    "owners",
    "rank_bytes",
    "rank_loads",
    "rank_traffic",
    "sorted_greedy",
    "sorted_greedy_groups",
]


def sorted_greedy(
    numels: Sequence[int], world_size: int, *, initial_loads: Sequence[int] | None = None
) -> tuple[tuple[int, ...], ...]:
    """torch's partition: largest parameter first, each to the first least-loaded rank.

    The sort is stable (equal sizes keep their order) and ties between ranks go to the lowest
    rank, exactly as torch's ``ZeroRedundancyOptimizer`` assigns them.

    Args:
        numels: Number of elements of each parameter.
        world_size: Number of ranks.
        initial_loads: Load each rank already carries (from earlier parameter groups).

    Returns:
        For each rank, the indices of the parameters it owns, in assignment order.

    Raises:
        ValueError: ``world_size < 1``, a negative size, or ``initial_loads`` of the wrong length.

    Example:
        >>> sorted_greedy([5, 1, 7, 3], world_size=2)
        ((2, 1), (0, 3))
    """
    check_world_size(world_size)
    check_numels(numels)
    loads = [0] * world_size if initial_loads is None else list(initial_loads)
    if len(loads) != world_size:
        raise ValueError(
            f"initial_loads has {len(loads)} entries but world_size is {world_size}: "
            "pass one load per rank, or None to start from zero"
        )
    negative = [r for r, load in enumerate(loads) if load < 0]
    if negative:
        raise ValueError(
            f"initial_loads has a negative load at ranks {first_of(negative)} (rank "
            f"{negative[0]}: {loads[negative[0]]}): pass element counts (>= 0)"
        )
    # compat: torch's `_get_min_index` takes the first rank of minimal load; a heap keyed
    # (load, rank) pops exactly that rank, in O(log N) instead of torch's O(N) scan.
    heap = [(load, rank) for rank, load in enumerate(loads)]
    heapq.heapify(heap)
    owned: list[list[int]] = [[] for _ in range(world_size)]
    # compat: torch sorts with `sorted(..., key=numel, reverse=True)`, which is stable, so
    # equal sizes keep their original order; negating the key keeps that order too.
    for index in sorted(range(len(numels)), key=lambda i: -numels[i]):
        load, rank = heap[0]
        owned[rank].append(index)
        heapq.heapreplace(heap, (load + numels[index], rank))
    return tuple(tuple(r) for r in owned)


def sorted_greedy_groups(
    group_numels: Sequence[Sequence[int]], world_size: int
) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """:func:`sorted_greedy` over several parameter groups, loads carrying over between groups.

    torch partitions ``param_groups`` one after another with one running load per rank, so a
    rank that took a big parameter in group 0 is passed over in group 1.

    Args:
        group_numels: For each parameter group, the number of elements of each parameter.
        world_size: Number of ranks.

    Returns:
        ``result[group][rank]``: indices within that group owned by ``rank``.

    Example:
        >>> sorted_greedy_groups([[4, 2], [3]], world_size=2)
        (((0,), (1,)), ((), (0,)))
    """
    check_world_size(world_size)
    loads = [0] * world_size
    result = []
    for numels in group_numels:
        part = sorted_greedy(numels, world_size, initial_loads=loads)
        loads = [load + sum(numels[i] for i in idx) for load, idx in zip(loads, part)]
        result.append(part)
    return tuple(result)


def owners(partition: Sequence[Sequence[int]], num_params: int) -> tuple[int, ...]:
    """For each parameter index, the rank that owns it.

    Args:
        partition: For each rank, the indices of the parameters it owns.
        num_params: Number of parameters.

    Returns:
        ``result[i]`` is the rank that owns parameter ``i``.

    Raises:
        ValueError: An index out of range, owned twice, or not owned.

    Example:
        >>> owners(((2, 1), (0, 3)), 4)
        (1, 0, 0, 1)
    """
    owner = [-1] * num_params
    for rank, indices in enumerate(partition):
        for i in indices:
            if not 0 <= i < num_params:
                raise ValueError(f"rank {rank} owns index {i}, outside 0..{num_params - 1}")
            if owner[i] != -1:
                raise ValueError(f"parameter {i} is owned by ranks {owner[i]} and {rank}")
            owner[i] = rank
    if -1 in owner:
        raise ValueError(f"parameter {owner.index(-1)} is owned by no rank")
    return tuple(owner)


def rank_loads(numels: Sequence[int], partition: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """Total elements per rank.

    Args:
        numels: Number of elements of each parameter.
        partition: For each rank, the indices of the parameters it owns.

    Returns:
        For each rank, the sum of ``numels`` over the parameters it owns.

    Raises:
        ValueError: An index outside ``range(len(numels))``.

    Example:
        >>> rank_loads([5, 1, 7, 3], ((2, 1), (0, 3)))
        (8, 8)
    """
    n = len(numels)
    loads = []
    for rank, indices in enumerate(partition):
        load = 0
        for i in indices:
            if not 0 <= i < n:
                raise ValueError(
                    f"rank {rank} owns index {i}, outside 0..{n - 1}: "
                    "the partition was computed for other numels"
                )
            load += numels[i]
        loads.append(load)
    return tuple(loads)


@dataclass(frozen=True, slots=True)
class Piece:
    """Elements ``[start, stop)`` of the flattened (row-major) parameter ``param``, which has
    ``param_numel`` elements. Empty only for a zero-size parameter, owned as ``[0, 0)``.

    Example:
        >>> Piece(0, 0, 6, param_numel=6).is_whole, Piece(0, 2, 6, param_numel=6).is_whole
        (True, False)
    """

    param: int
    start: int
    stop: int
    param_numel: int = field(repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.param < 0 or not 0 <= self.start <= self.stop:
            raise ValueError(
                f"Piece(param={self.param}, start={self.start}, stop={self.stop}) needs "
                "param >= 0 and 0 <= start <= stop"
            )
        if self.stop > self.param_numel:
            raise ValueError(
                f"Piece(param={self.param}, start={self.start}, stop={self.stop}) ends past "
                f"its parameter's {self.param_numel} elements"
            )

    @property
    def numel(self) -> int:
        """Number of elements in the piece."""
        return self.stop - self.start

    @property
    def is_whole(self) -> bool:
        """Whether the piece is all of its parameter."""
        return self.start == 0 and self.stop == self.param_numel


def check_tiling(param: int, numel: int, held: Sequence[tuple[int, Piece]]) -> None:
    """Raise a ValueError naming the first misfit unless ``held``, the ``(rank, piece)`` of a
    parameter of ``numel`` elements in element order, tiles it exactly once (a zero-size
    parameter: one empty piece). The message names the first 8 pieces, at any world size.

    Example:
        >>> check_tiling(0, 4, [(0, Piece(0, 0, 2, 4)), (1, Piece(0, 2, 4, 4))])
        >>> check_tiling(0, 4, [(0, Piece(0, 0, 2, 4))])
        Traceback (most recent call last):
        ...
        ValueError: parameter 0 (4 elements) is owned as (0, 0, 2) (rank, start, stop): every element must have exactly one owner (a zero-size parameter one empty piece)
    """

    def owned_as() -> str:  # only once it fails: at 4,096 ranks the pieces are many
        return first_of([(r, s.start, s.stop) for r, s in held]) or "nothing"

    edge = 0
    for r, piece in held:
        if piece.start != edge or (piece.start == piece.stop and numel):
            raise ValueError(
                f"parameter {param} ({numel} elements) is owned as {owned_as()} (rank, start, "
                f"stop), and rank {r}'s piece [{piece.start}, {piece.stop}) follows element "
                f"{edge}: its pieces must tile it exactly once, without empty pieces"
            )
        edge = piece.stop
    if edge != numel or not held or (numel == 0 and len(held) != 1):
        raise ValueError(
            f"parameter {param} ({numel} elements) is owned as {owned_as()} (rank, start, stop): "
            "every element must have exactly one owner (a zero-size parameter one empty piece)"
        )


@dataclass(frozen=True, slots=True)
class FlatPartition:
    """An even split of the concatenation of all parameters into contiguous per-rank ranges."""

    numels: tuple[int, ...]
    world_size: int
    align: int
    bounds: tuple[tuple[int, int], ...]
    pieces: tuple[tuple[Piece, ...], ...]

    def __post_init__(self) -> None:
        check_world_size(self.world_size)
        check_align(self.align)
        check_numels(self.numels)
        if len(self.bounds) != self.world_size or len(self.pieces) != self.world_size:
            raise ValueError(
                f"a FlatPartition over {self.world_size} ranks needs {self.world_size} bounds and "
                f"piece lists, got {len(self.bounds)} and {len(self.pieces)}: build it with flat()"
            )
        starts = prefix_sums(self.numels)
        total = starts[-1]
        edge = 0
        for rank, ((start, stop), rank_pieces) in enumerate(zip(self.bounds, self.pieces)):
            if start != edge or stop < start:
                raise ValueError(
                    f"rank {rank} has range [{start}, {stop}) after {edge}: ranges must be "
                    "contiguous and in rank order"
                )
            if any(b % self.align and b != total for b in (start, stop)):
                raise ValueError(
                    f"rank {rank} has range [{start}, {stop}), not on multiples of align={self.align}"
                )
            pos = start
            for piece in rank_pieces:
                if piece.param >= len(self.numels) or piece.stop > self.numels[piece.param]:
                    raise ValueError(
                        f"rank {rank} has {piece}, outside the {len(self.numels)} parameters "
                        f"of sizes {first_of(self.numels)}"
                    )
                if starts[piece.param] + piece.start != pos:
                    raise ValueError(
                        f"rank {rank} has {piece} at element {starts[piece.param] + piece.start}, "
                        f"expected element {pos}: pieces must tile the rank's range in order"
                    )
                pos += piece.stop - piece.start
            if pos != stop:
                raise ValueError(
                    f"pieces of rank {rank} cover [{start}, {pos}), not [{start}, {stop})"
                )
            edge = stop
        if edge != total:
            raise ValueError(f"rank ranges cover {edge} elements of {total}: build it with flat()")

    @property
    def loads(self) -> tuple[int, ...]:
        """Elements per rank."""
        return tuple(stop - start for start, stop in self.bounds)


def flat(
    numels: Sequence[int],
    world_size: int,
    *,
    align: int = 1,
    blocks: Sequence[int] | None = None,
) -> FlatPartition:
    """Split the concatenation of all parameters into ``world_size`` contiguous ranges.

    Each rank gets at most ``ceil(total / world_size)`` elements rounded up to a multiple of
    ``align`` (the last ranks may get less, or nothing); range bounds are multiples of ``align``
    except the end of the data. A parameter may straddle ranks; zero-size parameters appear in
    no piece.

    Args:
        numels: Number of elements of each parameter, in concatenation order.
        world_size: Number of ranks.
        align: Every range starts on a multiple of this many elements.
        blocks: Per parameter, its optimizer's quantization block: a bound inside a parameter
            moves up to a block boundary counted from its start (:func:`block_bounds`), which
            wins over ``align`` (the result's ``align`` is then 1).

    Returns:
        The ranges and, per rank, the pieces of parameters that fill its range in order.

    Raises:
        ValueError: ``world_size < 1``, ``align < 1`` or a negative size.

    Example:
        >>> p = flat([6, 3], world_size=2)
        >>> p.bounds
        ((0, 5), (5, 9))
        >>> p.pieces[1]
        (Piece(param=0, start=5, stop=6), Piece(param=1, start=0, stop=3))
    """
    check_world_size(world_size)
    check_numels(numels)
    check_align(align)
    starts = prefix_sums(numels)
    total = starts[-1]
    # Integer ceilings: total / world_size in floating point loses exactness past 2**53.
    chunk = round_up(ceil_div(total, world_size), align)
    bounds = tuple((min(r * chunk, total), min((r + 1) * chunk, total)) for r in range(world_size))
    if blocks is not None and any(b > 1 for b in blocks):
        bounds = block_bounds(bounds, numels, blocks)
        align = align if all(lo % align == 0 for lo, _ in bounds) else 1
    pieces: list[tuple[Piece, ...]] = []
    p = 0
    for lo, hi in bounds:
        rank_pieces = []
        while p < len(numels) and starts[p + 1] <= lo:
            p += 1
        q = p
        while q < len(numels) and starts[q] < hi:
            a, b = max(lo, starts[q]), min(hi, starts[q + 1])
            if b > a:
                rank_pieces.append(Piece(q, a - starts[q], b - starts[q], numels[q]))
            q += 1
        pieces.append(tuple(rank_pieces))
    return FlatPartition(tuple(numels), world_size, align, bounds, tuple(pieces))


def block_bounds(
    bounds: Sequence[tuple[int, int]], numels: Sequence[int], blocks: Sequence[int]
) -> tuple[tuple[int, int], ...]:
    """Contiguous ranges ``bounds`` over the concatenation of parameters of ``numels``, each
    bound inside a parameter moved up to the next multiple of that parameter's block counted
    from its start (or to its end): ranges that cut no quantization block in two.

    Example:
        >>> block_bounds(((0, 7), (7, 14)), [2, 12], [1, 4])  # 7 is element 5 of the second
        ((0, 10), (10, 14))
    """
    starts = prefix_sums(numels)

    def snapped(c: int) -> int:
        j = bisect.bisect_right(starts, c) - 1
        if j >= len(numels) or c == starts[j]:
            return c
        return min(starts[j] + round_up(c - starts[j], blocks[j]), starts[j + 1])

    cuts = [snapped(lo) for lo, _ in bounds] + [bounds[-1][1]]
    return tuple(zip(cuts[:-1], cuts[1:]))


def max_over_mean(loads: Sequence[int]) -> float:
    """The busiest rank's load over the mean load (1.0 is perfect; 1.0 when all are 0).

    Raises:
        ValueError: No loads.

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

    def __post_init__(self) -> None:
        if not self.loads or self.max_load != max(self.loads):
            raise ValueError(
                f"max_load {self.max_load} is not the maximum of loads {self.loads}: "
                "build the report with balance_report()"
            )
        if self.largest < 0 or self.lower_bound < 0:
            raise ValueError("largest and lower_bound must be >= 0: build it with balance_report()")

    @property
    def max_over_mean(self) -> float:
        """Max load / mean load (1.0 is perfect)."""
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
    """The balance of ``partition`` (whole-parameter or flat) over ``numels``, in O(P + N).

    The lower bound is ``max(largest, total / world_size)``: no whole-parameter partition can
    beat it (a flat one can, down to ``total / world_size``, so its ``max_over_lower_bound``
    may be below 1).

    Args:
        numels: Number of elements of each parameter.
        partition: Per rank the indices it owns (:func:`sorted_greedy`), or a :func:`flat` split.

    Returns:
        Loads, their maximum and mean, the largest parameter and the lower bound.

    Raises:
        ValueError: A negative size, or a partition computed for other ``numels``.

    Example:
        >>> r = balance_report([5, 1, 7, 3], sorted_greedy([5, 1, 7, 3], 2))
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
    total = sum(numels)
    largest = max(numels, default=0)
    return BalanceReport(
        loads=tuple(loads),
        max_load=max(loads),
        mean_load=sum(loads) / n,
        largest=largest,
        lower_bound=float(max(largest, total / n)),
    )


@dataclass(frozen=True, slots=True)
class RankBytes:
    """One rank's training memory in bytes: what every rank holds whole (``params``,
    ``grads``) and what it holds only for the elements it owns (``main``, ``state``)."""

    params: int
    grads: int
    main: int
    state: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.main + self.state


def rank_bytes(
    load: int, total: int, *, param_bytes: int, main_bytes: int = 0, states: int = 2
) -> RankBytes:
    """The bytes of a rank that owns ``load`` of a model's ``total`` elements (ZeRO stage 1).

    Parameters and gradients are whole on every rank, ``param_bytes`` per element. A main
    copy exists where the main dtype is wider than the parameters' (``main_bytes >
    param_bytes``; ``main_params_dtype``): ``main_bytes`` per owned element, and the
    optimizer's ``states`` per-element states (2 for Adam/AdamW) are then in the main dtype;
    without one they are in the parameters' dtype.

    Raises:
        ValueError: A negative count, ``load > total``, or a byte size below 1.

    Example:
        >>> rank_bytes(6, 12, param_bytes=2, main_bytes=4)  # bf16, fp32 main copy, AdamW
        RankBytes(params=24, grads=24, main=24, state=48)
        >>> rank_bytes(6, 12, param_bytes=2)  # bf16 alone: bf16 moments
        RankBytes(params=24, grads=24, main=0, state=24)
        >>> rank_bytes(6, 12, param_bytes=4, main_bytes=4).total  # fp32 needs no main copy
        144
    """
    if load < 0 or total < load or states < 0:
        raise ValueError(
            f"need 0 <= load <= total and states >= 0, got load {load}, total {total}, "
            f"states {states}"
        )
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
        state=states * (main or param_bytes) * load,
    )


def hybrid_shape(world_size: int, shard_size: int) -> tuple[int, int]:
    """The mesh ``(replicas, shard_size)`` of hybrid sharding: ``world_size`` ranks in
    ``world_size / shard_size`` replica groups of ``shard_size`` ranks each.

    Raises:
        ValueError: ``world_size < 1``, ``shard_size < 1``, or ``shard_size`` does not divide
            ``world_size``; the message lists the shard sizes that do.

    Example:
        >>> hybrid_shape(64, 8)
        (8, 8)
        >>> hybrid_shape(12, 8)
        Traceback (most recent call last):
        ...
        ValueError: shard size 8 does not divide world size 12: pass one of its divisors, 1, 2, 3, 4, 6, 12
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
    """Bytes one rank sends per step under hybrid sharding (bandwidth-optimal rings, the
    standard model): ``within`` its shard group (a node), ``across`` its replicate group."""

    within: float
    across: float

    @property
    def total(self) -> float:
        return self.within + self.across


def rank_traffic(nbytes: int, shard_size: int, replicas: int = 1) -> RankTraffic:
    """Bytes per rank and step for ``nbytes`` of gradients (and as many of parameters) on a
    ``replicas x shard_size`` mesh: state sharded within, replicated across.

    Within the shard group, the reduce of the gradients onto their owners and the gather of
    the updated parameters each move ``B (S-1)/S`` per rank: ``2 B (S-1)/S``. Across, each
    owner's piece (``B/S``) is all-reduced over its ``R`` replicas, ``2 (B/S) (R-1)/R``. With
    ``replicas=1`` this is 1-D ZeRO (all within); with ``shard_size=1``, plain DDP's all-reduce
    (all across).

    Raises:
        ValueError: ``nbytes < 0``, or ``shard_size`` or ``replicas`` below 1.

    Example:
        >>> rank_traffic(800, shard_size=8, replicas=8)  # 64 ranks, 8 per node
        RankTraffic(within=1400.0, across=175.0)
        >>> rank_traffic(800, shard_size=64).across, rank_traffic(800, 1, 64).across
        (0.0, 1575.0)
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
