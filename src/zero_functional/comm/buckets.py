"""Buckets: collectives over lists of tensors (all-reduces, the pieces' all-gather by units)
and the functional step's :func:`reduce_to_owners` and :func:`sync_params`."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from zero_functional.comm.collectives import start_reduce
from zero_functional.comm.groups import ProcessGroup, default_group, group_rank, group_size, is_nccl
from zero_functional.comm.pending import Pending, issue, start_one
from zero_functional.core.param_table import buffer_key
from zero_functional.core.plans import COALESCE_BELOW, sync_plan


def start_all_reduce(buffer: Tensor, group: ProcessGroup) -> Pending:
    """Start summing ``buffer`` over the group, in place (DDP's all-reduce of a bucket).

    Example:
        >>> start_all_reduce(torch.ones(2), group).wait()
    """
    return start_one(lambda: dist.all_reduce(buffer, group=group, async_op=True), [], group)


def start_all_reduce_spans(
    buffer: Tensor, spans: Sequence[tuple[int, int]], group: ProcessGroup, *, grouped: bool = False
) -> Pending:
    """Start summing each ``(start, stop)`` stretch of ``buffer`` over the group, in place.

    Example:
        >>> start_all_reduce_spans(torch.arange(4.0), [(1, 3)], group).wait()
    """
    pieces = [(buffer[a:b], None) for a, b in spans if b > a]
    return issue("all_reduce", pieces, group, grouped=grouped)


def unflatten_into(buffer: Tensor, tensors: Sequence[Tensor]) -> None:
    """Copy consecutive pieces of the 1-D ``buffer`` into ``tensors``.

    Example:
        >>> a, b = torch.zeros(1), torch.zeros(2)
        >>> unflatten_into(torch.arange(3.0), [a, b]); b
        tensor([1., 2.])
    """
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
    """Start one broadcast per ``(tensors, owner, packed)`` unit of a sync plan, in order.

    Example:
        >>> start_gather_units([([torch.zeros(2), torch.ones(3)], 0, True)], group).wait()
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

    Example:
        >>> start_sync_params([torch.zeros(2), torch.ones(3)], [0, 0], group).wait()
    """
    plan = sync_plan(
        owners,
        [t.numel() for t in params],
        [buffer_key(t) for t in params],
        [t.is_contiguous() for t in params],
        nccl=is_nccl(group),
        coalesce_below=coalesce_below,
    )
    # in issue order either way: the plan's batches are one coalesced launch or one call each
    units = [([params[i] for i in u.members], u.owner, u.packed) for u in plan.units]
    return start_gather_units(units, group, grouped=plan.coalesced)


def sync_params(
    params: Sequence[Tensor],
    owners: Sequence[int],
    group: ProcessGroup | None = None,
    *,
    coalesce_below: int = COALESCE_BELOW,
) -> None:
    """Make every rank hold the owner's value of each tensor, in place: a functional ZeRO step's
    all-gather; pieces too: ``sync_params(*piece_views(ps, ownership))``.

    Example:
        >>> sync_params([torch.full((2,), 3.0)], [0, 1])
        Traceback (most recent call last):
        ...
        ValueError: got 1 tensors but 2 owners; pass one per tensor
    """
    start_sync_params(params, owners, default_group(group), coalesce_below=coalesce_below).wait()


def reduce_to_owners(
    tensors: Sequence[Tensor], owners: Sequence[int], group: ProcessGroup | None = None
) -> None:
    """Average tensors onto their owners, in place: a functional step's reduce-scatter half.

    Example:
        >>> gs = [torch.ones(3)]
        >>> reduce_to_owners(gs, [0]); gs[0]
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
