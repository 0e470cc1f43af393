"""Collectives: the only module of zero_functional that talks to ``torch.distributed``.

Everything here is issued from the calling thread in an order that depends only on values every
rank shares (the partition, the bucket layout), never on timing. That is the rule that keeps gloo
from hanging: gloo matches collectives across ranks by the order they are issued.
"""

from __future__ import annotations

import ctypes
import io
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "PendingBroadcast",
    "ProcessGroup",
    "Work",
    "all_agree",
    "broadcast_shards",
    "collective_device",
    "default_group",
    "exchange_objects",
    "gather_objects",
    "global_rank",
    "group_rank",
    "group_size",
    "recv_object",
    "reduce_shards",
    "send_object",
    "COALESCE_BELOW",
    "start_sync_params",
    "sync_params",
    "unflatten_into",
]

ProcessGroup = dist.ProcessGroup


class Work(Protocol):
    """The handle an asynchronous collective returns."""

    def wait(self) -> bool: ...


def default_group(group: ProcessGroup | None) -> ProcessGroup:
    """``group``, or the default (world) group when it is ``None``."""
    if group is not None:
        return group
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call "
            "torch.distributed.init_process_group(...) before building a ZeroRedundancyOptimizer"
        )
    world = dist.group.WORLD
    assert world is not None
    return world


def group_size(group: ProcessGroup) -> int:
    """Number of ranks in ``group``."""
    return int(dist.get_world_size(group))


def group_rank(group: ProcessGroup) -> int:
    """This process's rank within ``group``."""
    return int(dist.get_rank(group))


def global_rank(group: ProcessGroup, rank: int) -> int:
    """The global rank of ``rank`` of ``group`` (collectives take global ranks as sources)."""
    return int(dist.get_global_rank(group, rank))


def collective_device(group: ProcessGroup, fallback: torch.device) -> torch.device:
    """The device that object messages travel on: CUDA for NCCL, else the CPU.

    NCCL moves only device tensors; gloo moves CPU tensors fastest.
    """
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        if fallback.type == "cuda":
            return fallback
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_agree(values: Sequence[int], group: ProcessGroup, device: torch.device) -> bool:
    """Whether every rank passed the same ``values`` (one small all-reduce).

    The tensor holds ``values`` and their negations, reduced with MAX: equality on every rank
    means every rank's values were the same. All ranks get the same answer, so all can raise.
    """
    local = torch.tensor([*values, *(-v for v in values)], dtype=torch.int64, device=device)
    reduced = local.clone()
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
    n = len(values)
    return bool(torch.equal(reduced[:n], -reduced[n:]))


def broadcast_shards(
    buffers: Sequence[Tensor], sources: Sequence[int], group: ProcessGroup
) -> list[Work]:
    """Start one broadcast per buffer, from the group rank in ``sources``; return the handles.

    The buffers are issued in list order, which every rank must share.
    """
    return _issue_rooted(dist.broadcast, buffers, sources, group)


def reduce_shards(
    buffers: Sequence[Tensor], destinations: Sequence[int], group: ProcessGroup
) -> list[Work]:
    """Start one sum-reduce per buffer, onto the group rank in ``destinations``; return the handles.

    Only the destination's buffer holds the sum afterwards (elsewhere it is undefined). One
    reduce per owner of a contiguous piece is the uneven reduce-scatter (NCCL runs its uneven
    reduce-scatter as exactly these reduces, grouped), with half the bytes of an all-reduce.
    The buffers are issued in list order, which every rank must share.

    Example (one rank, so the sum is the value itself):
        >>> import tempfile, torch.distributed as dist
        >>> dist.init_process_group(
        ...     "gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
        >>> t = torch.arange(4.0)
        >>> [w.wait() for w in reduce_shards([t[:2], t[2:]], [0, 0], dist.group.WORLD)]
        [True, True]
        >>> t
        tensor([0., 1., 2., 3.])
        >>> dist.destroy_process_group()
    """
    return _issue_rooted(dist.reduce, buffers, destinations, group)


def _issue_rooted(
    op: Callable[..., Work | None],
    buffers: Sequence[Tensor],
    roots: Sequence[int],
    group: ProcessGroup,
) -> list[Work]:
    """Start ``op(buffer, root, group=..., async_op=True)`` per buffer, in list order."""
    handles: list[Work] = []
    for buffer, root in zip(buffers, roots, strict=True):
        work = op(buffer, global_rank(group, root), group=group, async_op=True)
        assert work is not None
        handles.append(work)
    return handles


def unflatten_into(buffer: Tensor, tensors: Sequence[Tensor]) -> None:
    """Copy consecutive pieces of the 1-D ``buffer`` into ``tensors`` (in place)."""
    if not tensors:
        return
    pieces = torch.split(buffer, [t.numel() for t in tensors])
    torch._foreach_copy_(list(tensors), [p.view_as(t) for p, t in zip(pieces, tensors)])


COALESCE_BELOW = 1 << 16
"""Tensors with fewer elements than this travel in one staging buffer per owner and dtype;
larger contiguous ones are broadcast in place (no copies; gloo runs them concurrently)."""


class PendingBroadcast:
    """Broadcasts in flight (from :func:`start_sync_params`); :meth:`wait` finishes them."""

    def __init__(self, works: list[Work], receivers: list[tuple[Tensor, list[Tensor]]]) -> None:
        self.works = works
        self.receivers = receivers

    def wait(self) -> None:
        """Wait for every broadcast and copy the packed ones into their tensors."""
        for work in self.works:
            work.wait()
        with torch.no_grad():
            for buffer, tensors in self.receivers:
                unflatten_into(buffer, tensors)
        self.works, self.receivers = [], []


def start_sync_params(
    params: Sequence[Tensor],
    owners: Sequence[int],
    group: ProcessGroup,
    *,
    coalesce_below: int = COALESCE_BELOW,
) -> PendingBroadcast:
    """Start the broadcasts of :func:`sync_params`; the tensors are final after ``wait()``.

    Large contiguous tensors travel in place; smaller ones in one staging buffer per
    (owner rank, device, dtype), issued after the large ones in a deterministic order.

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
    if len(params) != len(owners):
        raise ValueError(f"got {len(params)} tensors but {len(owners)} owners; pass one per tensor")
    me = group_rank(group)
    keys: dict[tuple[int, str, str], list[Tensor]] = {}
    buffers: list[Tensor] = []
    sources: list[int] = []
    for t, owner in zip(params, owners):
        if t.numel() >= coalesce_below and t.is_contiguous():
            buffers.append(t.detach())
            sources.append(owner)
        else:
            keys.setdefault((owner, str(t.device), str(t.dtype)), []).append(t)
    receivers: list[tuple[Tensor, list[Tensor]]] = []
    for (owner, _, _), tensors in sorted(keys.items(), key=lambda kv: kv[0]):
        if owner == me:
            buffer = torch.cat([t.detach().reshape(-1) for t in tensors])
        else:
            buffer = torch.empty(
                sum(t.numel() for t in tensors), device=tensors[0].device, dtype=tensors[0].dtype
            )
            receivers.append((buffer, tensors))
        buffers.append(buffer)
        sources.append(owner)
    return PendingBroadcast(broadcast_shards(buffers, sources, group), receivers)


def sync_params(
    params: Sequence[Tensor],
    owners: Sequence[int],
    group: ProcessGroup | None = None,
    *,
    coalesce_below: int = COALESCE_BELOW,
) -> None:
    """Make every rank hold the owner's value of each parameter, in place.

    This is the synchronisation a functional ZeRO step needs after each rank updated the
    parameters it owns. Large tensors are broadcast in place; small ones are packed into one
    buffer per (owner rank, device, dtype), so a model of many small tensors costs few
    collectives and a model of large ones costs no copies.

    Args:
        params: The same list of tensors on every rank (model order).
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


def _to_bytes(obj: object) -> Tensor:
    stream = io.BytesIO()
    torch.save(obj, stream)
    return torch.frombuffer(bytearray(stream.getbuffer()), dtype=torch.uint8)


def _from_bytes(data: Tensor) -> object:
    cpu = data.cpu().contiguous()
    # A straight memory copy: no numpy (torch's consolidation calls tensor.numpy() and fails
    # without it), and not bytes(untyped_storage), which walks the bytes in Python.
    raw = ctypes.string_at(cpu.data_ptr(), cpu.numel()) if cpu.numel() else b""
    return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=False)


def gather_objects(
    obj: Mapping[str, object], to: int, group: ProcessGroup, device: torch.device
) -> list[object] | None:
    """Collect one picklable object from every rank on group rank ``to``, in rank order.

    Point-to-point, one rank at a time: ``to`` holds at most one other rank's serialized shard
    in ``device`` memory at once, and moves it to the CPU before receiving the next (torch's
    consolidation broadcasts every shard to every rank: pytorch#68181). Returns the list on
    ``to`` and ``None`` elsewhere.
    """
    me = group_rank(group)
    world = group_size(group)
    if not 0 <= to < world:
        raise ValueError(f"to={to} is not a rank of this group (size {world})")
    if me != to:
        send_object(obj, to, group, device)
        return None
    return [obj if src == me else recv_object(src, group, device) for src in range(world)]


def send_object(obj: object, dst: int, group: ProcessGroup, device: torch.device) -> None:
    """Send one picklable object to group rank ``dst`` (pairs with :func:`recv_object`)."""
    payload = _to_bytes(obj)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    dist.send(size, dst=global_rank(group, dst), group=group)
    dist.send(payload.to(device), dst=global_rank(group, dst), group=group)


def recv_object(src: int, group: ProcessGroup, device: torch.device) -> object:
    """Receive one object sent by :func:`send_object` from group rank ``src``, on the CPU."""
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size, src=global_rank(group, src), group=group)
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(data, src=global_rank(group, src), group=group)
    cpu = data.cpu()
    del data
    return _from_bytes(cpu)


def exchange_objects(
    outgoing: Mapping[int, object],
    pairs: Sequence[tuple[int, int]],
    group: ProcessGroup,
    device: torch.device,
) -> dict[int, object]:
    """Move objects along ``(src, dst)`` pairs that every rank lists in the same order.

    Each rank sends ``outgoing[dst]`` for its pairs as source and returns what it received,
    keyed by source. Walking one shared total order of pairs cannot deadlock: the earliest
    unfinished pair always has both its ranks waiting on it.
    """
    me = group_rank(group)
    received: dict[int, object] = {}
    for src, dst in pairs:
        if src == dst:
            continue
        if me == src:
            send_object(outgoing.get(dst, {}), dst, group, device)
        elif me == dst:
            received[src] = recv_object(src, group, device)
    return received
