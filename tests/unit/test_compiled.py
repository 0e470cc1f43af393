"""Which updates the compile policy compiles (the compiled updates themselves, which start the
C++ compiler: ``tests/dist/test_compiled.py``)."""

from __future__ import annotations

import pytest
import torch

import zero_functional.functional.compiled as compiled
from zero_functional.functional import (
    sgd_init,
    sgd_update_,
)
from zero_functional.functional.compiled import compile_policy


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
