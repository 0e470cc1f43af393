"""Simulated worlds: one process acts as one rank of a world of any size (torch's fake group).

:func:`fake_world` starts torch's fake process group (backend ``"fake"``, the one torch's own
FSDP tests use at scale): every collective returns at once with this rank's own data, so
construction, ownership, memory and messages can be checked at 1,024 or 4,096 ranks in one
process, in milliseconds. Values that depend on other ranks' data are not meaningful: a step
runs and changes the pieces this rank owns, but nothing is really summed, and the pieces other
ranks own receive whatever their receive buffers held (nothing is sent).

What cannot run under it: object collectives (``consolidate_state_dict``, ``add_param_group``
and the constructor's agreement check gather pickled objects: under the fake group each
receives this rank's bytes only, so they work but check nothing across ranks), and the first
backward of overlap mode with DDP's ``allreduce_hook`` (the hook reads the all-reduce's result,
which the fake group does not give: DDP's own all-reduce is replaced here by "this rank's
gradients", the hook's is not).
"""

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

__all__ = ["fake_world"]


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[dist.ProcessGroup]:
    """Be rank ``rank`` of a simulated world of ``world_size`` ranks for the block.

    Starts torch's fake process group as the default group and ends it on exit. While it is on,
    a ``DistributedDataParallel`` built inside the block reduces each gradient bucket to this
    rank's own values (DDP's built-in all-reduce would hand its hooks no tensor under the fake
    group); a hook registered with ``register_comm_hook`` runs instead, as usual.

    Raises:
        RuntimeError: A process group is already running in this process.
        ValueError: ``world_size`` is not an int >= 1, or ``rank`` is not one of its ranks.

    Example:
        >>> import torch
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

        dispatch.__annotations__ = {
            "state": Any,
            "bucket": GradBucket,
            "return": Future[Tensor],
        }
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
