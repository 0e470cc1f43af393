"""Sizes to ranks (pure): torch's sorted-greedy, the flat split, torch's DDP-bucket assignment."""

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


def sorted_greedy(
    numels: Sequence[int], world_size: int, *, initial_loads: Sequence[int] | None = None
) -> tuple[tuple[int, ...], ...]:
    """torch's partition: per rank the indices it owns, largest first to the least-loaded rank
    (stable; ties to the lowest rank), from ``initial_loads``.

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
    if negative := [r for r, load in enumerate(loads) if load < 0]:
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
    """:func:`sorted_greedy` group after group, loads carrying over as torch's do.

    Example:
        >>> sorted_greedy_groups([[4, 2], [3]], world_size=2)  # [group][rank]: indices in the group
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
    """For each parameter index, the rank of ``partition`` that owns it.

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


@dataclass(frozen=True, slots=True)
class Piece:
    """Elements ``[start, stop)`` of the flattened parameter ``param`` of ``param_numel`` elements
    (empty only for a zero-size parameter).

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
        return self.stop - self.start

    @property
    def is_whole(self) -> bool:
        return self.start == 0 and self.stop == self.param_numel


def check_tiling(param: int, numel: int, held: Sequence[tuple[int, Piece]]) -> None:
    """A ValueError unless ``held``, the ``(rank, piece)`` of a parameter in element order, tiles
    it exactly once (a zero-size parameter: one empty piece).

    Example:
        >>> check_tiling(0, 4, [(0, Piece(0, 0, 2, 4)), (1, Piece(0, 2, 4, 4))])
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
    """Per rank a contiguous range of the concatenated parameters, and its pieces (:func:`flat`)."""

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
        return tuple(stop - start for start, stop in self.bounds)


def flat(
    numels: Sequence[int], world_size: int, *, align: int = 1, blocks: Sequence[int] | None = None
) -> FlatPartition:
    """The concatenated parameters cut into ``world_size`` ranges of at most ``ceil(total /
    world_size)`` elements on multiples of ``align`` (or of each parameter's block in ``blocks``).

    Example:
        >>> p = flat([6, 3], world_size=2)
        >>> p.bounds, p.pieces[1]
        (((0, 5), (5, 9)), (Piece(param=0, start=5, stop=6), Piece(param=1, start=0, stop=3)))
    """
    check_world_size(world_size)
    check_numels(numels)
    check_align(align)
    starts = prefix_sums(numels)
    total = starts[-1]
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
    """``bounds`` with each bound inside a parameter moved up to its next block boundary.

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


@dataclass(frozen=True, slots=True)
class BucketAssignment:
    """Parameters ``[offset, offset + length)`` of DDP bucket ``bucket`` are updated by ``rank``."""

    bucket: int
    rank: int
    offset: int
    length: int

    def __post_init__(self) -> None:
        if self.length < 1 or self.offset < 0 or self.rank < 0 or self.bucket < 0:
            raise ValueError(
                f"{self} needs length >= 1 and bucket, rank, offset >= 0: "
                "build it with ddp_bucket_assignments()"
            )


def _least_loaded(loads: Sequence[int], excluded: set[int], bucket: int) -> int:
    free = [r for r in range(len(loads)) if r not in excluded]
    if not free:
        # compat: torch fails here too (AssertionError "All indices are disallowed").
        raise ValueError(
            f"torch's shard_buckets rule cuts DDP bucket {bucket} into more than "
            f"{len(loads)} pieces, one per rank at most (many parameters each near "
            "total / world_size): pass shard_buckets=False, or a larger bucket_cap_mb to DDP"
        )
    # compat: torch's `_get_min_index`: the first rank of minimal load not yet in this bucket.
    return min(free, key=lambda r: loads[r])


def ddp_bucket_assignments(
    bucket_numels: Sequence[Sequence[int]], world_size: int, *, shard_buckets: bool = False
) -> tuple[tuple[BucketAssignment, ...], ...]:
    """torch's assignment of DDP buckets (their parameters' sizes) to ranks, per rank: bucket ``i``
    to rank ``i % world_size``, or with ``shard_buckets`` cut into runs under ``total /
    world_size`` elements, smallest bucket first, each run to the least-loaded rank.

    Example:
        >>> [[(a.bucket, a.length) for a in r] for r in ddp_bucket_assignments([[4, 4], [2]], 2)]
        [[(0, 2)], [(1, 1)]]
    """
    check_world_size(world_size)
    for b, numels in enumerate(bucket_numels):
        if len(numels) == 0:
            raise ValueError(
                f"DDP bucket {b} is empty; every bucket holds at least one parameter: "
                "pass bucket.parameters() sizes for each bucket"
            )
        if any(n < 0 for n in numels):
            raise ValueError(
                f"DDP bucket {b} has a negative size among {first_of(numels)}: pass p.numel()"
            )
    per_rank: list[list[BucketAssignment]] = [[] for _ in range(world_size)]
    if not shard_buckets:
        for b, numels in enumerate(bucket_numels):
            per_rank[b % world_size].append(BucketAssignment(b, b % world_size, 0, len(numels)))
        return tuple(tuple(r) for r in per_rank)
    threshold = sum(sum(b) for b in bucket_numels) / world_size
    loads = [0] * world_size
    # compat: torch visits buckets smallest first with a stable sort (ties keep bucket order).
    for b in sorted(range(len(bucket_numels)), key=lambda i: sum(bucket_numels[i])):
        numels = bucket_numels[b]
        taken: set[int] = set()
        start, size = 0, 0
        for i, n in enumerate(numels):
            # compat: torch closes a piece when adding the next parameter would reach (>=,
            # not >) the threshold, so pieces can be much smaller than total / world_size.
            if size + n >= threshold and i > start:
                r = _least_loaded(loads, taken, b)
                per_rank[r].append(BucketAssignment(b, r, start, i - start))
                taken.add(r)
                loads[r] += size
                start, size = i, 0
            size += n
        r = _least_loaded(loads, taken, b)
        per_rank[r].append(BucketAssignment(b, r, start, len(numels) - start))
        taken.add(r)
        loads[r] += size
    return tuple(tuple(r) for r in per_rank)
