"""Properties of the functional optimizers: purity, and sharding never changes the update."""

from __future__ import annotations

from collections.abc import Callable

import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor

from zero_functional.functional import (
    AdamState,
    FunctionalOptimizer,
    SGDState,
    State,
    adam,
    adamw,
    group_indices,
    sgd,
)

OPTIMIZERS: dict[str, Callable[[], list[FunctionalOptimizer]]] = {
    "sgd": lambda: [
        sgd(lr=0.1),
        sgd(lr=0.1, momentum=0.9, weight_decay=0.1),
        sgd(lr=0.1, momentum=0.9, nesterov=True, maximize=True),
        sgd(lr=0.1, momentum=0.5, dampening=0.3),
    ],
    "adam": lambda: [
        adam(lr=0.01, fused=False),
        adam(lr=0.01, amsgrad=True, weight_decay=0.1, maximize=True),
        adam(lr=0.01, betas=(0.5, 0.9), fused=True),
        adam(lr=0.01, amsgrad=True, weight_decay=0.1, maximize=True, fused=False),
    ],
    "adamw": lambda: [adamw(lr=0.01, fused=False), adamw(lr=0.01, amsgrad=True)],
}
ALL = [opt for make in OPTIMIZERS.values() for opt in make()]

sizes = st.lists(st.integers(1, 24), min_size=1, max_size=5)
optimizers = st.sampled_from(ALL)
dtypes = st.sampled_from([torch.float32, torch.float64])


def _tensors(sizes: list[int], seed: int, dtype: torch.dtype) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g, dtype=dtype) for n in sizes]


def _state_tensors(state: State) -> list[Tensor]:
    if isinstance(state, SGDState):
        return [b for b in state.momentum_buffer if b is not None]
    return [t for ts in state for t in ts]


def _storages(ts: list[Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in ts}


def _run_steps(
    opt: FunctionalOptimizer, params: list[Tensor], grads: list[list[Tensor]]
) -> tuple[list[Tensor], State]:
    params = [p.clone() for p in params]
    state = opt.init(params)
    for g in grads:
        opt.update_(params, g, state)
    return params, state


@given(optimizers, sizes, st.integers(0, 2**16), st.integers(1, 3), dtypes)
def test_pure_update_leaves_inputs_untouched_and_equals_in_place(
    opt: FunctionalOptimizer, sizes: list[int], seed: int, steps: int, dtype: torch.dtype
) -> None:
    params = _tensors(sizes, seed, dtype)
    grads = [_tensors(sizes, seed + 1 + k, dtype) for k in range(steps)]
    in_place, in_place_state = _run_steps(opt, params, grads)
    state = opt.init(params)
    current = params
    for g in grads:
        snapshot = ([p.clone() for p in current], [x.clone() for x in g])
        snap_state = [t.clone() for t in _state_tensors(state)]
        new, new_state = opt.update(current, g, state)
        for a, b in zip(
            current + g + _state_tensors(state), snapshot[0] + snapshot[1] + snap_state
        ):
            assert torch.equal(a, b)
        inputs = _storages(current + g + _state_tensors(state))
        assert not inputs & _storages(new + _state_tensors(new_state))
        current, state = new, new_state
    torch.testing.assert_close(current, in_place, rtol=0, atol=0)
    torch.testing.assert_close(
        _state_tensors(state), _state_tensors(in_place_state), rtol=0, atol=0
    )


@given(optimizers, sizes, st.integers(0, 2**16), st.lists(st.integers(0, 5), max_size=4))
def test_whole_parameter_shards_update_like_the_full_update(
    opt: FunctionalOptimizer, sizes: list[int], seed: int, cuts: list[int]
) -> None:
    params = _tensors(sizes, seed, torch.float32)
    grads = [_tensors(sizes, seed + 1 + k, torch.float32) for k in range(3)]
    full, _ = _run_steps(opt, params, grads)
    bounds = sorted({0, len(sizes), *(min(c, len(sizes)) for c in cuts)})
    sharded: list[Tensor] = []
    for lo, hi in zip(bounds, bounds[1:]):
        shard, _ = _run_steps(opt, params[lo:hi], [g[lo:hi] for g in grads])
        sharded += shard
    torch.testing.assert_close(sharded, full, rtol=0, atol=0)


def _flat_pieces(ts: list[Tensor], bounds: list[int]) -> list[Tensor]:
    flat = torch.cat([t.reshape(-1) for t in ts])
    return [flat[lo:hi].clone() for lo, hi in zip(bounds, bounds[1:])]


@given(optimizers, sizes, st.integers(0, 2**16), st.lists(st.integers(0, 120), max_size=6))
def test_flat_segments_update_like_the_full_update(
    opt: FunctionalOptimizer, sizes: list[int], seed: int, cuts: list[int]
) -> None:
    shapes = [(n,) if n % 2 else (2, n // 2) for n in sizes]
    params = [t.reshape(s) for t, s in zip(_tensors(sizes, seed, torch.float32), shapes)]
    grads = [
        [t.reshape(s) for t, s in zip(_tensors(sizes, seed + 1 + k, torch.float32), shapes)]
        for k in range(3)
    ]
    full, full_state = _run_steps(opt, params, grads)
    # foreach kernels: bitwise; the fused CPU kernel rounds its vector body and scalar tail
    # differently (pinned in tests/test_functional.py), so fused pieces are only close
    exact = opt.name == "sgd" or opt.hyperparams["fused"] is False
    tol = {"rtol": 0.0, "atol": 0.0} if exact else {"rtol": 1e-5, "atol": 1e-7}
    total = sum(sizes)
    bounds = sorted({0, total, *(min(c, total) for c in cuts)})
    pieces, piece_state = _run_steps(
        opt, _flat_pieces(params, bounds), [_flat_pieces(g, bounds) for g in grads]
    )
    torch.testing.assert_close(torch.cat(pieces), torch.cat([p.reshape(-1) for p in full]), **tol)
    if isinstance(full_state, AdamState):
        assert isinstance(piece_state, AdamState)
        torch.testing.assert_close(
            torch.cat(piece_state.exp_avg_sq),
            torch.cat([t.reshape(-1) for t in full_state.exp_avg_sq]),
            **tol,
        )


@given(st.lists(st.sampled_from([torch.float32, torch.float64, torch.float16]), max_size=12))
def test_group_indices_partitions_by_dtype_in_first_seen_order(dtypes: list[torch.dtype]) -> None:
    ts = [torch.zeros(1, dtype=d) for d in dtypes]
    groups = group_indices(ts)
    # every index once, each group one (device, dtype), members ascending
    assert sorted(i for members in groups.values() for i in members) == list(range(len(ts)))
    for (device, dtype), members in groups.items():
        assert all(ts[i].dtype == dtype and ts[i].device == device for i in members)
        assert members == sorted(members)
    # groups in the order their first member appears
    firsts = [members[0] for members in groups.values()]
    assert firsts == sorted(firsts)
    assert [k[1] for k in groups] == list(dict.fromkeys(dtypes))
