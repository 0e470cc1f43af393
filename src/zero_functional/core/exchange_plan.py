"""How a buffer's runs travel onto their owners through all-to-alls: pure plans.

:mod:`zero_functional.comm.exchange` sums each run of a buffer onto its owner by sending every
owner its runs' elements (the reduce-scatter's byte floor); these functions say which
stretches go where, in one all-to-all (:func:`exchange_splits`) or in chunks of a bounded
window (:func:`exchange_chunks`). Every rank derives the same plan from the same runs.
"""

from __future__ import annotations

from collections.abc import Sequence

from zero_functional.core._validate import check_rank, check_world_size

__all__ = ["exchange_chunks", "exchange_splits"]


def exchange_splits(
    runs: Sequence[tuple[int, int, int]], world_size: int
) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
    """How a buffer's runs travel through one all-to-all onto their owners (a pure plan).

    Rank ``r`` receives the elements of its runs from every rank, so what each rank sends is
    its buffer grouped by owner: ``splits[r]`` elements for rank ``r``, taken from the
    ``(start, stop)`` stretches of ``order`` (the runs sorted by rank, stable). Where ``order``
    is the buffer itself (owners in rank order, one stretch each), no copy is needed.

    Args:
        runs: ``(start, stop, rank)`` stretches covering the buffer
            (:meth:`~zero_functional.core.ownership.Ownership.runs`).
        world_size: Ranks in the group.

    Returns:
        ``(splits, order)``: the elements each rank owns, and the stretches in send order.

    Example:
        >>> exchange_splits([(0, 4, 0), (4, 7, 1)], 2)
        ((4, 3), ((0, 4), (4, 7)))
        >>> exchange_splits([(0, 2, 1), (2, 5, 0), (5, 6, 1)], 3)
        ((3, 3, 0), ((2, 5), (0, 2), (5, 6)))
    """
    check_world_size(world_size)
    splits = [0] * world_size
    for a, b, rank in runs:
        check_rank(rank, world_size)
        splits[rank] += b - a
    order = tuple((a, b) for a, b, _ in sorted(runs, key=lambda run: run[2]))
    return tuple(splits), order


def exchange_chunks(
    runs: Sequence[tuple[int, int, int]], world_size: int, per_owner: int
) -> tuple[tuple[tuple[tuple[int, int], ...], ...], ...]:
    """An exchange cut into chunks that each carry at most ``per_owner`` elements per owner.

    Each owner's runs, in buffer order, read as one sequence of ``splits[r]`` elements
    (:func:`exchange_splits`); chunk ``c`` takes elements ``[c * per_owner, (c + 1) *
    per_owner)`` of every owner's sequence, as ``(start, stop)`` stretches of the buffer. Every
    rank derives the same chunks from the same runs, so their all-to-alls match; a rank
    receives at most ``(world_size - 1) * per_owner`` elements per chunk.

    Args:
        runs: ``(start, stop, rank)`` stretches covering the buffer.
        world_size: Ranks in the group.
        per_owner: The most elements of one owner a chunk carries (at least 1).

    Returns:
        Per chunk, per rank, the stretches of that rank's runs the chunk carries.

    Example:
        >>> exchange_chunks([(0, 5, 0), (5, 8, 1)], 2, 3)
        ((((0, 3),), ((5, 8),)), (((3, 5),), ()))
        >>> exchange_chunks([(0, 2, 1), (2, 3, 0), (3, 5, 1)], 2, 3)
        ((((2, 3),), ((0, 2), (3, 4))), ((), ((4, 5),)))
    """
    check_world_size(world_size)
    if per_owner < 1:
        raise ValueError(f"per_owner must be at least 1, got {per_owner}")
    owned: list[list[tuple[int, int]]] = [[] for _ in range(world_size)]
    for a, b, rank in runs:
        check_rank(rank, world_size)
        if b > a:
            owned[rank].append((a, b))
    splits = [sum(b - a for a, b in stretches) for stretches in owned]
    chunks = -(-max(splits, default=0) // per_owner)
    out: list[list[list[tuple[int, int]]]] = [
        [[] for _ in range(world_size)] for _ in range(chunks)
    ]
    for rank, stretches in enumerate(owned):
        seen = 0  # elements of this owner's sequence before the stretch
        for a, b in stretches:
            at = a
            while at < b:
                c = (seen + at - a) // per_owner
                stop = min(b, a + (c + 1) * per_owner - seen)
                out[c][rank].append((at, stop))
                at = stop
            seen += b - a
    return tuple(tuple(tuple(part) for part in chunk) for chunk in out)
