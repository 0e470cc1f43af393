"""Collectives as objects: each buffer's reducer and gatherer, chosen once by :meth:`Wire.choose`,
the one place here that asks a backend: a new strategy is one class and one line there."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from zero_functional.comm.codec import Codec
from zero_functional.comm.exchange import Exchanger, start_exchange
from zero_functional.comm.groups import ProcessGroup, group_rank, group_size, is_nccl
from zero_functional.comm.pending import Pending, issue, start_one
from zero_functional.core.ownership import Run
from zero_functional.core.plans import BufferPlan, Collectives, Runs


class Reducer(Protocol):
    """Sums each run of a 1-D buffer onto its owner, in place (other elements undefined after)."""

    def start(self, buffer: Tensor) -> Pending: ...


class Gatherer(Protocol):
    """Gives every rank each run of a 1-D buffer from its owner, in place."""

    def start(self, buffer: Tensor) -> Pending: ...


@dataclass(frozen=True, slots=True)
class PerRun:
    """One ``op`` per run, onto or from its owner (one grouped launch where ``grouped``: NCCL)."""

    op: Literal["reduce", "broadcast"]
    runs: Runs
    group: ProcessGroup
    grouped: bool

    def start(self, buffer: Tensor) -> Pending:
        calls = [(buffer[a:b], rank) for a, b, rank in self.runs]
        return issue(self.op, calls, self.group, grouped=self.grouped)


def padded(buffer: Tensor, size: int) -> Tensor:
    """``buffer`` itself if it has ``size`` elements, else a zero-padded copy of that size."""
    if buffer.numel() == size:
        return buffer
    out = torch.zeros(size, dtype=buffer.dtype, device=buffer.device)
    out[: buffer.numel()].copy_(buffer)
    return out


@dataclass(frozen=True, slots=True)
class ReduceScatter:
    """Rank ``r`` gets the sum of ``[r * chunk, (r + 1) * chunk)``: a ``reduce_scatter_single``."""

    chunk: int
    group: ProcessGroup

    def start(self, buffer: Tensor) -> Pending:
        world, me, chunk = group_size(self.group), group_rank(self.group), self.chunk
        source = padded(buffer, chunk * world)
        out = torch.empty(chunk, dtype=buffer.dtype, device=buffer.device)
        lo, hi = min(me * chunk, buffer.numel()), min((me + 1) * chunk, buffer.numel())

        def copy_back() -> None:
            buffer[lo:hi].copy_(out[: hi - lo])

        # looked up per call (torch < 2.13 has only the older name; a byte counter may wrap either)
        op = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        scatter = functools.partial(op, out, source, group=self.group, async_op=True)
        made = [out] if source is buffer else [out, source]
        return start_one(scatter, made, self.group, [copy_back])


@dataclass(frozen=True, slots=True)
class AllGather:
    """Every rank gets each shard ``[r * chunk, (r + 1) * chunk)``: an ``all_gather_single``."""

    chunk: int
    group: ProcessGroup

    def start(self, buffer: Tensor) -> Pending:
        world, me, chunk = group_size(self.group), group_rank(self.group), self.chunk
        target = padded(buffer, chunk * world)
        mine = target[me * chunk : (me + 1) * chunk]

        def copy_back() -> None:
            buffer.copy_(target[: buffer.numel()])

        op = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # as above
        gather = functools.partial(op, target, mine, group=self.group, async_op=True)
        if target is buffer:
            return start_one(gather, [mine], self.group)
        return start_one(gather, [target, mine], self.group, [copy_back])


@dataclass(frozen=True, slots=True)
class Exchange:
    """The reduce onto owners as all-to-alls (:mod:`~zero_functional.comm.exchange`): gloo's, on
    the wire's exchanger thread where it has one, else on the caller's; encoded by the wire's
    codec where it has one (on any backend)."""

    runs: Runs
    wire: Wire

    def start(self, buffer: Tensor) -> Pending:
        wire = self.wire
        exchanger = wire.exchanger() if wire.exchanges(buffer.device) else None
        return start_exchange(buffer, self.runs, wire.group, exchanger, wire.codec)


class Wire:
    """The collectives of one process group, chosen once per buffer (:meth:`choose`).

    Args:
        gather_group: Parameters are gathered over it (default: ``group``; overlap mode's twin).
        threaded: On gloo, run the exchanges on a thread (made, with its twin group, at the first
            exchange: a collective every rank reaches there), or on ``exchanger``.
        codec: Gradients travel in this wire format (:mod:`~zero_functional.comm.codec`): every
            buffer is reduced by an encoded :class:`Exchange`.
        gather_codec: Parameters' changes travel in this format, not their values (the
            buffer syncs encode them; see ``BucketSync``).

    Example:
        >>> plan = BufferPlan("reduce+broadcast", ((0, 3, 0),), None)
        >>> wire = Wire(group, threaded=False)
        >>> [c.op for c in wire.choose(plan, torch.device("cpu"))]
        ['reduce', 'broadcast']
    """

    def __init__(
        self,
        group: ProcessGroup,
        gather_group: ProcessGroup | None = None,
        *,
        threaded: bool = True,
        exchanger: Exchanger | None = None,
        codec: Codec | None = None,
        gather_codec: Codec | None = None,
    ) -> None:
        self.group = group
        self.codec, self.gather_codec = codec, gather_codec
        self.gather_group = group if gather_group is None else gather_group
        self.grouped = is_nccl(group)  # NCCL takes grouped launches; its reduce is native
        self.threaded = threaded
        self.world = group_size(group)
        self._exchanger = exchanger

    def exchanger(self) -> Exchanger | None:
        """The exchanger thread of this group's all-to-alls (made at the first call)."""
        if self.threaded and self._exchanger is None:
            self._exchanger = Exchanger(self.group)
        return self._exchanger

    def choose(self, plan: BufferPlan, device: torch.device) -> tuple[Reducer, Gatherer]:
        """The reducer and the gatherer of a buffer on ``device`` laid out by ``plan``."""
        if plan.chunk is not None:
            gather: Gatherer = AllGather(plan.chunk, self.gather_group)
        else:
            gather = PerRun("broadcast", plan.runs, self.gather_group, self.grouped)
        if self.codec is not None or (plan.chunk is None and self.exchanges(device)):
            return Exchange(plan.runs, self), gather
        if plan.chunk is not None:
            return ReduceScatter(plan.chunk, self.group), gather
        return PerRun("reduce", plan.runs, self.group, self.grouped), gather

    def exchanges(self, device: torch.device) -> bool:
        """Whether uneven runs on ``device`` are reduced by all-to-alls (gloo, the CPU), not
        by one reduce per run (gloo's own sends more; NCCL's is native)."""
        return not self.grouped and device.type == "cpu" and self.world > 1


def start_reduce(
    buffer: Tensor,
    runs: Runs,
    group: ProcessGroup,
    *,
    chunk: int | None = None,
    exchanger: Exchanger | None = None,
) -> Pending:
    """Start summing each ``(start, stop, rank)`` run of the 1-D ``buffer`` onto its rank.

    Example:
        >>> start_reduce(torch.arange(3.0), [(0, 3, 0)], group, chunk=3).wait()
    """
    wire = Wire(group, threaded=False, exchanger=exchanger)
    reducer, _ = wire.choose(_plan(runs, chunk), buffer.device)
    return reducer.start(buffer)


def start_broadcast(
    buffer: Tensor, runs: Runs, group: ProcessGroup, *, chunk: int | None = None
) -> Pending:
    """Start giving every rank each run of the 1-D ``buffer`` from its rank.

    Example:
        >>> start_broadcast(torch.arange(3.0), [(0, 3, 0)], group).wait()
    """
    _, gatherer = Wire(group, threaded=False).choose(_plan(runs, chunk), buffer.device)
    return gatherer.start(buffer)


def _plan(runs: Runs, chunk: int | None) -> BufferPlan:
    collectives: Collectives = "reduce+broadcast" if chunk is None else "reduce_scatter+all_gather"
    return BufferPlan(collectives, tuple(Run(*r) for r in runs), chunk)
