"""Errors that come before any collective: the arguments' own error first, and ``check_new_group``
refusing what the constructor refuses (the ranks' agreement: ``tests/dist/test_agreement.py``)."""

from __future__ import annotations

import pytest
import torch

from zero_functional.core.checks import check_new_group
from zero_functional.shell.agreement import agreed_inputs


def test_without_a_process_group_the_arguments_own_error_comes_first() -> None:
    with pytest.raises(TypeError, match="optimizer_class must be"):
        agreed_inputs([torch.zeros(2)], object, None, "flat", False, {"lr": 0.1})


def test_check_new_group_refuses_what_the_constructor_refuses() -> None:
    check_new_group({"params": [torch.zeros(3)]}, "gloo", "flat")
    with pytest.raises(ValueError, match="NCCL"):
        check_new_group({"params": [torch.zeros(3)]}, "nccl", "sorted_greedy")
    with pytest.raises(ValueError, match="meta device"):
        check_new_group({"params": [torch.zeros(3, device="meta")]}, "gloo", "flat")
