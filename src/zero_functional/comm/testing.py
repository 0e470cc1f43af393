"""fake_world: one process acts as one rank of a world of any size (torch's fake group).

Every collective returns at once with this rank's own data, so construction, ownership and
memory can be checked at thousands of ranks in one process; nothing is summed or sent."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch import Tensor
from torch._C._distributed_c10d import GradBucket
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from zero_functional.core._validate import check_rank, check_world_size


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[dist.ProcessGroup]:
    """Be rank ``rank`` of a simulated world of ``world_size`` ranks for the block; a DDP built
    inside reduces each bucket to this rank's own values, or runs its registered comm hook.

    Example:
        >>> from zero_functional import ZeroRedundancyOptimizer
        >>> with fake_world(1024, rank=1023) as group:
        ...     params = [torch.zeros(4096, requires_grad=True)]
        ...     zero = ZeroRedundancyOptimizer(params, torch.optim.Adam, partition="flat")
        ...     [(s.start, s.stop) for s in zero.ownership.owned(1023)]
        [(4092, 4096)]
    """
    check_world_size(world_size)
    check_rank(rank, world_size)
    if dist.is_initialized():
        raise RuntimeError(
            "a process group is already running in this process: fake_world starts its own "
            "(call it outside init_process_group/destroy_process_group)"
        )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    hooks: weakref.WeakKeyDictionary[DistributedDataParallel, tuple[Any, Any]] = (
        weakref.WeakKeyDictionary()
    )
    init, register = DistributedDataParallel.__init__, DistributedDataParallel.register_comm_hook

    def fake_init(self: DistributedDataParallel, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        ddp = weakref.ref(self)

        def dispatch(state: Any, bucket: GradBucket) -> Future[Tensor]:
            module = ddp()
            user = hooks.get(module) if module is not None else None
            if user is not None:
                return user[1](user[0], bucket)  # type: ignore[no-any-return]
            done: Future[Tensor] = Future()
            done.set_result(bucket.buffer())  # this rank's own gradients: the fake "sum"
            return done

        dispatch.__annotations__ = {"state": Any, "bucket": GradBucket, "return": Future[Tensor]}
        register(self, None, dispatch)

    def fake_register(self: DistributedDataParallel, state: object, hook: Any) -> None:
        if self in hooks:
            raise RuntimeError("register_comm_hook can only be called once (as with DDP)")
        hooks[self] = (state, hook)

    DistributedDataParallel.__init__ = fake_init  # type: ignore[method-assign]
    DistributedDataParallel.register_comm_hook = fake_register  # type: ignore[method-assign]
    try:
        yield dist.group.WORLD  # type: ignore[misc]
    finally:
        DistributedDataParallel.__init__ = init  # type: ignore[method-assign]
        DistributedDataParallel.register_comm_hook = register  # type: ignore[method-assign]
        dist.destroy_process_group()
