"""Every rank of the flat functional step simulated in one process: together they equal the
unsharded update bitwise; a shard refuses another rank's state (the torch.func loop on ranks:
``tests/dist/test_sharded.py``)."""

from __future__ import annotations

import pytest
import torch

from zero_functional.core.ownership import flat_ownership
from zero_functional.core.sharded import shard_init, shard_update
from zero_functional.functional import adam


def test_shard_update_rejects_state_of_another_rank() -> None:
    params = [torch.ones(3), torch.ones(5)]
    ownership = flat_ownership([3, 5], 2)
    state = shard_init(adam(), params, ownership, rank=0)
    with pytest.raises(ValueError, match="another rank"):
        shard_update(adam(), params, params, state, ownership, rank=1)
    with pytest.raises(ValueError, match="built for parameter sizes"):
        shard_init(adam(), [torch.ones(4)], ownership, rank=0)


def test_simulated_flat_ranks_together_equal_the_unsharded_update_bitwise() -> None:
    torch.manual_seed(0)
    params = [torch.randn(7, 3), torch.randn(5), torch.randn(1), torch.randn(0), torch.randn(4, 4)]
    grads = [torch.randn_like(p) for p in params]
    opt = adam(lr=0.1, weight_decay=0.01)
    full, _ = opt.update(params, grads, opt.init(params))
    for world_size in (1, 2, 3, 4, 7):
        ownership = flat_ownership([p.numel() for p in params], world_size)
        result = [p.clone() for p in params]
        for rank in range(world_size):
            state = shard_init(opt, params, ownership, rank)
            mine, _ = shard_update(opt, params, grads, state, ownership, rank)
            for piece in ownership.owned(rank):
                result[piece.param].view(-1)[piece.start : piece.stop] = mine[piece.param].view(-1)[
                    piece.start : piece.stop
                ]
        for a, b in zip(result, full):
            assert torch.equal(a, b), world_size
