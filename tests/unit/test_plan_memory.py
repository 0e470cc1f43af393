"""The bytes per rank ``plan --optimizer/--remainders/--ema`` prints, against the closed forms
(``P + G + (main + state + ema) / N`` per parameter), and torchao's facts that
:mod:`zero_functional.functional.lowbit` keeps; the command's flags and refusals."""

from __future__ import annotations

import inspect
import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zero_functional.app.plan_format import format_memory, format_snapshots
from zero_functional.functional.lowbit import LOW_BIT, MIN_QUANTIZED_NUMEL, low_bit_spec

from tests.helpers import run_cli

BIG = [1 << 20] * 6  # every tensor quantized, split evenly


def per_parameter(table: str) -> list[float]:
    """The ``per parameter per rank (flat)`` values of a :func:`format_memory` table."""
    last = table.splitlines()[-1]
    assert last.startswith("per parameter per rank (flat):"), table
    return [float(v) for v in re.findall(r"([\d.]+) B at", last)]


@pytest.mark.parametrize(
    ("options", "owned_bytes"),
    [
        ({}, 12.0),  # Megatron-LM's "6 + 12/d" but with bf16 gradients: 4 + 12/N
        ({"remainders": True}, 10.0),
        ({"optimizer": "adamw8bit"}, 4 + 2.03125),
        ({"optimizer": "adamwfp8", "remainders": True}, 2 + 2.03125),
        ({"optimizer": "adamw4bit", "remainders": True}, 2 + 1.0625),
        ({"optimizer": "adamw4bit", "remainders": True, "ema": True}, 2 + 1.0625 + 4),
        ({"ema": True}, 16.0),
    ],
)
def test_bytes_per_parameter_are_the_closed_form(
    options: dict[str, Any], owned_bytes: float
) -> None:
    table = format_memory(BIG, [1, 2, 8], "bf16", "fp32", **options)
    for got, n in zip(per_parameter(table), (1, 2, 8), strict=True):
        assert got == pytest.approx(4 + owned_bytes / n, abs=0.005), (options, n, table)


def test_small_or_ragged_tensors_keep_full_precision_moments() -> None:
    # 4,000 elements (too few) and 5,000 (not whole blocks): two fp32 moments, as plain AdamW
    for numels in ([4000], [5000]):
        low = format_memory(numels, [1], "fp32", None, "adamw8bit")
        plain = format_memory(numels, [1], "fp32", None)
        assert per_parameter(low) == per_parameter(plain) == [16.0]  # 4 + 4 + 8
    # without a main copy the EMA is kept in the parameters' dtype
    assert per_parameter(format_memory(BIG, [1], "bf16", None, ema=True)) == [10.0]


@given(
    st.sampled_from(sorted(LOW_BIT)),
    st.integers(0, 1 << 16),
    st.integers(0, 1 << 16),
)
def test_state_bytes_add_up_over_block_aligned_pieces(name: str, blocks: int, extra: int) -> None:
    spec = LOW_BIT[name]
    numel = blocks * spec.block + extra
    whole = spec.state_bytes(numel)
    cut = (blocks // 2) * spec.block  # a cut on a block bound, counted from the start
    pieces = spec.state_bytes(numel, owned=cut) + spec.state_bytes(numel, owned=numel - cut)
    assert pieces == whole
    # quantized or not is the whole tensor's property, whatever piece is counted
    assert spec.quantized(numel) == (numel >= MIN_QUANTIZED_NUMEL and extra % spec.block == 0)


def test_lowbit_facts_are_torchaos() -> None:
    optim = pytest.importorskip("torchao.optim")
    for spec in LOW_BIT.values():
        module, _, name = spec.class_path.rpartition(".")
        assert module == "torchao.optim"
        cls = getattr(optim, name)
        assert inspect.signature(cls).parameters["block_size"].default == spec.block
        assert low_bit_spec(spec.class_path) is spec
    source = inspect.getsource(optim.adam)
    assert f"numel() >= {MIN_QUANTIZED_NUMEL}" in source  # torchao's own rule, still


def test_plan_flags(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "gpt2-small", "--world-sizes", "8", "--dtype", "bf16", "--main-params", "fp32"]
    code, out, _ = run_cli([*argv, "--optimizer", "adamw8bit", "--remainders", "--ema"], capsys)
    assert code == 0
    assert "adamw8bit's 2 block-quantized states, fp32 EMA" in out
    assert per_parameter(out.strip())[0] == pytest.approx(4 + (2 + 2.03 + 4) / 8, abs=0.01)
    code, _, err = run_cli(["plan", "gpt2-small", "--remainders"], capsys)
    assert code == 2 and "needs --dtype bf16 --main-params fp32" in err
    code, _, err = run_cli(["plan", "gpt2-small", "--optimizer", "adam9bit"], capsys)
    assert code == 2 and "expected one of adamw, adamw8bit, adamw4bit, adamwfp8" in err
    # --help names every low-bit optimizer (it lists them without importing torch)
    code, out, _ = run_cli(["plan", "--help"], capsys)
    assert code == 0 and all(name in " ".join(out.split()) for name in LOW_BIT)


def test_snapshots_keep_a_share_and_one_copy_and_peak_at_twice_that(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 1,000 and 500 fp32 elements: flat gives each of 2 ranks 750, a share of 3 x 4 B each
    table = format_snapshots([1000, 500], [1, 2], "fp32", None)
    rows = {tuple(line.split()[:2]): line.split()[2:] for line in table.splitlines()[2:]}
    assert rows[("2", "flat")] == ["8.8", "KiB"] * 2 + ["17.6", "KiB", "35.2", "KiB"]
    assert rows[("1", "flat")][2:4] == ["0", "B"]  # one rank: no copy to keep
    # a bf16 model with fp32 main copies: 2 B values + 4 B main copy + 8 B moments per element
    bf16 = format_snapshots([1000, 500], [2], "bf16", "fp32").splitlines()
    assert bf16[-1].split()[2:4] == ["10.3", "KiB"]  # 750 x 14 B
    code, out, _ = run_cli(["plan", "gpt2-small", "--world-sizes", "8", "--snapshots"], capsys)
    assert code == 0 and "in-memory snapshots, host memory per rank" in out
