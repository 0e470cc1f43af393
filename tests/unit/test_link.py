"""``--link RATE`` read as ``tc`` writes rates (the shaped runs: ``tests/dist/test_link.py``)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zero_functional.app.link import byte_floor_ms, rate_bits


@given(st.integers(1, 10**6), st.sampled_from(["", "k", "m", "g"]))
def test_rates_are_read_as_tc_writes_them(number: int, unit: str) -> None:
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[unit]
    assert rate_bits(f"{number}{unit}bit") == number * scale
    # the floor is linear in the bytes and inverse in the rate
    assert byte_floor_ms(2e6, f"{number}{unit}bit") == pytest.approx(
        2 * byte_floor_ms(1e6, f"{number}{unit}bit")
    )
