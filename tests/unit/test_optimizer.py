"""The constructor's refusals before any collective, and the state's byte round trip
(the parity runs against torch: ``tests/dist/test_optimizer.py``)."""

from __future__ import annotations

import pytest
import torch

from zero_functional.optimizer import ZeroRedundancyOptimizer


def test_constructor_rejects_bad_params_before_any_collective() -> None:
    with pytest.raises(TypeError, match="iterable"):
        ZeroRedundancyOptimizer(torch.zeros(3), torch.optim.SGD, lr=0.1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty parameter list"):
        ZeroRedundancyOptimizer([], torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="not a Tensor|all Tensors"):
        ZeroRedundancyOptimizer([torch.zeros(3), 3], torch.optim.SGD, lr=0.1)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="sparse"):
        ZeroRedundancyOptimizer([torch.zeros(3, 3).to_sparse()], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="dtypes float32, int64"):
        ZeroRedundancyOptimizer(
            [torch.zeros(3), torch.zeros(3, dtype=torch.int64)], torch.optim.SGD, lr=0.1
        )


def test_object_bytes_round_trip_without_numpy() -> None:
    from zero_functional import comm

    obj = {"state": {3: {"step": torch.tensor(2.0), "exp_avg": torch.randn(4, 5)}}}
    back = comm.from_bytes(comm.to_bytes(obj))
    assert isinstance(back, dict)
    assert torch.equal(back["state"][3]["exp_avg"], obj["state"][3]["exp_avg"])
