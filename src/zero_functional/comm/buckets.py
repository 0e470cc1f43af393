"""Bulk collectives: gradients reduced onto their owners, parameters gathered from theirs."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from zero_functional.comm.groups import (
    ProcessGroup,
    Work,
    default_group,
    group_rank,
    group_size,
    is_nccl,
)
from zero_functional.comm.pending import Pending, hold, issue, start_one


def _reduce_scatter_single(output: Tensor, input: Tensor, **kw: object) -> Work | None:
    # looked up per call (torch < 2.13 has only the older name; tools may wrap either)
    op = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return op(output, input, **kw)  # type: ignore[no-any-return]


def _all_gather_single(output: Tensor, input: Tensor, **kw: object) -> Work | None:
    op = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return op(output, input, **kw)  # type: ignore[no-any-return]


def padded(buffer: Tensor, size: int) -> Tensor:
    if buffer.numel() == size:
        return buffer
    out = torch.zeros(size, dtype=buffer.dtype, device=buffer.device)
    out[: buffer.numel()].copy_(buffer)
    return out


def start_reduce(
    buffer: Tensor,
    runs: Sequence[tuple[int, int, int]],
    group: ProcessGroup,
    *,
    chunk: int | None = None,
) -> Pending:
    """Start the reduce-scatter of a 1-D ``buffer``: each run summed onto its rank.

    ``runs`` are ``(start, stop, rank)`` stretches covering the buffer
    (:meth:`~zero_functional.ownership.Ownership.runs`). With ``chunk`` (the runs are the even split ``[r * chunk, (r + 1) * chunk)``), one
    ``reduce_scatter_single`` over the buffer padded to ``chunk * world_size``; otherwise one
    reduce per run (grouped on NCCL). Afterwards each rank's runs hold the sums; other elements
    are undefined.

    Example:
        >>> import tempfile, torch.distributed as dist
        >>> dist.init_process_group(
        ...     "gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
        >>> t = torch.arange(3.0)
        >>> start_reduce(t, [(0, 3, 0)], dist.group.WORLD, chunk=3).wait()
        >>> t
        tensor([0., 1., 2.])
        >>> dist.destroy_process_group()
    """
    if chunk is None:
        return issue("reduce", [(buffer[a:b], rank) for a, b, rank in runs], group)
    world, me = group_size(group), group_rank(group)
    source = padded(buffer, chunk * world)
    out = torch.empty(chunk, dtype=buffer.dtype, device=buffer.device)
    lo, hi = min(me * chunk, buffer.numel()), min((me + 1) * chunk, buffer.numel())

    def copy_back() -> None:
        buffer[lo:hi].copy_(out[: hi - lo])

    return start_one(
        lambda: _reduce_scatter_single(out, source, group=group, async_op=True),
        [out] if source is buffer else [out, source],
        group,
        [copy_back],
    )


def start_broadcast(
    buffer: Tensor,
    runs: Sequence[tuple[int, int, int]],
    group: ProcessGroup,
    *,
    chunk: int | None = None,
) -> Pending:
    """Start the all-gather of a 1-D ``buffer``: every rank gets each run from its rank.

    ``runs`` are ``(start, stop, rank)`` stretches covering the buffer. With ``chunk`` (even
    runs), one ``all_gather_single`` (in place when the buffer is padded to
    ``chunk * world_size``); otherwise one broadcast per run (grouped on NCCL).

    Example:
        >>> import tempfile, torch.distributed as dist
        >>> dist.init_process_group(
        ...     "gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
        >>> t = torch.arange(3.0)
        >>> start_broadcast(t, [(0, 3, 0)], dist.group.WORLD).wait()
        >>> t
        tensor([0., 1., 2.])
        >>> dist.destroy_process_group()
    """
    if chunk is None:
        return issue("broadcast", [(buffer[a:b], rank) for a, b, rank in runs], group)
    world, me = group_size(group), group_rank(group)
    target = padded(buffer, chunk * world)
    mine = target[me * chunk : (me + 1) * chunk]

    def copy_back() -> None:
        buffer.copy_(target[: buffer.numel()])

    if target is buffer:
        return start_one(
            lambda: _all_gather_single(target, mine, group=group, async_op=True), [mine], group
        )
    return start_one(
        lambda: _all_gather_single(target, mine, group=group, async_op=True),
        [target, mine],
        group,
        [copy_back],
    )


def start_all_reduce(buffer: Tensor, group: ProcessGroup) -> Pending:
    """Start summing ``buffer`` over the group, in place (DDP's all-reduce of a bucket).

    Example:
        >>> import tempfile, torch.distributed as dist
        >>> dist.init_process_group(
        ...     "gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
        >>> t = torch.ones(2)
        >>> start_all_reduce(t, dist.group.WORLD).wait()
        >>> t
        tensor([1., 1.])
        >>> dist.destroy_process_group()
    """
    return start_one(lambda: dist.all_reduce(buffer, group=group, async_op=True), [], group)


def start_all_reduce_spans(
    buffer: Tensor, spans: Sequence[tuple[int, int]], group: ProcessGroup
) -> Pending:
    """Start summing each ``(start, stop)`` stretch of ``buffer`` over the group, in place, in
    list order (one coalesced launch on NCCL): a shard's pieces across its replicas.

    Example:
        >>> import tempfile, torch.distributed as dist
        >>> dist.init_process_group(
        ...     "gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
        >>> t = torch.arange(4.0)
        >>> start_all_reduce_spans(t, [(1, 3)], dist.group.WORLD).wait()
        >>> t
        tensor([0., 1., 2., 3.])
        >>> dist.destroy_process_group()
    """
    pieces = [buffer[a:b] for a, b in spans if b > a]
    held = hold(pieces, group)  # views made here: kept until the backend lets go (issue 20)
    if len(pieces) > 1 and is_nccl(group):
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


COALESCE_BELOW = 1 << 16
"""Tensors with fewer elements than this travel in one staging buffer per owner and dtype;
larger contiguous ones are broadcast in place (no copies; gloo runs them concurrently)."""


def start_sync_params(
    params: Sequence[Tensor],
    owners: Sequence[int],
    group: ProcessGroup,
    *,
    coalesce_below: int = COALESCE_BELOW,
) -> Pending:
    """Start the broadcasts of :func:`sync_params`; the tensors are final after ``wait()``.

    Large contiguous tensors travel in place; smaller ones in one staging buffer per
    (owner rank, device, dtype), issued after the large ones in a deterministic order. The
    tensors may be pieces of parameters (:func:`~zero_functional.ownership.piece_view`).

    Example:
        >>> import tempfile, torch.distributed as dist
        >>> dist.init_process_group(
        ...     "gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
        >>> ps = [torch.zeros(2), torch.ones(3)]
        >>> pending = start_sync_params(ps, [0, 0], dist.group.WORLD)
        >>> pending.wait()
        >>> ps[1]
        tensor([1., 1., 1.])
        >>> dist.destroy_process_group()
    """
    units = [
        unit for unit, _ in start_sync_units(params, owners, group, coalesce_below=coalesce_below)
    ]
    return Pending(
        [w for unit in units for w in unit.works],
        [f for unit in units for f in unit.finish],
        [h for unit in units for h in unit.held],
    )


def start_sync_units(
    params: Sequence[Tensor],
    owners: Sequence[int],
    group: ProcessGroup,
    *,
    coalesce_below: int = COALESCE_BELOW,
    before: Callable[[list[int]], None] | None = None,
) -> list[tuple[Pending, list[int]]]:
    """:func:`start_sync_params` as separate units: each pending broadcast with the indices of
    the tensors that are final once it is waited for (a large tensor, or one packed group).

    What lets a reader wait for just the tensors it needs (a module's forward, for the
    parameter all-gather that overlaps the next forward). On NCCL, where the broadcasts go out
    as one coalesced launch, there is one unit covering every tensor.

    Args:
        params: The tensors, the same list on every rank.
        owners: Each tensor's group rank.
        group: The process group.
        coalesce_below: Size under which tensors are packed rather than sent alone.
        before: Called with the indices of each unit this rank owns just before that unit is
            issued (its tensors are read then): what lets the owner compute a unit's values
            while the units issued before it are on the wire (the step's update, pipelined).

    Example:
        >>> import tempfile, torch.distributed as dist
        >>> dist.init_process_group(
        ...     "gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
        >>> units = start_sync_units([torch.zeros(2), torch.ones(3)], [0, 0], dist.group.WORLD)
        >>> [covered for _, covered in units]
        [[0, 1]]
        >>> dist.destroy_process_group()
    """
    if len(params) != len(owners):
        raise ValueError(f"got {len(params)} tensors but {len(owners)} owners; pass one per tensor")
    me = group_rank(group)
    plan: list[tuple[int, list[int]]] = []  # (owner, indices) in issue order
    packed: dict[tuple[int, str, str], list[int]] = {}
    for i, (t, owner) in enumerate(zip(params, owners)):
        if t.numel() >= coalesce_below and t.is_contiguous():
            plan.append((owner, [i]))
        elif t.numel():
            packed.setdefault((owner, str(t.device), str(t.dtype)), []).append(i)
    plan += [(key[0], indices) for key, indices in sorted(packed.items(), key=lambda kv: kv[0])]

    def unit(owner: int, indices: list[int]) -> tuple[Tensor, Callable[[], None] | None]:
        tensors = [params[i] for i in indices]
        if len(indices) == 1 and tensors[0].numel() >= coalesce_below:
            if tensors[0].is_contiguous():
                return tensors[0].detach(), None  # in place
        if owner == me:
            return torch.cat([t.detach().reshape(-1) for t in tensors]), None
        numel = sum(t.numel() for t in tensors)
        buffer = torch.empty(numel, device=tensors[0].device, dtype=tensors[0].dtype)
        return buffer, functools.partial(unflatten_into, buffer, tensors)

    if is_nccl(group) and len(plan) > 1:  # one coalesced launch: one unit
        if before is not None:
            for owner, indices in plan:
                if owner == me:
                    before(indices)
        built = [(unit(owner, indices), owner) for owner, indices in plan]
        done = [f for (_, f), _ in built if f is not None]
        calls = [(buffer, owner) for (buffer, _), owner in built]
        return [(issue("broadcast", calls, group, done), sorted(i for _, c in plan for i in c))]
    out: list[tuple[Pending, list[int]]] = []
    for owner, indices in plan:
        if before is not None and owner == me:
            before(indices)
        buffer, finish = unit(owner, indices)
        pending = issue("broadcast", [(buffer, owner)], group, [finish] if finish else None)
        out.append((pending, indices))
    return out


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
        >>> import tempfile, torch.distributed as dist
        >>> dist.init_process_group(
        ...     "gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
        >>> ps = [torch.full((2,), 3.0)]
        >>> sync_params(ps, [0])
        >>> ps[0]
        tensor([3., 3.])
        >>> sync_params(ps, [0, 1])
        Traceback (most recent call last):
        ...
        ValueError: got 1 tensors but 2 owners; pass one per tensor
        >>> dist.destroy_process_group()
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
        >>> import tempfile, torch.distributed as dist
        >>> dist.init_process_group(
        ...     "gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
        >>> gs = [torch.ones(3)]
        >>> reduce_to_owners(gs, [0])
        >>> gs[0]
        tensor([1., 1., 1.])
        >>> dist.destroy_process_group()
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
    calls = [(t, r) for t, r in zip(tensors, owners) if t.numel()]
    issue("reduce", calls, group).wait()
