"""Small messages: scalars and picklable objects, waited for as every collective here is."""

from __future__ import annotations

import copy
import ctypes
import functools
import io
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from zero_functional.comm.collectives import padded
from zero_functional.comm.groups import (
    ProcessGroup,
    collective_device,
    default_group,
    global_rank,
    group_rank,
    group_size,
)
from zero_functional.comm.pending import start_one


def broadcast_object(obj: object, group: ProcessGroup | None = None) -> object:
    """Group rank 0's picklable ``obj`` on every rank (``obj`` itself without a process group).

    Example:
        >>> broadcast_object({"step": 3}, group)
        {'step': 3}
    """
    if not dist.is_initialized():
        return obj
    group = default_group(group)
    device = collective_device(group, torch.device("cpu"))
    root, me = global_rank(group, 0), group_rank(group)
    data = to_bytes(obj).to(device) if me == 0 else torch.empty(0, dtype=torch.uint8)
    size = torch.tensor([data.numel()], device=device)
    start_one(lambda: dist.broadcast(size, root, group=group, async_op=True), [size], group).wait()
    if me != 0:  # room for what rank 0 sends
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    start_one(lambda: dist.broadcast(data, root, group=group, async_op=True), [data], group).wait()
    return obj if me == 0 else from_bytes(data)


def all_gather_objects(obj: object, group: ProcessGroup) -> list[object]:
    """Every rank's picklable ``obj``, in rank order, on every rank (small messages).

    Example:
        >>> all_gather_objects(("ok", 3), group)
        [('ok', 3)]
    """
    device = collective_device(group, torch.device("cpu"))
    payload = to_bytes(obj).to(device)
    sizes = [int(n) for n in all_gather_scalar(torch.tensor(payload.numel()), group).tolist()]
    longest = padded(payload, max(sizes))
    out = [torch.empty_like(longest) for _ in sizes]
    gather = functools.partial(dist.all_gather, out, longest, group=group, async_op=True)
    start_one(gather, [*out, longest], group).wait()
    decoded: dict[bytes, object] = {}  # equal payloads (agreements, a fake world) decoded once
    every = []
    for t, n in zip(out, sizes):
        raw = bytes_of(t[:n])
        if raw in decoded:
            every.append(copy.deepcopy(decoded[raw]))  # each rank's its own object, as unpickled
        else:
            every.append(decoded.setdefault(raw, _loads(raw)))
    return every


def all_reduce_scalar(value: Tensor, group: ProcessGroup, *, op: str = "sum") -> Tensor:
    """The sum (or max) of a small tensor over the group, elementwise, on every rank.

    Example:
        >>> all_reduce_scalar(torch.tensor(2.0), group, op="max")
        tensor(2.)
    """
    device = collective_device(group, value.device)
    t = value.detach().reshape(-1).to(device, copy=True)
    reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
    reduce = functools.partial(dist.all_reduce, t, op=reduce_op, group=group, async_op=True)
    start_one(reduce, [t], group).wait()
    return t.reshape(value.shape).to(value.device)


def any_rank(flags: Tensor, group: ProcessGroup) -> Tensor:
    """Elementwise "any rank's flag is set" of a bool vector, on every rank (one all-reduce).

    Example:
        >>> any_rank(torch.tensor([True, False]), group)
        tensor([ True, False])
    """
    return all_reduce_scalar(flags.to(torch.uint8), group, op="max").bool()


def all_gather_scalar(value: Tensor, group: ProcessGroup) -> Tensor:
    """Every rank's 0-d ``value``, stacked in rank order, on every rank (exact, unlike a sum).

    Example:
        >>> all_gather_scalar(torch.tensor(2.5), group)
        tensor([2.5000])
    """
    device = collective_device(group, value.device)
    local = value.detach().reshape(1).to(device, copy=True)
    out = [torch.empty_like(local) for _ in range(group_size(group))]
    gather = functools.partial(dist.all_gather, out, local, group=group, async_op=True)
    start_one(gather, [*out, local], group).wait()
    return torch.cat(out).to(value.device)


def to_bytes(obj: object) -> Tensor:
    stream = io.BytesIO()
    torch.save(obj, stream)
    return torch.frombuffer(bytearray(stream.getbuffer()), dtype=torch.uint8)


def from_bytes(data: Tensor) -> object:
    return _loads(bytes_of(data))


def bytes_of(data: Tensor) -> bytes:
    """A ``uint8`` tensor's bytes, copied once to the host.

    Example:
        >>> bytes_of(torch.tensor([104, 105], dtype=torch.uint8))
        b'hi'
    """
    cpu = data.cpu().contiguous()
    # A straight memory copy: no numpy (torch's consolidation calls tensor.numpy() and fails
    # without it), and not bytes(untyped_storage), which walks the bytes in Python.
    return ctypes.string_at(cpu.data_ptr(), cpu.numel()) if cpu.numel() else b""


def _loads(raw: bytes) -> object:
    return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=False)


def gather_objects(
    obj: Mapping[str, object], to: int, group: ProcessGroup, device: torch.device
) -> list[object] | None:
    """Every rank's picklable ``obj`` in rank order on group rank ``to`` (``None`` elsewhere), one
    rank at a time, each to the CPU on arrival (torch's broadcasts every shard: pytorch#68181)."""
    me, world = group_rank(group), group_size(group)
    if not 0 <= to < world:
        raise ValueError(f"to={to} is not a rank of this group (size {world})")
    if me != to:
        send_object(obj, to, group, device)
        return None
    return [obj if src == me else recv_object(src, group, device) for src in range(world)]


def send_object(obj: object, dst: int, group: ProcessGroup, device: torch.device) -> None:
    """Send one picklable object to group rank ``dst`` (pairs with :func:`recv_object`)."""
    to = global_rank(group, dst)
    payload = to_bytes(obj).to(device)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    start_one(lambda: dist.isend(size, dst=to, group=group), [size], group).wait()
    start_one(lambda: dist.isend(payload, dst=to, group=group), [payload], group).wait()


def recv_object(src: int, group: ProcessGroup, device: torch.device) -> object:
    """Receive one object sent by :func:`send_object` from group rank ``src``, on the CPU."""
    source = global_rank(group, src)
    size = torch.zeros(1, dtype=torch.int64, device=device)
    start_one(lambda: dist.irecv(size, src=source, group=group), [size], group).wait()
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    start_one(functools.partial(dist.irecv, data, src=source, group=group), [data], group).wait()
    cpu = data.cpu()
    del data
    return from_bytes(cpu)


def exchange_objects(
    outgoing: Mapping[int, object],
    pairs: Sequence[tuple[int, int]],
    group: ProcessGroup,
    device: torch.device,
) -> dict[int, object]:
    """Send ``outgoing[dst]`` along each ``(src, dst)`` pair this rank is the source of; what
    it received, by source. Every rank walks the same order of pairs, which cannot deadlock:
    the earliest unfinished pair has both its ranks waiting on it. The plain tensors of a
    message (optimizer state) travel as themselves, each received straight into the storage it
    keeps (no pickled copy on either side); the rest, one small pickled skeleton.

    Example:
        >>> exchange_objects({0: {"m": torch.ones(2)}}, [(0, 0)], group, torch.device("cpu"))
        {}
    """
    me = group_rank(group)
    received: dict[int, object] = {}
    for src, dst in pairs:
        if src == dst:
            continue
        if me == src:
            tensors: list[Tensor] = []
            send_object(_strip(outgoing.get(dst, {}), tensors), dst, group, device)
            to = global_rank(group, dst)
            for t in tensors:
                payload = t.detach().contiguous().to(device)
                send = functools.partial(dist.isend, payload, dst=to, group=group)
                start_one(send, [payload], group).wait()
        elif me == dst:
            take = functools.partial(
                _receive, src=global_rank(group, src), group=group, device=device
            )
            received[src] = _fill(recv_object(src, group, device), take)
    return received


def _receive(sent: _Sent, *, src: int, group: ProcessGroup, device: torch.device) -> Tensor:
    out = torch.empty(sent.shape, dtype=sent.dtype, device=device)
    start_one(lambda: dist.irecv(out, src=src, group=group), [out], group).wait()
    return out


class _Sent(NamedTuple):
    """A tensor's place in a message: its bytes follow the message, in this order."""

    dtype: torch.dtype
    shape: tuple[int, ...]


def _strip(obj: object, tensors: list[Tensor]) -> object:
    """``obj`` with each plain tensor of more than one element replaced by its :class:`_Sent`,
    appended to ``tensors`` (a subclass, such as quantized state, stays in the skeleton)."""
    if type(obj) is Tensor and obj.dim() > 0:
        tensors.append(obj)
        return _Sent(obj.dtype, tuple(obj.shape))
    if isinstance(obj, dict):
        return {k: _strip(v, tensors) for k, v in obj.items()}
    if isinstance(obj, tuple | list) and type(obj) in (tuple, list):
        return type(obj)(_strip(v, tensors) for v in obj)
    return obj


def _fill(obj: object, take: Callable[[_Sent], Tensor]) -> object:
    """The inverse of :func:`_strip`: each :class:`_Sent` replaced by ``take(it)``, in order."""
    if isinstance(obj, _Sent):
        return take(obj)
    if isinstance(obj, dict):
        return {k: _fill(v, take) for k, v in obj.items()}
    if isinstance(obj, tuple | list) and type(obj) in (tuple, list):
        return type(obj)(_fill(v, take) for v in obj)
    return obj
