"""The functional ZeRO step in a torch.func loop matches DDP with torch.optim.Adam."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call, grad
from torch.nn.parallel import DistributedDataParallel as DDP

from zero_functional import comm
from zero_functional.functional import adam
from zero_functional.launch import run_ranks
from zero_functional.partition import sorted_greedy
from zero_functional.sharded import owned_indices, shard_init, shard_owners, shard_update


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 2))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(6, 5, generator=g), torch.randn(6, 2, generator=g)


def _loop_worker(rank: int, world_size: int) -> float:
    model = _net()
    params = {k: v.detach() for k, v in model.named_parameters()}
    partition = sorted_greedy([p.numel() for p in params.values()], world_size)
    owners = shard_owners(partition, len(params))
    opt = adam(lr=0.01)
    state = shard_init(opt, params, partition, rank)

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((functional_call(model, p, (x,)) - y) ** 2).mean()

    ref = DDP(_net())
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    for step in range(5):
        x, y = _batch(rank, step)
        grads = grad(loss_fn)(params, x, y)
        for g in grads.values():
            dist.all_reduce(g)
            g /= world_size
        before = {k: v.clone() for k, v in params.items()}
        params, state = shard_update(opt, params, grads, state, partition, rank)
        assert all(torch.equal(before[k], v) for k, v in before.items())
        comm.sync_params(list(params.values()), owners)
        ref_opt.zero_grad()
        ((ref(x) - y) ** 2).mean().backward()
        ref_opt.step()
    return max((params[k] - v).abs().max().item() for k, v in ref.module.named_parameters())


def test_torch_func_loop_with_sharded_adam_matches_ddp() -> None:
    for diff in run_ranks(_loop_worker, 2, timeout_s=120):
        assert diff < 1e-6


def test_shard_update_rejects_state_of_another_rank() -> None:
    params = [torch.ones(3), torch.ones(5)]
    partition = sorted_greedy([3, 5], 2)
    state = shard_init(adam(), params, partition, rank=0)
    with pytest.raises(ValueError, match="another rank"):
        shard_update(adam(), params, params, state, partition, rank=1)
    assert owned_indices(partition, 1) == (0,)
