"""agreement: a problem on one rank is the same error on every rank, and nothing hangs."""

from __future__ import annotations

import torch
import torch.distributed as dist

from zero_functional.shell.agreement import agree, agreed_inputs

from tests.helpers import run_ranks


def _agree_worker(rank: int, world_size: int) -> list[str]:
    seen: list[str] = []
    group = dist.group.WORLD
    assert group is not None

    def fails_on_rank_1() -> None:
        if rank == 1:
            raise ValueError("rank 1's own problem")

    for check, items in [
        (lambda: None, [torch.zeros(2)]),
        (fails_on_rank_1, [torch.zeros(2)]),
        (lambda: None, [torch.zeros(2 + rank)]),  # the ranks' parameters differ
    ]:
        try:
            agree("example()", check, items, group, 30.0)
            seen.append("ok")
        except (ValueError, RuntimeError) as e:
            seen.append(f"{type(e).__name__}: {e}")
    try:
        agreed_inputs(
            [torch.zeros(2)] if rank == 0 else [], torch.optim.SGD, None, "flat", False, {}
        )
    except ValueError as e:
        seen.append(str(e))
    return seen


def test_every_rank_raises_the_same_error_for_a_problem_on_one_rank() -> None:
    zero, one = run_ranks(_agree_worker, 2, timeout_s=120)
    assert zero[0] == one[0] == "ok"
    assert zero[1] == "ValueError: example() failed on rank(s) [1]: rank 1's own problem"
    assert one[1] == "ValueError: rank 1's own problem"
    assert zero[2].startswith("RuntimeError") and zero[2] == one[2]
    assert "rank(s) [1]" in zero[3] and "empty parameter list" in one[3]
