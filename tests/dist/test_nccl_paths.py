"""The NCCL-only paths, run on gloo: even shards through reduce_scatter_single/all_gather_single
(padded), and collectives grouped in one coalesced launch.

This project's machines have no GPU, so NCCL itself never runs here. What can run does: gloo
implements the even collectives too, so forcing the policy's "reduce_scatter+all_gather" choice
exercises the padding and copy-back code; and a stand-in for torch's ``_coalescing_manager``
checks that every rooted collective of a group is issued inside one coalesced block and waited
for through the block's handle, as NCCL needs.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from zero_functional import comm, hooks, optimizer
from zero_functional.optimizer import ZeroRedundancyOptimizer

from tests.helpers import FUSED, run_ranks, train_both


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5), nn.Tanh(), nn.Linear(5, 3))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(4, 7, generator=g), torch.randn(4, 3, generator=g)


def _backward(module: nn.Module, rank: int, world_size: int, step: int) -> None:
    x, y = _batch(rank, step)
    ((module(x) - y) ** 2).mean().backward()


def _even_worker(rank: int, world_size: int) -> dict[str, float]:
    # the policy as NCCL with even shards answers it, in the one place every path asks (the
    # optimizer's, chosen once)
    forced = "reduce_scatter+all_gather"
    optimizer.choose_collectives = lambda *a, **k: forced  # type: ignore[assignment]
    out: dict[str, float] = {}
    for mode in ("step bucket view", "step reduce hook", "overlap"):
        model, ref_model = _net(), _net()
        ddp, ref = DDP(model, bucket_cap_mb=1e-4), DDP(ref_model, bucket_cap_mb=1e-4)
        zero = ZeroRedundancyOptimizer(
            ddp.parameters(),
            torch.optim.Adam,
            partition="flat",
            overlap_with_ddp=mode == "overlap",
            parameters_as_bucket_view="bucket" in mode,
            lr=0.01,
        )
        if mode == "overlap":
            ddp.register_comm_hook(None, hooks.hook_with_zero_step(allreduce_hook, ddp, zero))
            state = hooks.overlap_state(zero)
            assert state is not None and state.collectives == forced
        elif "hook" in mode:
            ddp.register_comm_hook(None, hooks.reduce_scatter_hook(ddp, zero))
        plain = torch.optim.Adam(ref.parameters(), lr=0.01, **FUSED)
        train_both([(ddp, zero), (ref, plain)], rank, world_size, 4, _backward)
        out[mode] = max(
            (a - b).abs().max().item() for a, b in zip(model.parameters(), ref_model.parameters())
        )
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_even_shards_through_reduce_scatter_and_all_gather_equal_ddp(world_size: int) -> None:
    for result in run_ranks(_even_worker, world_size, timeout_s=180):
        for mode, diff in result.items():
            # Both sides average the same gradients (at 2 ranks: a sum of two, either order) and run
            # the same kernels (a reference Adam is FUSED, the kernel ours runs; SGD and the rest
            # run torch's own on both), so they differ only where a piece cut off a tensor puts
            # elements in a kernel's scalar tail rather than its vector body: a few ulps of an
            # update per step, which move a parameter by one ulp of itself only where they cross a
            # rounding boundary: at most 4 steps x ulp(|p| < 1) = 2.4e-7 < 1e-6 (|p| < 1, ulp <=
            # 6e-8: these layers start below 0.5 and move little). At 3 ranks our reduce and DDP's
            # all-reduce add the ranks' gradients in other orders: an average differs by at most 2 u
            # kappa of itself (u = 2^-24; kappa = sum |g_r| / |sum g_r|, the seeded data's
            # conditioning, not the machine's), which a step (a ratio of gradient statistics, at
            # most lr = 0.01 in size) carries over at most twice: 4 steps x 2 x 0.01 x 2 u kappa =
            # 9.5e-9 kappa, under 1e-6 while kappa < 100.
            assert diff < 1e-6, (mode, world_size, diff)


def _coalesced_worker(rank: int, world_size: int) -> list[int]:
    """With NCCL, the rooted collectives of a call go out inside one coalesced block."""
    blocks: list[int] = []

    @contextlib.contextmanager
    def fake_manager(group: Any, device: Any, async_ops: bool = False) -> Any:
        assert async_ops and device.type == "cpu"
        issued: list[Any] = []
        originals = {name: getattr(dist, name) for name in ("broadcast", "reduce")}

        def capture(fn: Any) -> Any:
            def inner(*args: Any, **kwargs: Any) -> Any:
                work = fn(*args, **kwargs)
                issued.append(work)
                return None  # inside a coalesced block the per-op handle is not the one to wait

            return inner

        for name, fn in originals.items():
            setattr(dist, name, capture(fn))
        cm = type("CM", (), {"works": issued})()
        try:
            yield cm
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
        blocks.append(len(issued))

    for module in (comm, comm.groups, comm.pending, comm.collectives):  # wherever it is asked
        module.is_nccl = lambda group: True  # type: ignore[attr-defined]
    dist.distributed_c10d._coalescing_manager = fake_manager  # type: ignore[assignment]
    model = _net()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    zero.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(everyone, flat)
    assert all(torch.equal(flat, other) for other in everyone)
    return blocks


def test_rooted_collectives_go_out_in_one_coalesced_block_on_nccl() -> None:
    for blocks in run_ranks(_coalesced_worker, 2, timeout_s=120):
        # the step's parameter sync: every broadcast of the step in one block
        assert blocks and blocks[-1] >= 2, blocks
