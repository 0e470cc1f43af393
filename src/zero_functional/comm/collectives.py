"""Collectives as objects: how one buffer's gradients reach their owners and its parameters come
back from them, chosen once per buffer by :meth:`Wire.choose`, the one place that asks a backend.

A :class:`Reducer` sums each run of a 1-D buffer onto the rank that owns it; a :class:`Gatherer`
gives every rank each run from its owner. Three strategies, each a pair of classes:

* per run: one reduce / broadcast per owner's stretch (grouped into one launch on NCCL);
* even shards: one ``reduce_scatter_single`` / ``all_gather_single`` over the buffer padded to
  ``chunk * world_size`` (NCCL's fastest path, where the runs are the even split);
* on gloo, the reduce as all-to-alls in bounded windows (:mod:`~zero_functional.comm.exchange`),
  each rank sending each owner its runs once, by the :class:`Wire`'s exchanger thread.

A new strategy is one class here and one line in :meth:`Wire.choose`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from zero_functional.comm.exchange import Exchanger, start_exchange
from zero_functional.comm.groups import ProcessGroup, Work, group_rank, group_size, is_nccl
from zero_functional.comm.pending import Pending, issue, start_one
from zero_functional.core.ownership import Run
from zero_functional.core.plans import BufferPlan, Collectives

Runs = Sequence[tuple[int, int, int]]


class Reducer(Protocol):
    """Sums each run of a 1-D buffer onto its owner, in place; other elements are undefined after."""

    def start(self, buffer: Tensor) -> Pending: ...


class Gatherer(Protocol):
    """Gives every rank each run of a 1-D buffer from its owner, in place."""

    def start(self, buffer: Tensor) -> Pending: ...


@dataclass(frozen=True, slots=True)
class RunReduces:
    """One reduce per run onto its owner (one grouped launch where ``grouped``: NCCL)."""

    runs: Runs
    group: ProcessGroup
    grouped: bool

    def start(self, buffer: Tensor) -> Pending:
        calls = [(buffer[a:b], rank) for a, b, rank in self.runs]
        return issue("reduce", calls, self.group, grouped=self.grouped)


@dataclass(frozen=True, slots=True)
class RunBroadcasts:
    """One broadcast per run from its owner (one grouped launch where ``grouped``: NCCL)."""

    runs: Runs
    group: ProcessGroup
    grouped: bool

    def start(self, buffer: Tensor) -> Pending:
        calls = [(buffer[a:b], rank) for a, b, rank in self.runs]
        return issue("broadcast", calls, self.group, grouped=self.grouped)


def padded(buffer: Tensor, size: int) -> Tensor:
    """``buffer`` itself if it has ``size`` elements, else a zero-padded copy of that size."""
    if buffer.numel() == size:
        return buffer
    out = torch.zeros(size, dtype=buffer.dtype, device=buffer.device)
    out[: buffer.numel()].copy_(buffer)
    return out


def _reduce_scatter_single(output: Tensor, input: Tensor, **kw: object) -> Work | None:
    # looked up per call (torch < 2.13 has only the older name; a byte counter may wrap either)
    op = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return op(output, input, **kw)  # type: ignore[no-any-return]


def _all_gather_single(output: Tensor, input: Tensor, **kw: object) -> Work | None:
    op = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return op(output, input, **kw)  # type: ignore[no-any-return]


@dataclass(frozen=True, slots=True)
class ReduceScatter:
    """Rank ``r`` gets the sum of ``[r * chunk, (r + 1) * chunk)``: one ``reduce_scatter_single``."""

    chunk: int
    group: ProcessGroup

    def start(self, buffer: Tensor) -> Pending:
        world, me, chunk = group_size(self.group), group_rank(self.group), self.chunk
        source = padded(buffer, chunk * world)
        out = torch.empty(chunk, dtype=buffer.dtype, device=buffer.device)
        lo, hi = min(me * chunk, buffer.numel()), min((me + 1) * chunk, buffer.numel())

        def copy_back() -> None:
            buffer[lo:hi].copy_(out[: hi - lo])

        made = [out] if source is buffer else [out, source]
        return start_one(
            lambda: _reduce_scatter_single(out, source, group=self.group, async_op=True),
            made,
            self.group,
            [copy_back],
        )


@dataclass(frozen=True, slots=True)
class AllGather:
    """Every rank gets each even shard ``[r * chunk, (r + 1) * chunk)``: one ``all_gather_single``
    (in place where the buffer is padded to ``chunk * world_size`` already)."""

    chunk: int
    group: ProcessGroup

    def start(self, buffer: Tensor) -> Pending:
        world, me, chunk = group_size(self.group), group_rank(self.group), self.chunk
        target = padded(buffer, chunk * world)
        mine = target[me * chunk : (me + 1) * chunk]

        def copy_back() -> None:
            buffer.copy_(target[: buffer.numel()])

        def gather() -> Work | None:
            return _all_gather_single(target, mine, group=self.group, async_op=True)

        if target is buffer:
            return start_one(gather, [mine], self.group)
        return start_one(gather, [target, mine], self.group, [copy_back])


@dataclass(frozen=True, slots=True)
class Exchange:
    """gloo's reduce onto owners: all-to-alls in bounded windows, by the wire's exchanger thread
    where it has one, else at once on the caller's."""

    runs: Runs
    wire: Wire

    def start(self, buffer: Tensor) -> Pending:
        return start_exchange(buffer, self.runs, self.wire.group, self.wire.exchanger())


class Wire:
    """The collectives of one process group, chosen once per buffer (:meth:`choose`).

    Args:
        group: The group gradients are reduced over (and parameters gathered over, unless
            ``gather_group`` is given: overlap mode's twin, whose collectives keep their own
            order).
        gather_group: The group parameters are gathered over.
        threaded: On gloo, whether the exchanges run on a thread of their own (made, with its
            twin group, at the first exchange: a collective every rank reaches there).
        exchanger: The thread to run them on, made already.

    Example:
        >>> wire = Wire(group, threaded=False)
        >>> plan = BufferPlan("reduce+broadcast", ((0, 3, 0),), None)
        >>> [type(c).__name__ for c in wire.choose(plan, torch.device("cpu"))]
        ['RunReduces', 'RunBroadcasts']
    """

    def __init__(
        self,
        group: ProcessGroup,
        gather_group: ProcessGroup | None = None,
        *,
        threaded: bool = True,
        exchanger: Exchanger | None = None,
    ) -> None:
        self.group = group
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
            return ReduceScatter(plan.chunk, self.group), AllGather(plan.chunk, self.gather_group)
        gather = RunBroadcasts(plan.runs, self.gather_group, self.grouped)
        if not self.grouped and device.type == "cpu" and self.world > 1:
            return Exchange(plan.runs, self), gather
        return RunReduces(plan.runs, self.group, self.grouped), gather


def start_reduce(
    buffer: Tensor,
    runs: Runs,
    group: ProcessGroup,
    *,
    chunk: int | None = None,
    exchanger: Exchanger | None = None,
) -> Pending:
    """Start summing each ``(start, stop, rank)`` run of the 1-D ``buffer`` onto its rank, with
    the reducer :meth:`Wire.choose` picks (``chunk``: the runs are the even split; ``exchanger``:
    on gloo, the thread that does it).

    Example:
        >>> t = torch.arange(3.0)
        >>> start_reduce(t, [(0, 3, 0)], group, chunk=3).wait()
        >>> t
        tensor([0., 1., 2.])
    """
    wire = Wire(group, threaded=False, exchanger=exchanger)
    reducer, _ = wire.choose(_plan(runs, chunk), buffer.device)
    return reducer.start(buffer)


def start_broadcast(
    buffer: Tensor, runs: Runs, group: ProcessGroup, *, chunk: int | None = None
) -> Pending:
    """Start giving every rank each run of the 1-D ``buffer`` from its rank, with the gatherer
    :meth:`Wire.choose` picks.

    Example:
        >>> t = torch.arange(3.0)
        >>> start_broadcast(t, [(0, 3, 0)], group).wait()
        >>> t
        tensor([0., 1., 2.])
    """
    _, gatherer = Wire(group, threaded=False).choose(_plan(runs, chunk), buffer.device)
    return gatherer.start(buffer)


def _plan(runs: Runs, chunk: int | None) -> BufferPlan:
    collectives: Collectives = "reduce+broadcast" if chunk is None else "reduce_scatter+all_gather"
    return BufferPlan(collectives, tuple(Run(*r) for r in runs), chunk)
