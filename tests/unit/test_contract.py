"""The messages of overlap mode's refusals name the likely mistake (the contract on ranks:
``tests/dist/test_contract.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zero_functional.optimizer import ZeroRedundancyOptimizer


def test_messages_name_the_likely_mistake() -> None:
    model = nn.Linear(2, 2)
    params = model.parameters()
    list(params)
    with pytest.raises(ValueError, match="exhausted iterator"):
        ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="got a dict"):
        ZeroRedundancyOptimizer(dict(model.named_parameters()), torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="hyperparameter lr must be a number.*got str 'abc'"):
        ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr="abc")
    with pytest.raises(TypeError, match="betas must be a tuple of 2 numbers"):
        ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, betas="0.9")
