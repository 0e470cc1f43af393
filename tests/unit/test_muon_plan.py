"""Muon + AdamW ownership as ``plan --muon`` computes it: Newton–Schulz cost, matrices balanced by
it, the hidden matrices of each model, and the command's table on GPT-2 small at 4 and 8 ranks."""

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


class TinyLM(nn.Module):
    """An untied GPT: embeddings, a block, a norm and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(50, 8)
        self.pos_emb = nn.Parameter(torch.zeros(16, 8))
        self.attn = nn.Linear(8, 24)
        self.mlp = nn.Linear(8, 32, bias=False)
        self.norm = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 50, bias=False)


def tiny_lm() -> nn.Module:
    return TinyLM()


def test_newton_schulz_cost_is_symmetric_and_cubic_in_the_smaller_side() -> None:
    assert newton_schulz_cost((3, 5)) == newton_schulz_cost((5, 3)) == 45
    assert newton_schulz_cost((2 * 768, 768)) == 2 * 768**3
    assert newton_schulz_cost((0, 7)) == 0


@pytest.mark.parametrize("shape", [(), (5,), (2, 3, 4)])
def test_newton_schulz_cost_of_a_non_matrix_names_the_adamw_group(shape: tuple[int, ...]) -> None:
    with pytest.raises(
        ValueError, match="takes 2-D parameters only; put this parameter in the AdamW"
    ):
        newton_schulz_cost(shape)


def test_cost_greedy_balances_cost_where_element_counts_would_not() -> None:
    # four matrices of 64 elements each, costs 512, 64, 128 and 256
    shapes = [(8, 8), (1, 64), (2, 32), (4, 16)]
    costs = [newton_schulz_cost(s) for s in shapes]
    assert costs == [512, 64, 128, 256]
    by_cost = cost_greedy(costs, 2)
    by_numel = sorted_greedy([64] * 4, 2)
    assert by_cost == ((0,), (3, 2, 1))
    assert balance_report(costs, by_cost).max_load == 512  # the square matrix alone
    assert balance_report(costs, by_numel).max_load == 640
    assert max_over_mean([512, 448]) == pytest.approx(1.0667, abs=1e-4)


def test_muon_plan_owns_each_matrix_whole_and_splits_the_rest_flat() -> None:
    shapes = [(10,), (8, 8), (4,), (4, 8), (4, 8)]
    plan = muon_plan(shapes, [False, True, False, True, True], 2)
    assert plan.matrices == (1, 3, 4) and plan.rest == (0, 2)
    assert plan.matrix_owned == ((1,), (3, 4))
    assert plan.adamw_numel == (7, 7)
    assert plan.muon_numel == (64, 64)
    assert plan.state_bytes == (4 * 64 + 8 * 7,) * 2
    assert plan.cost == (512, 256)


def test_muon_plan_refuses_a_vector_for_muon_and_a_mask_of_another_length() -> None:
    with pytest.raises(ValueError, match="AdamW group"):
        muon_plan([(4,)], [True], 2)
    with pytest.raises(ValueError, match="one bool per parameter"):
        muon_plan([(4, 4), (4,)], [True], 2)


def test_gpt2_small_muon_matrices_are_the_blocks_attention_and_mlp_weights() -> None:
    shapes, muon = muon_params("gpt2-small")
    assert shapes == model_shapes("gpt2-small")
    chosen = [s for s, m in zip(shapes, muon) if m]
    assert chosen == [(768, 2304), (768, 768), (768, 3072), (3072, 768)] * 12
    assert not muon[0] and not muon[1]  # wte, wpe


def test_every_builtin_spec_says_where_its_blocks_are() -> None:
    assert set(OUTSIDE_BLOCKS) == set(MODELS)


@pytest.mark.parametrize("name", ["bert-base", "llama-1b", "gpt2-medium"])
def test_builtin_specs_give_muon_only_block_matrices(name: str) -> None:
    shapes, muon = muon_params(name)
    vocab = shapes[0][0]
    assert any(muon)
    assert all(len(s) == 2 and vocab not in s for s, m in zip(shapes, muon) if m)


def test_module_function_muon_matrices_leave_embeddings_and_head_to_adamw() -> None:
    shapes, muon = muon_params("tests.unit.test_muon_plan:tiny_lm")
    chosen = {s for s, m in zip(shapes, muon) if m}
    # tok (nn.Embedding), pos_emb ("emb" in its name) and lm_head ("head") stay with AdamW
    assert chosen == {(24, 8), (32, 8)}
    assert len(shapes) == 8


def test_the_optimizer_balances_muon_matrices_by_newton_schulz_cost_not_by_size() -> None:
    """Under ``"flat"`` with Muon on the matrices, each matrix is owned whole and placed by
    its Newton-Schulz cost: a (16, 1) matrix is as large as a (4, 4) one but costs a quarter,
    a (32, 2) one as large as an (8, 8) one but a quarter, so size-balancing and
    cost-balancing give the ranks other matrices; the optimizer follows the cost (as
    ``plan --muon`` does)."""

    from zero_functional import ZeroRedundancyOptimizer
    from zero_functional.comm.testing import fake_world
    from zero_functional.core.cost import cost_greedy, newton_schulz_cost

    shapes = [(16, 1), (4, 4), (8, 8), (32, 2)]
    with fake_world(2, rank=0):
        matrices = [torch.zeros(s, requires_grad=True) for s in shapes]
        rest = [torch.zeros(5, requires_grad=True)]
        zero = ZeroRedundancyOptimizer(
            [
                {"params": matrices, "optimizer_class": torch.optim.Muon, "lr": 0.02},
                {"params": rest},
            ],
            torch.optim.AdamW,
            partition="flat",
        )
        by_cost = cost_greedy([newton_schulz_cost(s) for s in shapes], 2)
        for rank in range(2):
            whole = {p.param for p in zero.ownership.owned(rank) if p.param < len(shapes)}
            assert whole == set(by_cost[rank]), (rank, whole, by_cost)
            for piece in zero.ownership.owned(rank):
                if piece.param < len(shapes):  # a matrix: owned whole
                    assert (piece.start, piece.stop) == (0, matrices[piece.param].numel())
        by_size = cost_greedy([math.prod(s) for s in shapes], 2)
        assert [set(r) for r in by_size] != [set(r) for r in by_cost]  # the rules differ here


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
