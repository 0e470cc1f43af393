"""The spawn helper itself: results come back in rank order, failures and hangs fail fast."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed import run_ranks


def _sum_ranks(rank: int, world_size: int) -> float:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return float(t.item())


def _fail_on_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def test_run_ranks_returns_results_in_rank_order() -> None:
    assert run_ranks(_sum_ranks, 3) == [3.0, 3.0, 3.0]


def test_run_ranks_reports_the_failing_rank() -> None:
    with pytest.raises(AssertionError, match="boom on rank 1"):
        run_ranks(_fail_on_one, 2, timeout_s=30)
