"""``plan --optimizer/--remainders/--ema``: bytes per rank below 1/N (issue 31), against the
closed forms (``P + G + (main + state + ema) / N`` per parameter), and torchao's facts that
:mod:`zero_functional.functional.lowbit` keeps (block sizes, the quantization rule)."""

from __future__ import annotations

import inspect
import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zero_functional.app.plan_format import format_memory
from zero_functional.functional.lowbit import LOW_BIT, MIN_QUANTIZED_NUMEL, low_bit_spec

from tests.helpers import run_cli

from tests.unit.test_plan_memory import per_parameter


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
