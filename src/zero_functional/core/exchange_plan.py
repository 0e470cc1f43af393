"""Exchange plans: which stretches of a buffer go to which owner, in chunks (pure); every rank
derives the same chunks from the same runs, so the all-to-alls of :mod:`~.comm.exchange` match."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from zero_functional.core._validate import check_rank, check_world_size

Stretch = tuple[int, int]


def exchange_chunks(
    runs: Sequence[tuple[int, int, int]], world_size: int, per_owner: int
) -> tuple[tuple[tuple[tuple[int, int], ...], ...], ...]:
    """The ``(start, stop, rank)`` ``runs`` cut into chunks of at most ``per_owner`` elements per
    owner (each owner's runs read in buffer order as one sequence): per chunk, per rank, the
    stretches of that rank's runs it carries.

    Example:
        >>> exchange_chunks([(0, 5, 0), (5, 8, 1)], 2, 3)
        ((((0, 3),), ((5, 8),)), (((3, 5),), ()))
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
    """One rank's side of one chunk's all-to-all (:func:`chunk_layout`): the elements it ``sends``
    each rank and ``receives`` from each; the others' stretches it sends (``source``, and ``span``
    where they make one stretch, sent without a copy); and its own, to add onto (``mine``)."""

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
