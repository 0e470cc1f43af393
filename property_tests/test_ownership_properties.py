"""Properties of zero_functional.core.ownership, state_dict and collectives: the pure ownership core."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from zero_functional.core._validate import ceil_div, round_up
from zero_functional.core.layout import piece_view, piece_views
from zero_functional.core.ownership import (
    Ownership,
    bucket_ownership,
    flat_ownership,
    sorted_greedy_ownership,
    whole_ownership,
)
from zero_functional.core.param_table import ParamTable
from zero_functional.core.partition import Piece, sorted_greedy_groups
from zero_functional.core.piece_state import join_states, slice_state
from zero_functional.core.plans import (
    COLLECTIVES,
    buffer_plan,
    even_chunk,
    owned_spans,
    reshard_rounds,
    sync_plan,
    takes_even_shards,
)

numels_st = st.lists(st.integers(0, 200), max_size=25)
world_st = st.integers(1, 9)


def _every_element_once(o: Ownership) -> None:
    seen = [[0] * n for n in o.numels]
    for rank in range(o.world_size):
        params = [s.param for s in o.owned(rank)]
        assert params == sorted(set(params)), "one piece per parameter per rank, ascending"
        for s in o.owned(rank):
            for e in range(s.start, s.stop):
                seen[s.param][e] += 1
    assert all(c == 1 for per in seen for c in per)
    assert all(len(o.holders(k)) == 1 for k, n in enumerate(o.numels) if n == 0)


@given(numels_st, world_st, st.integers(1, 8))
def test_flat_ownership_owns_every_element_once_and_splits_evenly(
    numels: list[int], n: int, align: int
) -> None:
    o = flat_ownership(numels, n, align=align)
    _every_element_once(o)
    chunk = round_up(ceil_div(sum(numels), n), align)
    assert all(load <= chunk for load in o.loads)
    assert sum(o.loads) == sum(numels)


@given(st.lists(st.tuples(st.integers(0, 100), st.sampled_from("abc")), max_size=20), world_st)
def test_flat_ownership_splits_each_key_on_its_own(items: list[tuple[int, str]], n: int) -> None:
    numels, keys = [m for m, _ in items], [k for _, k in items]
    o = flat_ownership(numels, n, keys=keys)
    _every_element_once(o)
    for key in set(keys):
        total = sum(m for m, k in items if k == key)
        per_rank = [
            sum(s.stop - s.start for s in o.owned(r) if keys[s.param] == key) for r in range(n)
        ]
        assert max(per_rank) <= -(-total // n)


@given(
    world_st.flatmap(
        lambda n: st.tuples(
            st.just(n), st.lists(st.tuples(st.integers(0, 50), st.integers(0, n - 1)), max_size=20)
        )
    )
)
def test_whole_ownership_puts_each_parameter_whole_on_its_owner(
    case: tuple[int, list[tuple[int, int]]],
) -> None:
    n, items = case
    numels = [m for m, _ in items]
    o = whole_ownership(numels, [r for _, r in items], n)
    _every_element_once(o)
    assert o.is_whole
    for k, (m, r) in enumerate(items):
        assert o.holders(k) == ((r, Piece(k, 0, m, m)),)


@given(st.lists(st.lists(st.integers(0, 100), max_size=6), min_size=1, max_size=4), world_st)
def test_sorted_greedy_ownership_is_torchs_partition_as_whole_pieces(
    groups: list[list[int]], n: int
) -> None:
    o = sorted_greedy_ownership(groups, n)
    _every_element_once(o)
    assert o.is_whole
    parts = sorted_greedy_groups(groups, n)
    start = 0
    for g, part in zip(groups, parts):
        for rank, indices in enumerate(part):
            for i in indices:
                assert o.owner(start + i) == rank
        start += len(g)


@given(
    st.lists(st.integers(0, 60), min_size=1, max_size=14),
    st.integers(1, 4),
    st.data(),
    st.sampled_from(["sorted_greedy", "flat"]),
    st.booleans(),
)
def test_bucket_ownership_covers_buckets_and_frozen_leftovers(
    numels: list[int], n: int, data: st.DataObject, partition: str, shard: bool
) -> None:
    order = data.draw(st.permutations(range(len(numels))))
    in_buckets = data.draw(st.integers(0, len(numels)))
    cuts = sorted(data.draw(st.sets(st.integers(1, max(in_buckets - 1, 1)), max_size=3)))
    bucketed = order[:in_buckets]
    bounds = zip([0, *cuts], [*cuts, len(bucketed)])
    buckets = [bucketed[a:b] for a, b in bounds if bucketed[a:b]]
    o = bucket_ownership(buckets, numels, n, partition=partition, shard_buckets=shard)  # type: ignore[arg-type]
    _every_element_once(o)
    if partition == "flat":
        for b in buckets:  # every bucket split evenly: no rank holds more than its share
            total = sum(numels[k] for k in b)
            for rank in range(n):
                held = sum(s.stop - s.start for s in o.owned(rank) if s.param in b)
                assert held <= -(-total // n)
    else:
        assert o.is_whole


@given(numels_st, world_st, st.data())
def test_runs_tile_the_buffer_in_order_with_each_elements_owner(
    numels: list[int], n: int, data: st.DataObject
) -> None:
    o = flat_ownership(numels, n)
    order = data.draw(st.permutations(range(len(numels))))
    runs = o.runs(order)
    edge = 0
    for r in runs:
        assert r.start == edge and r.stop > r.start
        edge = r.stop
    assert edge == sum(numels)
    assert all(a.rank != b.rank for a, b in zip(runs, runs[1:]))  # adjacent runs merged
    base = 0
    for k in order:  # spot-check: each element's run names its owner
        for rank, s in o.holders(k):
            for e in (s.start, s.stop - 1) if s.stop > s.start else ():
                (run,) = [r for r in runs if r.start <= base + e < r.stop]
                assert run.rank == rank
        base += numels[k]


@given(numels_st, world_st, st.data())
def test_owned_slices_are_each_ranks_pieces_inside_its_runs(
    numels: list[int], n: int, data: st.DataObject
) -> None:
    o = flat_ownership(numels, n)
    order = data.draw(st.permutations(range(len(numels))))
    runs = o.runs(order)
    buffer = torch.arange(float(sum(numels)))
    params = [t.clone() for t in buffer.split([numels[k] for k in order])]
    by_param = dict(zip(order, params))
    for rank in range(n):
        slices = o.owned_slices(order, rank)
        assert [k for k, _, _ in slices] == [k for k in order if o.piece(rank, k) is not None]
        for k, a, b in slices:
            piece = o.piece(rank, k)
            assert piece is not None and b - a == piece.stop - piece.start
            # the slice of the buffer is the piece of the parameter
            assert torch.equal(buffer[a:b], by_param[k][piece.start : piece.stop])
            if b > a:
                assert any(r.rank == rank and r.start <= a and b <= r.stop for r in runs)


@given(numels_st, world_st, world_st)
def test_transfers_cover_every_element_from_its_old_owner_to_its_new(
    numels: list[int], n: int, m: int
) -> None:
    old = sorted_greedy_ownership([numels], n)
    for new in (flat_ownership(numels, n), sorted_greedy_ownership([numels], n)):
        moves = old.transfers(new)
        covered = [[0] * k for k in numels]
        for t in moves:
            assert old.piece(t.src, t.param) is not None and new.piece(t.dst, t.param) is not None
            for e in range(t.start, t.stop):
                covered[t.param][e] += 1
        assert all(c == 1 for per in covered for c in per)
        assert all(any(t.param == k for t in moves) for k, x in enumerate(numels) if x == 0)
    if m != n:
        with pytest.raises(ValueError, match="same parameters and ranks"):
            old.transfers(flat_ownership(numels, m))


@given(numels_st, world_st, st.integers(1, 300))
def test_reshard_rounds_make_every_transfer_once_alike_on_every_rank_within_their_size(
    numels: list[int], n: int, elements: int
) -> None:
    old, new = sorted_greedy_ownership([numels], n), flat_ownership(numels, n)
    per_rank = [reshard_rounds(old, new, r, elements) for r in range(n)]
    assert len({len(rounds) for rounds in per_rank}) == 1
    made = []
    for plans in zip(*per_rank):
        assert len({plan.pairs for plan in plans}) == 1  # the same exchange on every rank
        sends = [t for plan in plans for t in plan.sends]
        for r, plan in enumerate(plans):
            received = sorted(t for m in plan.receives.values() for t in m)
            assert sorted(t for t in sends if t.dst == r) == received
            for moves in plan.receives.values():  # each parameter's in element order
                assert [t.start for t in moves] == sorted(t.start for t in moves)
        moved = sum(t.stop - t.start for t in sends if t.src != t.dst)
        assert moved <= elements or len({t.param for t in sends}) == 1
        made += sends
    assert sorted(made) == sorted(old.transfers(new))


@given(st.integers(1, 12), st.integers(1, 50))
def test_reshard_rounds_hold_a_swap_at_most_one_parameter_over(half: int, numel: int) -> None:
    """Ranks 0 and 1 trade all their parameters: in parameter order rank 1 would receive all of
    its new state before it sends any of its old (``half`` parameters over); a round at most."""
    owners = [0] * half + [1] * half
    old = whole_ownership([numel] * 2 * half, owners, 2)
    new = whole_ownership([numel] * 2 * half, owners[::-1], 2)
    for rank in (0, 1):
        grown = worst = 0
        for plan in reshard_rounds(old, new, rank, elements=numel):
            grown += sum(t.stop - t.start for m in plan.receives.values() for t in m)
            grown -= sum(t.stop - t.start for t in plan.sends)
            worst = max(worst, grown)
        assert worst <= numel


@given(numels_st, world_st)
def test_flat_split_is_even_chunked(numels: list[int], n: int) -> None:
    o = flat_ownership(numels, n)
    order = list(range(len(numels)))
    total = sum(numels)
    chunk = even_chunk(o.runs(order), total, n)
    if total:
        # the runs of a flat group merge into one per rank: the even layout
        assert chunk == -(-total // n)
    else:
        assert chunk is None


@given(
    st.lists(st.integers(1, 5), min_size=0, max_size=3),
    world_st,
)
def test_piece_views_alias_the_tensors_and_slice_join_round_trips(shape: list[int], n: int) -> None:
    t = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    o = flat_ownership([t.numel()], n)
    views, ranks = piece_views([t], o)
    assert torch.equal(torch.cat([v.reshape(-1) for v in views]), t.reshape(-1))
    for v in views:  # views, not copies: the same storage, and writes show through
        assert v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    for v in views:
        v.add_(1.0)
    assert torch.equal(t.reshape(-1), torch.arange(1.0, t.numel() + 1.0))
    t.sub_(1.0)
    # state of the whole parameter, sliced to pieces and joined back, is bitwise the same
    state = {"step": torch.tensor(4.0), "exp_avg": t * 2, "note": "x"}
    parts = [
        ((s.start, s.stop), slice_state(state, (0, t.numel()), (s.start, s.stop)))
        for _, s in o.holders(0)
    ]
    back = join_states(parts, tuple(t.shape))
    assert torch.equal(back["exp_avg"], state["exp_avg"]) and back["note"] == "x"
    assert torch.equal(back["step"], state["step"])
    assert torch.equal(state["exp_avg"], t * 2)  # pure: the input is untouched


def test_ownership_validates_itself() -> None:
    with pytest.raises(ValueError, match="exactly one owner"):
        Ownership((4,), 2, ((Piece(0, 0, 2, 4),), ()))
    with pytest.raises(ValueError, match="tile it exactly once"):
        Ownership((4,), 2, ((Piece(0, 0, 3, 4),), (Piece(0, 2, 4, 4),)))
    with pytest.raises(ValueError, match="at most one piece"):
        Ownership((4,), 1, ((Piece(0, 0, 2, 4), Piece(0, 2, 4, 4)),))
    with pytest.raises(ValueError, match="piece lists"):
        Ownership((4,), 2, ((Piece(0, 0, 4, 4),),))
    with pytest.raises(ValueError, match="split across ranks"):
        flat_ownership([4], 2).owner(0)
    with pytest.raises(ValueError, match="outside"):
        piece_view(torch.zeros(3), Piece(0, 0, 4, 4))


@given(numels_st, numels_st, world_st)
def test_extended_keeps_old_pieces_and_places_new_ones_as_the_new_split(
    old_numels: list[int], more: list[int], n: int
) -> None:
    old = flat_ownership(old_numels, n)
    new = flat_ownership(old_numels + more, n)
    grown = old.extended(new)
    _every_element_once(grown)
    for k in range(len(old_numels)):
        assert grown.holders(k) == old.holders(k)
    for k in range(len(old_numels), len(old_numels) + len(more)):
        assert grown.holders(k) == new.holders(k)
    # moving from grown to new moves only the old parameters' pieces that change hands
    assert all(t.param < len(old_numels) for t in grown.transfers(new) if t.src != t.dst)
    with pytest.raises(ValueError, match="cannot extend"):
        old.extended(flat_ownership(old_numels + more, n + 1))


@given(numels_st, world_st, st.data())
def test_owned_spans_are_exactly_the_elements_each_rank_owns(
    numels: list[int], n: int, data: st.DataObject
) -> None:
    o = flat_ownership(numels, n)
    order = data.draw(st.permutations(range(len(numels))))
    runs = [(r.start, r.stop, r.rank) for r in o.runs(order)]
    owned = [
        sorted(e for a, b in owned_spans(runs, rank) for e in range(a, b)) for rank in range(n)
    ]
    # every element of the buffer in exactly one rank's spans, each rank's as many as it owns
    assert sorted(e for spans in owned for e in spans) == list(range(sum(numels)))
    for rank in range(n):
        assert len(owned[rank]) == sum(s.stop - s.start for s in o.owned(rank))


@given(numels_st, world_st, st.sampled_from(COLLECTIVES), st.booleans(), st.data())
def test_a_buffer_plan_covers_its_buffer_and_has_a_chunk_iff_the_split_is_even(
    numels: list[int], n: int, collectives: str, flat: bool, data: st.DataObject
) -> None:
    o = flat_ownership(numels, n) if flat else sorted_greedy_ownership([numels], n)
    order = data.draw(st.permutations(range(len(numels))))
    plan = buffer_plan(o, order, collectives)  # type: ignore[arg-type]
    total = sum(numels)
    # the runs tile [0, total) in order, each with its owner
    edge = 0
    for run in plan.runs:
        assert run.start == edge < run.stop and 0 <= run.rank < n
        edge = run.stop
    assert edge == total
    even = even_chunk(plan.runs, total, n)
    assert plan.chunk == (even if takes_even_shards(plan.collectives) else None)
    if flat and order == sorted(order) and total and takes_even_shards(plan.collectives):
        assert plan.chunk is not None  # a flat group in its own order is the even split
    for rank in range(n):
        assert plan.spans_of(rank) == owned_spans(plan.runs, rank)


@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 40), st.sampled_from("ab"), st.booleans())
    ),
    st.booleans(),
)
def test_a_sync_plan_sends_every_nonempty_tensor_once_from_its_owner(
    tensors: list[tuple[int, int, str, bool]], nccl: bool
) -> None:
    owners, numels, keys, dense = (list(t) for t in zip(*tensors)) if tensors else ([], [], [], [])
    plan = sync_plan(owners, numels, keys, dense, nccl=nccl, coalesce_below=16)
    members = sorted(i for u in plan.units for i in u.members)
    assert members == [i for i, m in enumerate(numels) if m]
    for u in plan.units:
        assert all(owners[i] == u.owner for i in u.members)
        if not u.packed:  # in place: one large contiguous tensor
            (i,) = u.members
            assert numels[i] >= 16 and dense[i]
        else:
            assert len({keys[i] for i in u.members}) == 1
    assert [u for b in plan.batches() for u in b] == list(plan.units)
    assert plan.coalesced == (nccl and len(plan.units) > 1)


@given(numels_st, world_st, st.booleans())
def test_a_piece_is_whole_iff_its_parameter_has_no_other_piece(
    numels: list[int], n: int, flat: bool
) -> None:
    o = flat_ownership(numels, n) if flat else sorted_greedy_ownership([numels], n)
    for k in range(len(numels)):
        held = o.holders(k)
        assert all(piece.is_whole == (len(held) == 1) for _, piece in held)


@given(st.lists(st.lists(st.integers(0, 5), max_size=4), max_size=4))
def test_a_param_table_indexes_every_parameter_and_its_group(sizes: list[list[int]]) -> None:
    groups = [{"params": [torch.zeros(m) for m in g]} for g in sizes]
    table = ParamTable.of(groups)
    params = [p for g in groups for p in g["params"]]
    assert table.params == tuple(params) and table.numels == tuple(p.numel() for p in params)
    for k, p in enumerate(params):
        assert table.index(p) == k and p in table
        start, length = table.spans[table.group_of(k)]
        assert start <= k < start + length
        assert groups[table.group_of(k)]["params"][k - start] is p
    assert table.group_numels() == sizes
    assert torch.zeros(1) not in table
