"""The chunk layouts of gloo's reduce onto owners (issue 33), computed in one process: every
element sent once, grouped by owner, in order within the window (the all-to-alls themselves:
``tests/dist/test_exchange.py``)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from zero_functional.core.plans import chunk_layout, exchange_chunks


@given(
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3)), min_size=1, max_size=12),
    st.integers(1, 4),
    st.integers(1, 9),
)
def test_chunk_layouts_send_every_element_once_grouped_by_owner(
    pieces: list[tuple[int, int]], world: int, per_owner: int
) -> None:
    runs, start = [], 0
    for length, rank in pieces:
        runs.append((start, start + length, rank % world))
        start += length
    chunks = exchange_chunks(runs, world, per_owner)
    for me in range(world):
        layouts = [chunk_layout(chunk, me) for chunk in chunks]
        owned = [sum(b - a for a, b, q in runs if q == r) for r in range(world)]
        for r in range(world):  # over the chunks: each owner gets its elements once
            assert sum(lay.sends[r] for lay in layouts) == (0 if r == me else owned[r])
            assert sum(lay.receives[r] for lay in layouts) == (0 if r == me else owned[me])
        for lay in layouts:
            assert sum(b - a for a, b in lay.source) == sum(lay.sends)
            # stretches grouped by owner, in rank order; a span only where they are one stretch
            owners = [q for a, b in lay.source for x, y, q in runs if x <= a < y]
            assert owners == sorted(owners)
            joined = all(b == c for (_, b), (c, _) in zip(lay.source, lay.source[1:]))
            assert (lay.span is not None) == (bool(lay.source) and joined)


@given(
    st.lists(st.tuples(st.integers(0, 6), st.integers(0, 3)), min_size=1, max_size=12),
    st.integers(1, 4),
    st.integers(1, 9),
)
def test_exchange_chunks_carry_each_owners_elements_once_in_order_within_the_window(
    pieces: list[tuple[int, int]], world: int, per_owner: int
) -> None:
    runs, at = [], 0
    for length, rank in pieces:
        runs.append((at, at + length, rank % world))
        at += length
    chunks = exchange_chunks(runs, world, per_owner)
    splits = [sum(b - a for a, b, owner in runs if owner == r) for r in range(world)]
    assert len(chunks) == -(-max(splits) // per_owner)
    for r in range(world):
        mine = [i for a, b, owner in runs if owner == r for i in range(a, b)]
        carried = [i for chunk in chunks for a, b in chunk[r] for i in range(a, b)]
        assert carried == mine  # every element once, in buffer order
        sizes = [sum(b - a for a, b in chunk[r]) for chunk in chunks]
        assert all(size <= per_owner for size in sizes)
        # full chunks first: chunk c carries elements [c * per_owner, ...) of the owner's
        assert all(size == per_owner for size in sizes[: len(mine) // per_owner])
