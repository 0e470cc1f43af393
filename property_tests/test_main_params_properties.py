"""Properties of zero_functional.core.main_params: the remainder split of fp32 main values."""

from __future__ import annotations

import struct

import torch
from hypothesis import given
from hypothesis import strategies as st

from zero_functional.core.main_params import join_main, split_main, tie_count

bits_st = st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=64)
finite_st = st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), max_size=64)


def _as_fp32(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int32).view(torch.float32)


@given(bits_st)
def test_join_of_split_is_every_fp32_bit_pattern_exactly(bits: list[int]) -> None:
    x = _as_fp32(bits)
    param, remainder = split_main(x)
    assert param.dtype == torch.bfloat16 and remainder.dtype == torch.int16
    assert torch.equal(join_main(param, remainder).view(torch.int32), x.view(torch.int32))


@given(finite_st)
def test_split_of_finite_values_is_torch_rounding_except_on_the_counted_ties(
    values: list[float],
) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    param, remainder = split_main(x)
    torch_round = x.to(torch.bfloat16)
    differ = param.view(torch.int16) != torch_round.view(torch.int16)
    tie = remainder == -0x8000
    assert not bool((differ & ~tie).any())  # only exact ties may round otherwise
    assert int(differ.sum()) == int(tie_count(param, remainder))
    # a tie rounds away from zero: the bf16 value is at least as far from zero as the fp32 one
    assert bool((param[tie].float().abs() >= x[tie].abs()).all())


@given(st.integers(0, 2**15 - 1), st.booleans())
def test_an_exact_tie_rounds_away_from_zero_and_is_counted_when_torch_rounds_to_even(
    high: int, negative: bool
) -> None:
    bits = (high << 16) | 0x8000 | (0x80000000 if negative else 0)
    (value,) = struct.unpack("<f", struct.pack("<I", bits))
    x = torch.tensor([value], dtype=torch.float32)
    param, remainder = split_main(x)
    assert int(remainder) == -0x8000
    exponent_all_ones = (high >> 7) & 0xFF == 0xFF  # inf/NaN above the bf16 range: not a value
    if not exponent_all_ones:
        assert int(param.view(torch.int16)) & 0x7FFF == high + 1  # magnitude up
        assert int(tie_count(param, remainder)) == (high % 2 == 0)
