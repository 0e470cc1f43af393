"""Properties of zero_functional.core.partition: ownership, balance bounds, torch parity, flat splits."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from zero_functional.core.loads import balance_report, rank_loads
from zero_functional.core.partition import flat, owners, sorted_greedy, sorted_greedy_groups

from tests.torch_reference import torch_partition

numels_st = st.lists(st.integers(0, 1000), max_size=40)
world_st = st.integers(1, 9)


@given(numels_st, world_st)
def test_sorted_greedy_puts_every_parameter_on_exactly_one_rank(numels: list[int], n: int) -> None:
    part = sorted_greedy(numels, n)
    assert len(part) == n
    owner = owners(part, len(numels))  # raises on a missing or duplicated index
    assert all(i in part[owner[i]] for i in range(len(numels)))
    assert sorted(i for r in part for i in r) == list(range(len(numels)))


@given(numels_st, world_st)
def test_sorted_greedy_max_load_within_list_scheduling_bound(numels: list[int], n: int) -> None:
    # Greedy list scheduling (any order): the last item placed on the busiest rank went to a
    # least-loaded rank, whose load was <= (total - item) / n, so
    # max <= total / n + largest * (n - 1) / n  (which implies max <= mean + largest).
    r = balance_report(numels, sorted_greedy(numels, n))
    total = sum(numels)
    assert r.max_load * n <= total + r.largest * (n - 1)
    assert r.max_load <= r.mean_load + r.largest
    assert r.max_load >= r.lower_bound - 1e-9 * max(1, total)


@given(st.lists(st.integers(0, 50), max_size=9), st.integers(1, 3))
def test_sorted_greedy_within_four_thirds_of_optimal(numels: list[int], n: int) -> None:
    # Graham's LPT bound: max <= (4/3 - 1/(3n)) * OPT; OPT found by brute force on small cases.
    best = sum(numels)

    def search(i: int, loads: list[int]) -> None:
        nonlocal best
        if max(loads) >= best:
            return
        if i == len(numels):
            best = max(loads)
            return
        for r in range(n):
            loads[r] += numels[i]
            search(i + 1, loads)
            loads[r] -= numels[i]

    search(0, [0] * n)
    got = max(rank_loads(numels, sorted_greedy(numels, n)), default=0)
    assert 3 * n * got <= (4 * n - 1) * best


@given(numels_st, world_st)
def test_sorted_greedy_is_deterministic(numels: list[int], n: int) -> None:
    assert sorted_greedy(numels, n) == sorted_greedy(list(numels), n)


@given(numels_st, world_st)
def test_sorted_greedy_equals_torch(numels: list[int], n: int) -> None:
    assert [list(r) for r in sorted_greedy(numels, n)] == torch_partition([numels], n)[0]


@given(st.lists(st.lists(st.integers(0, 100), max_size=8), max_size=4), world_st)
def test_sorted_greedy_groups_equals_torch(groups: list[list[int]], n: int) -> None:
    ours = sorted_greedy_groups(groups, n)
    assert [[list(r) for r in g] for g in ours] == torch_partition(groups, n)


@given(st.lists(st.integers(0, 2_000), max_size=30), world_st, st.integers(1, 64))
def test_flat_split_is_exact_covering_and_aligned(numels: list[int], n: int, align: int) -> None:
    p = flat(numels, n, align=align)
    total = sum(numels)
    per_rank = -(-total // n)
    cap = -(-per_rank // align) * align
    # Segments, rank after rank, walk the concatenation exactly once, in order.
    pieces = [(s.param, s.start, s.stop) for rank_pieces in p.pieces for s in rank_pieces]
    expected_elements = [(i, e) for i, m in enumerate(numels) for e in range(m)]
    assert [(i, e) for i, a, b in pieces for e in range(a, b)] == expected_elements
    assert sum(p.loads) == total
    assert all(load <= cap for load in p.loads)
    assert all(a % align == 0 or a == total for a, _ in p.bounds)
    assert balance_report(numels, p).max_load == (max(p.loads) if p.loads else 0)


@given(st.lists(st.integers(0, 10_000), max_size=30), world_st)
def test_flat_is_never_worse_than_sorted_greedy(numels: list[int], n: int) -> None:
    assert balance_report(numels, flat(numels, n)).max_load <= (
        balance_report(numels, sorted_greedy(numels, n)).max_load
    )
