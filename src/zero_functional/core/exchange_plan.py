"""How a buffer's runs travel onto their owners through all-to-alls: pure plans.

:mod:`zero_functional.comm.exchange` sums each run of a buffer onto its owner by sending every
owner its runs' elements (the reduce-scatter's byte floor); these functions say which
stretches go where, in chunks of a bounded window (:func:`exchange_chunks`), and what one rank
sends, receives and adds in each (:func:`chunk_layout`). Every rank derives the same chunks
from the same runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from zero_functional.core._validate import check_rank, check_world_size

__all__ = ["ChunkLayout", "chunk_layout", "exchange_chunks"]

Stretch = tuple[int, int]


def exchange_chunks(
    runs: Sequence[tuple[int, int, int]], world_size: int, per_owner: int
) -> tuple[tuple[tuple[tuple[int, int], ...], ...], ...]:
    """An exchange cut into chunks that each carry at most ``per_owner`` elements per owner.

    Each owner's runs, in buffer order, read as one sequence of elements; chunk ``c`` takes elements ``[c * per_owner, (c + 1) *
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


class ChunkLayout(NamedTuple):
    """One rank's side of one chunk's all-to-all (:func:`chunk_layout`).

    Attributes:
        sends: Elements it sends each rank (none to itself).
        receives: Elements it receives from each rank (its own stretches' size; none from
            itself).
        source: The others' stretches, in rank order: what it sends, in that order.
        span: The one stretch of the buffer ``source`` is, where it is one (sent without a
            copy); else ``None``.
        mine: Its own stretches, onto which what arrives is added.
    """

    sends: tuple[int, ...]
    receives: tuple[int, ...]
    source: tuple[Stretch, ...]
    span: Stretch | None
    mine: tuple[Stretch, ...]


def chunk_layout(chunk: Sequence[Sequence[Stretch]], rank: int) -> ChunkLayout:
    """What ``rank`` sends, receives and adds in one chunk of :func:`exchange_chunks`.

    Example:
        >>> chunk_layout((((0, 3),), ((5, 8),)), 0)
        ChunkLayout(sends=(0, 3), receives=(0, 3), source=((5, 8),), span=(5, 8), mine=((0, 3),))
        >>> chunk_layout((((3, 4),), ((0, 2),), ((2, 3),)), 1).span is None
        True
    """
    check_rank(rank, len(chunk))
    sizes = [sum(b - a for a, b in part) for part in chunk]
    source = tuple(stretch for r, part in enumerate(chunk) if r != rank for stretch in part)
    joined = all(b == c for (_, b), (c, _) in zip(source, source[1:]))
    span = (source[0][0], source[-1][1]) if source and joined else None
    return ChunkLayout(
        sends=tuple(0 if r == rank else n for r, n in enumerate(sizes)),
        receives=tuple(0 if r == rank else sizes[rank] for r in range(len(chunk))),
        source=source,
        span=span,
        mine=tuple(chunk[rank]),
    )
