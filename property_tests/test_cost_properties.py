"""Properties of zero_functional.core.cost: Newton–Schulz cost, cost_greedy and muon_plan."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from zero_functional.core.cost import (
    ADAMW_STATE_BYTES,
    MUON_STATE_BYTES,
    cost_greedy,
    muon_plan,
    newton_schulz_cost,
)
from zero_functional.core.loads import balance_report, max_over_mean
from zero_functional.core.partition import owners

costs_st = st.lists(st.integers(0, 10**9), max_size=40)
world_st = st.integers(1, 9)
shape_st = st.one_of(
    st.tuples(st.integers(0, 64), st.integers(0, 64)),
    st.tuples(st.integers(0, 200)),
    st.tuples(st.integers(0, 8), st.integers(0, 8), st.integers(0, 8)),
)


@given(st.integers(0, 4096), st.integers(0, 4096))
def test_newton_schulz_cost_is_symmetric_and_at_most_the_square_matrix_cost(m: int, n: int) -> None:
    c = newton_schulz_cost((m, n))
    assert c == newton_schulz_cost((n, m))
    assert c <= max(m, n) ** 3
    assert c == m * n * min(m, n)


@given(costs_st, world_st)
def test_cost_greedy_owns_every_tensor_exactly_once(costs: list[int], n: int) -> None:
    part = cost_greedy(costs, n)
    assert len(part) == n
    owners(part, len(costs))  # raises on a missing or duplicated index
    assert sorted(i for r in part for i in r) == list(range(len(costs)))


@given(costs_st, world_st)
def test_cost_greedy_max_is_at_most_mean_plus_largest(costs: list[int], n: int) -> None:
    r = balance_report(costs, cost_greedy(costs, n))
    assert r.max_load <= r.mean_load + r.largest
    assert r.max_load * n <= sum(costs) + r.largest * (n - 1)


@given(costs_st, world_st)
def test_cost_greedy_is_deterministic_and_leaves_its_input_alone(costs: list[int], n: int) -> None:
    before = list(costs)
    assert cost_greedy(costs, n) == cost_greedy(list(costs), n)
    assert costs == before


@given(costs_st)
def test_cost_greedy_on_one_rank_puts_everything_on_rank_0(costs: list[int]) -> None:
    (only,) = cost_greedy(costs, 1)
    assert sorted(only) == list(range(len(costs)))


@given(world_st)
def test_cost_greedy_of_nothing_is_empty_ranks(n: int) -> None:
    assert cost_greedy([], n) == ((),) * n


@st.composite
def model_st(draw: st.DrawFn) -> tuple[list[tuple[int, ...]], list[bool]]:
    shapes = draw(st.lists(shape_st, max_size=30))
    muon = [len(s) == 2 and draw(st.booleans()) for s in shapes]
    return shapes, muon


@given(model_st(), world_st)
def test_muon_plan_owns_every_element_exactly_once(
    model: tuple[list[tuple[int, ...]], list[bool]], n: int
) -> None:
    shapes, muon = model
    plan = muon_plan(shapes, muon, n)
    sizes = [math.prod(s) for s in shapes]
    assert sorted(plan.matrices + plan.rest) == list(range(len(shapes)))
    assert sorted(i for r in plan.matrix_owned for i in r) == list(plan.matrices)
    covered = [0] * len(plan.rest)
    for rank_pieces in plan.rest_split.pieces:
        for piece in rank_pieces:
            covered[piece.param] += piece.numel
    assert covered == [sizes[i] for i in plan.rest]
    assert sum(plan.muon_numel) + sum(plan.adamw_numel) == sum(sizes)
    assert sum(plan.state_bytes) == sum(
        (MUON_STATE_BYTES if m else ADAMW_STATE_BYTES) * s for s, m in zip(sizes, muon)
    )


@given(model_st(), world_st)
def test_muon_plan_cost_within_greedy_bound_and_adamw_even(
    model: tuple[list[tuple[int, ...]], list[bool]], n: int
) -> None:
    shapes, muon = model
    before = [tuple(s) for s in shapes], list(muon)
    plan = muon_plan(shapes, muon, n)
    costs = [newton_schulz_cost(shapes[i]) for i in plan.matrices]
    assert max(plan.cost) <= sum(costs) / n + max(costs, default=0)
    assert max(plan.adamw_numel) == -(-sum(plan.adamw_numel) // n)  # flat: the even share
    assert max_over_mean(plan.cost) >= 1.0
    assert (shapes, muon) == before
    assert plan == muon_plan(shapes, muon, n)


@given(model_st())
def test_muon_plan_on_one_rank_puts_everything_on_rank_0(
    model: tuple[list[tuple[int, ...]], list[bool]],
) -> None:
    shapes, muon = model
    plan = muon_plan(shapes, muon, 1)
    assert sorted(plan.matrix_owned[0]) == list(plan.matrices)
    assert plan.adamw_numel == (sum(math.prod(shapes[i]) for i in plan.rest),)
