"""Which updates the compile policy compiles (the compiled updates themselves, which start the
C++ compiler: ``tests/dist/test_compiled.py``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

import zero_functional.functional.compiled as compiled
from zero_functional.functional import (
    sgd_init,
    sgd_update_,
)
from zero_functional.functional.compiled import compile_policy


@pytest.fixture
def fresh_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget compiled graphs and failures, so a test sees its own."""
    monkeypatch.setattr(compiled, "_GRAPHS", {})
    monkeypatch.setattr(compiled, "_FAILED", {})


@pytest.fixture
def compiles(fresh_caches: None, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The graphs the test asks to compile, by name; none is compiled (each fails)."""
    asked: list[str] = []

    def record(fn: Callable[..., list[Tensor]]) -> Callable[..., list[Tensor]]:
        asked.append(fn.__name__)
        raise RuntimeError("not compiled in this test")

    monkeypatch.setattr(compiled, "_compile", record)
    return asked


def test_policy_compiles_only_where_the_table_says(
    compiles: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not compile_policy("adamw", "cpu", torch.float32, 1 << 30)
    params = [torch.ones(3)]
    sgd_update_(params, [torch.ones(3)], sgd_init(params), lr=0.5, compile=None)
    assert torch.equal(params[0], torch.full((3,), 0.5)) and compiles == []
    monkeypatch.setitem(compiled.COMPILE_FASTER_FROM, ("sgd", "cpu", torch.float32), 4)
    assert compile_policy("sgd", "cpu", torch.float32, 4)
    assert not compile_policy("sgd", "cpu", torch.float32, 3)
    sgd_update_(params, [torch.ones(3)], sgd_init(params), lr=0.5, compile=None)  # 3 < 4
    assert compiles == []
    sgd_update_([torch.ones(4)], [torch.ones(4)], sgd_init([torch.ones(4)]), compile=None)
    assert compiles == ["_sgd_graph"]
