"""The collective policy the overlap hooks choose from the backend, the world size and the hook
(the hooks on gloo ranks: ``tests/dist/test_hooks.py``)."""

from __future__ import annotations

import pytest

from zero_functional.hooks import (
    choose_collectives,
)


def test_collective_policy() -> None:
    # DDP's bytes (reduce onto owners + broadcast) wherever the hook is DDP's default all-reduce
    # and there is anyone to talk to; a custom hook keeps its own reduction.
    for backend in ("nccl", "NCCL", "gloo"):
        for ws in (2, 3, 4, 64):
            assert choose_collectives(backend, ws) == "reduce+broadcast"
            assert choose_collectives(backend, ws, hook_is_allreduce=False) == (
                "allreduce+broadcast"
            )
        assert choose_collectives(backend, 1) == "allreduce+broadcast"
    # even shards (partition="flat") take NCCL's reduce-scatter and all-gather; gloo's are
    # all-reduces in disguise, so gloo keeps reduces and broadcasts
    assert choose_collectives("nccl", 4, even=True) == "reduce_scatter+all_gather"
    assert choose_collectives("gloo", 4, even=True) == "reduce+broadcast"
    assert choose_collectives("nccl", 4, hook_is_allreduce=False, even=True) == (
        "allreduce+broadcast"
    )
    with pytest.raises(ValueError, match="backend"):
        choose_collectives("", 2)
    with pytest.raises(ValueError, match="world_size"):
        choose_collectives("gloo", 0)
