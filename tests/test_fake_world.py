"""Thousands of ranks by simulation (issue 23, part 2): torch's fake process group lets this
process be rank r of a world of 64, 1,024 or 4,096, to check construction, ownership, memory and
the length of messages at scale.

What cannot be checked this way (see :mod:`zero_functional.comm.testing`): anything that needs other
ranks' data (sums, gathers, the constructor's agreement check, consolidation: each receives this
rank's own bytes), and overlap mode's first backward with DDP's ``allreduce_hook``.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from zero_functional import ZeroRedundancyOptimizer, comm
from zero_functional.comm import calls
from zero_functional.comm.testing import fake_world
from zero_functional.core.checks import agreement_verdict
from zero_functional.core.plans import ownership_for
from zero_functional.hooks import reduce_scatter_hook

WORLDS = [64, 1024, 4096]
MESSAGE_LIMIT = 2048


def gpt2_small_shapes() -> list[tuple[int, ...]]:
    """GPT-2 small's 148 parameter tensors (124,439,808 elements), in state-dict order."""
    shapes: list[tuple[int, ...]] = [(50257, 768), (1024, 768)]
    for _ in range(12):
        shapes += [(768,), (768,), (768, 2304), (2304,), (768, 768), (768,)]
        shapes += [(768,), (768,), (768, 3072), (3072,), (3072, 768), (768,)]
    return shapes + [(768,), (768,)]


@pytest.fixture(scope="module")
def gpt2() -> list[nn.Parameter]:
    """One set of GPT-2-small-shaped parameters with gradients, shared by the module's tests
    (each simulated rank changes only its own pieces)."""
    params = [nn.Parameter(torch.empty(s).uniform_(-0.02, 0.02)) for s in gpt2_small_shapes()]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    return params


def _owned_state(zero: ZeroRedundancyOptimizer) -> dict[int, tuple[int, int]]:
    params = [p for g in zero.param_groups for p in g["params"]]
    index = {p: k for k, p in enumerate(params)}
    return {
        index[p]: (s["exp_avg"].numel(), s["exp_avg_sq"].numel()) for p, s in zero.state.items()
    }


@pytest.mark.parametrize("partition", ["flat", "sorted_greedy"])
@pytest.mark.parametrize("world_size", WORLDS)
def test_gpt2_small_at_thousands_of_ranks(
    gpt2: list[nn.Parameter], world_size: int, partition: Any
) -> None:
    plan = ownership_for(partition, [{"params": gpt2}], world_size)
    seen: list[int] = []
    for rank in (0, 1, world_size - 1):
        started = time.perf_counter()
        with fake_world(world_size, rank):
            zero = ZeroRedundancyOptimizer(gpt2, torch.optim.AdamW, lr=1e-3, partition=partition)
            zero.step()
            seconds = time.perf_counter() - started
            assert zero.ownership == plan  # what the pure plan says, exactly
            seen.append(hash(zero.ownership))
            # the local state holds exactly the pieces the plan gives this rank
            want = {s.param: (s.stop - s.start,) * 2 for s in plan.owned(rank)}
            assert _owned_state(zero) == want
        print(f"{partition} {world_size} ranks, rank {rank}: built and stepped in {seconds:.2f} s")
    assert len(set(seen)) == 1  # the same ownership on every sampled rank
    loads = [sum(s.stop - s.start for s in plan.owned(r)) for r in range(world_size)]
    if partition == "flat":  # even to the element: 124,439,808 / 4,096 is not whole
        assert round(max(loads) / (sum(loads) / world_size), 3) == 1.000
        assert len(set(loads[:-1])) == 1  # all but the last rank, which takes the remainder


def test_ddp_and_a_step_after_backward_at_1024_ranks() -> None:
    torch.manual_seed(0)
    with fake_world(1024, rank=5):
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
        ddp = nn.parallel.DistributedDataParallel(model)
        zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.AdamW, partition="flat")
        ddp.register_comm_hook(None, reduce_scatter_hook(ddp, zero))
        before = [p.detach().clone() for p in model.parameters()]
        ddp(torch.randn(8, 64)).sum().backward()
        zero.step()
        params = list(model.parameters())
        for s in zero.ownership.owned(5):  # this rank's pieces took the step (the others'
            # values are not meaningful here: a receive buffer gets no data under the fake group)
            piece = params[s.param].detach().reshape(-1)[s.start : s.stop]
            assert bool((piece != before[s.param].reshape(-1)[s.start : s.stop]).all())
        assert zero.ownership.owned(5)


@pytest.mark.parametrize("world_size", WORLDS)
def test_messages_stay_short_at_any_world_size(
    world_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a collective that fails: every other rank is silent (the fake store holds no reports)
    monkeypatch.setattr(calls, "REPORT_GRACE_S", 0.0)
    with fake_world(world_size, rank=0) as group:
        with pytest.raises(comm.CollectiveError) as failed:
            with comm.call("step()", group):
                raise RuntimeError("Connection closed by peer")
    text = str(failed.value)
    assert len(text) <= MESSAGE_LIMIT, len(text)
    assert f"and {world_size - 1 - 4} more did not report" in text
    # every rank's check failed, or every rank's parameters differ from rank 0's
    failed_everywhere = agreement_verdict("x()", None, [("ValueError", "bad")] * world_size)
    differ = agreement_verdict("x()", None, [[0, 1, 2, r] for r in range(world_size)])
    for error in (failed_everywhere, differ):
        assert error is not None and len(str(error)) <= MESSAGE_LIMIT


def test_fake_world_refuses_a_running_group_and_bad_ranks() -> None:
    with pytest.raises(ValueError, match="rank"):
        with fake_world(4, rank=4):
            pass
    with fake_world(2) as group:
        assert dist.get_world_size(group) == 2
        with pytest.raises(RuntimeError, match="already running"):
            with fake_world(2):
                pass
    assert not dist.is_initialized()
