"""``store_param_remainders`` takes a bool, checked before any collective (the runs:
``tests/dist/test_remainders.py``)."""

from __future__ import annotations

import pytest
import torch

BF16, FP32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize("bad", [1, "yes"])
def test_store_param_remainders_must_be_a_bool(bad: object) -> None:
    from zero_functional.core.main_params import check_remainders

    with pytest.raises(TypeError, match="must be True or False"):
        check_remainders(bad, FP32, [BF16])
