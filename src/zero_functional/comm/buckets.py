"""Collectives over lists of tensors: a bucket's all-reduce, the pieces' all-gather by units,
and the functional step's :func:`reduce_to_owners` and :func:`sync_params`.

What to send is decided in :mod:`zero_functional.core.plans` (the units of a parameter
all-gather) and how in :mod:`~zero_functional.comm.collectives`; these functions execute it.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from zero_functional.comm.collectives import Wire, start_reduce
from zero_functional.comm.groups import ProcessGroup, Work, default_group, group_rank, group_size
from zero_functional.comm.pending import Pending, hold, issue, start_one
from zero_functional.core.param_table import buffer_key
from zero_functional.core.plans import COALESCE_BELOW, sync_plan


def start_all_reduce(buffer: Tensor, group: ProcessGroup) -> Pending:
    """Start summing ``buffer`` over the group, in place (DDP's all-reduce of a bucket).

    Example:
        >>> import torch.distributed as dist
        >>> t = torch.ones(2)
        >>> start_all_reduce(t, group).wait()
        >>> t
        tensor([1., 1.])
    """
    return start_one(lambda: dist.all_reduce(buffer, group=group, async_op=True), [], group)


def start_all_reduce_spans(
    buffer: Tensor, spans: Sequence[tuple[int, int]], group: ProcessGroup, *, grouped: bool = False
) -> Pending:
    """Start summing each ``(start, stop)`` stretch of ``buffer`` over the group, in place, in
    list order (one coalesced launch where ``grouped``: NCCL): a shard's pieces across its
    replicas.

    Example:
        >>> import torch.distributed as dist
        >>> t = torch.arange(4.0)
        >>> start_all_reduce_spans(t, [(1, 3)], group).wait()
        >>> t
        tensor([0., 1., 2., 3.])
    """
    pieces = [buffer[a:b] for a, b in spans if b > a]
    held = hold(pieces, group)  # views made here: kept until the backend lets go (issue 20)
    if len(pieces) > 1 and grouped:
        coalescing = dist.distributed_c10d._coalescing_manager
        with coalescing(group, buffer.device, async_ops=True) as cm:
            for t in pieces:
                dist.all_reduce(t, group=group, async_op=True)
        return Pending(list(cm.works), held=held)
    works: list[Work] = []
    for t in pieces:
        work = dist.all_reduce(t, group=group, async_op=True)
        assert work is not None
        works.append(work)
    return Pending(works, held=held)


def unflatten_into(buffer: Tensor, tensors: Sequence[Tensor]) -> None:
    """Copy consecutive pieces of the 1-D ``buffer`` into ``tensors`` (in place)."""
    if not tensors:
        return
    pieces = torch.split(buffer, [t.numel() for t in tensors])
    torch._foreach_copy_(list(tensors), [p.view_as(t) for p, t in zip(pieces, tensors)])


def start_gather_units(
    units: Sequence[tuple[Sequence[Tensor], int, bool]],
    group: ProcessGroup,
    *,
    grouped: bool = False,
) -> Pending:
    """Start one broadcast per unit ``(tensors, owner, packed)``, in list order (one coalesced
    launch where ``grouped``: NCCL): a unit's one tensor in place, or its tensors ``packed`` through one staging
    buffer (copied out on arrival). The units come from a plan
    (:func:`~zero_functional.core.plans.sync_plan`); the tensors are final after ``wait()``.

    Example:
        >>> import torch.distributed as dist
        >>> ps = [torch.zeros(2), torch.ones(3)]
        >>> start_gather_units([(ps, 0, True)], group).wait()
        >>> ps[1]
        tensor([1., 1., 1.])
    """
    me = group_rank(group)
    calls: list[tuple[Tensor, int]] = []
    finish: list[Callable[[], None]] = []
    for tensors, owner, packed in units:
        if not packed:
            (tensor,) = tensors
            calls.append((tensor.detach(), owner))  # in place
        elif owner == me:
            calls.append((torch.cat([t.detach().reshape(-1) for t in tensors]), owner))
        else:
            numel = sum(t.numel() for t in tensors)
            buffer = torch.empty(numel, device=tensors[0].device, dtype=tensors[0].dtype)
            calls.append((buffer, owner))
            finish.append(functools.partial(unflatten_into, buffer, tensors))
    return issue("broadcast", calls, group, finish, grouped=grouped)


def start_sync_params(
    params: Sequence[Tensor],
    owners: Sequence[int],
    group: ProcessGroup,
    *,
    coalesce_below: int = COALESCE_BELOW,
) -> Pending:
    """Start the broadcasts of :func:`sync_params`; the tensors are final after ``wait()``.

    Large contiguous tensors travel in place; smaller ones in one staging buffer per
    (owner rank, device, dtype), issued after the large ones in a deterministic order
    (:func:`~zero_functional.core.plans.sync_plan`). The tensors may be pieces of parameters
    (:func:`~zero_functional.core.ownership.piece_view`).

    Example:
        >>> import torch.distributed as dist
        >>> ps = [torch.zeros(2), torch.ones(3)]
        >>> pending = start_sync_params(ps, [0, 0], group)
        >>> pending.wait()
        >>> ps[1]
        tensor([1., 1., 1.])
    """
    grouped = Wire(group, threaded=False).grouped
    plan = sync_plan(
        owners,
        [t.numel() for t in params],
        [buffer_key(t) for t in params],
        [t.is_contiguous() for t in params],
        nccl=grouped,
        coalesce_below=coalesce_below,
    )
    batches = [
        start_gather_units(
            [([params[i] for i in u.members], u.owner, u.packed) for u in b], group, grouped=grouped
        )
        for b in plan.batches()
    ]
    return Pending(
        [w for p in batches for w in p.works],
        [f for p in batches for f in p.finish],
        [h for p in batches for h in p.held],
    )


def sync_params(
    params: Sequence[Tensor],
    owners: Sequence[int],
    group: ProcessGroup | None = None,
    *,
    coalesce_below: int = COALESCE_BELOW,
) -> None:
    """Make every rank hold the owner's value of each tensor, in place.

    This is the synchronisation a functional ZeRO step needs after each rank updated what it
    owns: the all-gather half of ZeRO's traffic. Large tensors are broadcast in place; small
    ones are packed into one buffer per (owner rank, device, dtype), so a model of many small
    tensors costs few collectives and a model of large ones costs no copies. For parameters
    that straddle ranks, pass their pieces: ``sync_params(*piece_views(params, ownership))``.

    Args:
        params: The same list of tensors on every rank (model order), or pieces of them.
        owners: For each tensor, the group rank that holds its up-to-date value.
        group: The process group (default: the world).
        coalesce_below: Size under which tensors are packed rather than sent alone.

    Example:
        >>> import torch.distributed as dist
        >>> ps = [torch.full((2,), 3.0)]
        >>> sync_params(ps, [0])
        >>> ps[0]
        tensor([3., 3.])
        >>> sync_params(ps, [0, 1])
        Traceback (most recent call last):
        ...
        ValueError: got 1 tensors but 2 owners; pass one per tensor
    """
    group = default_group(group)
    start_sync_params(params, owners, group, coalesce_below=coalesce_below).wait()


def reduce_to_owners(
    tensors: Sequence[Tensor], owners: Sequence[int], group: ProcessGroup | None = None
) -> None:
    """Average tensors onto their owners, in place: the reduce-scatter of a functional step.

    Each tensor is divided by the world size and summed onto its owner (DDP's averaging, with
    half an all-reduce's bytes); afterwards the owner holds the average and other ranks'
    copies are undefined. For gradients of parameters that straddle ranks, pass their pieces:
    ``reduce_to_owners(*piece_views(grads, ownership))``; follow the update with
    :func:`sync_params` over the same pieces: together they send what one all-reduce sends.

    Example:
        >>> import torch.distributed as dist
        >>> gs = [torch.ones(3)]
        >>> reduce_to_owners(gs, [0])
        >>> gs[0]
        tensor([1., 1., 1.])
    """
    if len(tensors) != len(owners):
        raise ValueError(
            f"got {len(tensors)} tensors but {len(owners)} owners; pass one per tensor"
        )
    group = default_group(group)
    world = group_size(group)
    with torch.no_grad():
        for t in tensors:
            t.div_(world)
    # one reduce per (device, dtype), over the tensors laid end to end
    groups: dict[object, list[tuple[Tensor, int]]] = {}
    for t, r in zip(tensors, owners):
        if t.numel():
            groups.setdefault(buffer_key(t), []).append((t, r))
    me = group_rank(group)
    for members in groups.values():
        flat = torch.cat([t.detach().reshape(-1) for t, _ in members])
        ends = list(itertools.accumulate(t.numel() for t, _ in members))
        runs = [(end - t.numel(), end, r) for end, (t, r) in zip(ends, members)]
        start_reduce(flat, runs, group).wait()
        with torch.no_grad():
            for (a, b, r), (t, _) in zip(runs, members):
                if r == me:
                    t.copy_(flat[a:b].view_as(t))
