"""Properties of zero_functional.comm.codec: each format rounds each element once, within its
bound; a block holding a non-finite value stays non-finite; encoding never touches its input."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from zero_functional.comm.codec import BLOCK, WIRE_DTYPES, Codec, check_wire_dtype

# fp32 arithmetic in the encoder (x / scale, code * scale) adds at most a few ulps of the value
FP32_SLACK = 4 * 2.0**-24

sizes_st = st.integers(0, 3 * BLOCK + 5)
scales_st = st.sampled_from([1e-6, 1e-2, 1.0, 1e3])


def _values(n: int, seed: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * scale
    if n > 3:  # a block of a different magnitude: its own scale
        x[: min(n, BLOCK) // 2] *= 1e3
    return x


@pytest.mark.parametrize("dtype", WIRE_DTYPES, ids=str)
@given(n=sizes_st, seed=st.integers(0, 2**16), scale=scales_st)
def test_decode_is_within_half_a_quantum_of_each_element(
    dtype: torch.dtype, n: int, seed: int, scale: float
) -> None:
    codec = Codec(dtype)
    x = _values(n, seed, scale)
    before = x.clone()
    payload = codec.encode(x)
    assert torch.equal(x, before)  # pure
    assert payload.dtype == torch.uint8 and payload.numel() == codec.nbytes(n)
    assert payload.numel() % 4 == 0
    decoded = codec.decode(payload, n)
    assert decoded.dtype == torch.float32 and decoded.shape == (n,)
    error = (decoded - x).abs()
    bound = codec.rounding_bound(x) + FP32_SLACK * x.abs()
    assert bool((error <= bound).all()), float((error - bound).max())


@pytest.mark.parametrize("dtype", WIRE_DTYPES, ids=str)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan], ids=str)
def test_a_non_finite_value_stays_non_finite_and_its_block_only(
    dtype: torch.dtype, bad: float
) -> None:
    codec = Codec(dtype)
    x = torch.linspace(-1, 1, 3 * BLOCK)
    x[BLOCK + 7] = bad
    decoded = codec.decode(codec.encode(x), x.numel())
    assert not decoded[BLOCK + 7].isfinite()
    others = torch.cat([decoded[:BLOCK], decoded[2 * BLOCK :]])
    assert bool(others.isfinite().all())  # the other blocks keep their own scales
    if codec.blockwise:  # the whole block: a GradScaler sees it whatever it reads
        assert not bool(decoded[BLOCK : 2 * BLOCK].isfinite().any())


@pytest.mark.parametrize("dtype", WIRE_DTYPES, ids=str)
def test_zeros_and_empty_round_trip_exactly(dtype: torch.dtype) -> None:
    codec = Codec(dtype)
    assert torch.equal(
        codec.decode(codec.encode(torch.zeros(BLOCK + 1)), BLOCK + 1), torch.zeros(BLOCK + 1)
    )
    assert codec.nbytes(0) == 0 and codec.decode(codec.encode(torch.zeros(0)), 0).numel() == 0


def test_bytes_on_the_wire_per_element() -> None:
    n = 1 << 20
    per = {str(d): Codec(d).nbytes(n) / (4 * n) for d in WIRE_DTYPES}
    # 8 bits and an fp32 scale per 256 elements: 1/4 + 1/256 of fp32's bytes
    assert per == {
        "torch.bfloat16": 0.5,
        "torch.float16": 0.5,
        "torch.int8": 0.25 + 1 / 256,
        "torch.float8_e4m3fn": 0.25 + 1 / 256,
    }


def test_every_other_dtype_is_refused_naming_the_choices() -> None:
    assert check_wire_dtype(None) is None
    with pytest.raises(ValueError, match=r"wire_dtype must be None or one of torch\.bfloat16"):
        check_wire_dtype(torch.float32)
    with pytest.raises(ValueError, match="gather_dtype must be None or one of .*float8_e4m3fn"):
        check_wire_dtype(torch.uint8, "gather_dtype")
    with pytest.raises(TypeError, match="got 'int8'"):
        check_wire_dtype("int8")
