"""Muon + AdamW ownership as ``plan --muon`` reports it: Newton–Schulz cost, matrices balanced by
it, the hidden matrices of each model, and the table on GPT-2 small at 4 and 8 ranks."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from zero_functional.app.models import MODELS, OUTSIDE_BLOCKS, model_shapes, muon_params
from zero_functional.core.cost import cost_greedy, muon_plan, newton_schulz_cost
from zero_functional.core.loads import balance_report, max_over_mean
from zero_functional.core.partition import sorted_greedy

from tests.helpers import run_cli


def test_resnet50_has_no_muon_matrix_and_plan_says_to_drop_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert not any(muon_params("resnet50")[1])
    code, out, err = run_cli(["plan", "resnet50", "--muon"], capsys)
    assert code == 2 and not out
    assert "no hidden 2-D matrix" in err and "drop --muon" in err and len(err.splitlines()) == 1


def _muon_table(out: str) -> dict[int, list[list[str]]]:
    table = out[out.index("Muon on ") :].splitlines()[3:]
    rows: dict[int, list[list[str]]] = {}
    for line in table:
        cells = line.split()
        rows.setdefault(int(cells[0]), []).append(cells[1:])
    return rows


def test_plan_muon_on_gpt2_small_is_balanced_within_5_percent_at_4_and_8_ranks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run_cli(["plan", "gpt2-small", "--world-sizes", "4", "8", "--muon"], capsys)
    assert code == 0, err
    assert "Muon on 48 matrices (84,934,656 parameters)" in out
    rows = _muon_table(out)
    assert sorted(rows) == [4, 8]
    for w, lines in rows.items():
        ranks, summary = lines[:-1], lines[-1]
        assert [r[0] for r in ranks] == [str(r) for r in range(w)]
        # matrices, Muon and AdamW elements cover the model once
        assert sum(int(r[1]) for r in ranks) == 48
        assert sum(int(r[2].replace(",", "")) + int(r[3].replace(",", "")) for r in ranks) == (
            124_439_808
        )
        costs = [int(r[-1].replace(",", "")) for r in ranks]
        assert summary[0] == "max/mean"
        state_ratio, cost_ratio = float(summary[1]), float(summary[2])
        assert state_ratio <= 1.05 and cost_ratio <= 1.05
        assert cost_ratio == pytest.approx(max_over_mean(costs), abs=5e-4)
        plan = muon_plan(*muon_params("gpt2-small"), w)
        assert max_over_mean(plan.state_bytes) <= 1.05
        assert max_over_mean(plan.cost) <= 1.05


def test_plan_muon_past_16_ranks_prints_the_busiest_rank_only(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run_cli(["plan", "gpt2-small", "--world-sizes", "64", "--muon"], capsys)
    assert code == 0
    rows = _muon_table(out)[64]
    assert [r[0] for r in rows] == ["max", "max/mean"]
    assert rows[0][1] == "1"  # 48 matrices on 64 ranks: at most one each
