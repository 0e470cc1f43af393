"""``main_params_dtype`` checked before any collective, and unscaling in the main dtype as
``GradScaler`` does (the parity runs: ``tests/dist/test_main_params.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zero_functional.optimizer import ZeroRedundancyOptimizer
from zero_functional.shell.amp import unscaled

FP32 = torch.float32


def test_main_params_dtype_is_checked() -> None:
    def build(**kw: Any) -> None:
        ZeroRedundancyOptimizer([torch.zeros(2, requires_grad=True)], torch.optim.SGD, **kw)

    # checks run before the process group is needed: the input's own error comes first
    with pytest.raises(ValueError, match="not wider"):
        build(lr=0.1, main_params_dtype=torch.float16)
    with pytest.raises(TypeError, match="torch.dtype"):
        build(lr=0.1, main_params_dtype="fp32")
    with pytest.raises(ValueError, match="elementwise"):
        ZeroRedundancyOptimizer(
            [torch.zeros(2, requires_grad=True)],
            torch.optim.LBFGS,
            main_params_dtype=torch.float32,
        )


def test_unscaling_in_the_main_dtype_is_gradscalers_own_arithmetic() -> None:
    # GradScaler.unscale_ multiplies fp32 gradients by its inverse scale; ours does the same
    # after the upcast, so an fp16 gradient unscales to what torch gives its fp32 twin
    torch.manual_seed(0)
    grads = torch.randn(1000) * 3e4
    p = torch.nn.Parameter(torch.zeros(1000))
    p.grad = grads.clone()
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=3.0 * 2.0**7)
    scaler.scale(torch.ones(()))
    scaler.unscale_(opt)
    ours = unscaled({0: grads.clone()}, {0: FP32}, torch.tensor(scaler.get_scale()))
    assert torch.equal(ours[0], p.grad)
    half = grads.to(torch.float16)
    p.grad = half.float()
    opt2 = torch.optim.SGD([p], lr=0.1)
    scaler2 = torch.amp.GradScaler("cpu", init_scale=3.0 * 2.0**7)
    scaler2.scale(torch.ones(()))
    scaler2.unscale_(opt2)
    assert torch.equal(unscaled({0: half}, {0: FP32}, torch.tensor(scaler2.get_scale()))[0], p.grad)
