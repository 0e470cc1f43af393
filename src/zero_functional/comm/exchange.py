"""Exchange: gloo's reduce onto owners as all-to-alls in bounded windows, at its byte floor.

Each rank sends each owner its stretches once (gloo's own ``reduce`` and ``reduce_scatter`` send
more: ``benchmarks/README.md``); the owner adds what arrived onto its values in rank order. With a
:class:`~zero_functional.comm.codec.Codec` each stretch travels encoded (8 or 16 bits, on any
backend), rounded once, and the owner sums the decoded values in fp32."""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from zero_functional.comm.codec import Codec
from zero_functional.comm.groups import ProcessGroup, group_rank, group_size, twin_group
from zero_functional.comm.pending import Pending, hold, settle
from zero_functional.comm.worker import InOrder
from zero_functional.core.plans import ChunkLayout, Runs, chunk_layout, exchange_chunks

WINDOW_BYTES = 1 << 20  # the most one chunk receives (two in flight): the memory/CPU trade


class _Job:
    """One buffer's exchange on an :class:`Exchanger`'s thread: the caller's work handle."""

    def __init__(self, buffer: Tensor, runs: Runs, codec: Codec | None) -> None:
        self.buffer, self.runs, self.codec = buffer, list(runs), codec
        self._done = threading.Event()
        self._future: Future[None] = Future()
        self._error: BaseException | None = None

    def finish(self, error: BaseException | None) -> None:
        """The sums are in place (or ``error`` stopped them)."""
        self._error = error
        self.buffer = torch.empty(0)  # the caller's buffer is the caller's again
        self._done.set()
        if error is None:
            self._future.set_result(None)
        else:
            self._future.set_exception(error)  # type: ignore[arg-type]  # (torch's stub)

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self._done.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError(f"the exchange timed out after {timeout}")
        if self._error is not None:
            raise RuntimeError(f"the exchange failed: {self._error}") from self._error
        return True

    def get_future(self) -> Future[None]:
        return self._future


class _Windows:
    """The windows one thread's exchanges go through, kept between chunks and buffers."""

    def __init__(self) -> None:
        self.kept: dict[tuple[torch.dtype, torch.device, int], Tensor] = {}

    def get(self, like: Tensor, slot: int, numel: int) -> Tensor:
        """A window of ``numel`` elements of ``like``'s kind (``slot`` 0/1: received, 2/3: sent)."""
        key = (like.dtype, like.device, slot)
        kept = self.kept.get(key)
        if kept is None or kept.numel() < numel:
            per = max(numel, WINDOW_BYTES // like.element_size())
            kept = self.kept[key] = torch.empty(per, dtype=like.dtype, device=like.device)
        return kept[:numel]


@functools.lru_cache(maxsize=256)
def _layouts(
    runs: tuple[tuple[int, int, int], ...], world: int, me: int, per_owner: int
) -> tuple[ChunkLayout, ...]:
    """This rank's side of each chunk (a DDP bucket's are the same each backward: planned once)."""
    return tuple(chunk_layout(chunk, me) for chunk in exchange_chunks(runs, world, per_owner))


def _exchange(
    buffer: Tensor, runs: Runs, group: ProcessGroup, windows: _Windows, codec: Codec | None = None
) -> None:
    """Sum ``buffer``'s runs onto their owners over ``group``, chunk by chunk (blocking)."""
    world, me = group_size(group), group_rank(group)
    per_owner = max(1, WINDOW_BYTES // (buffer.element_size() * (world - 1)))
    in_flight: list[list[Any]] = []
    for c, plan in enumerate(_layouts(tuple(map(tuple, runs)), world, me, per_owner)):
        if plan.span is not None:  # the others' stretches are one stretch: sent as it is
            source = buffer[plan.span[0] : plan.span[1]]
        else:
            source = windows.get(buffer, 2 + c % 2, sum(plan.sends))
            torch.cat([buffer[a:b] for a, b in plan.source] or [buffer[:0]], out=source)
        sends, receives = list(plan.sends), list(plan.receives)
        if codec is not None:  # each owner's stretches encoded on their own: its blocks
            like = torch.empty(0, dtype=torch.uint8, device=buffer.device)
            encoded = windows.get(like, 2 + c % 2, sum(map(codec.nbytes, sends)))
            _encode_each(source, sends, codec, encoded)
            source, sends = encoded, [codec.nbytes(n) for n in sends]
            receives = [codec.nbytes(n) for n in receives]
        received = windows.get(source, c % 2, sum(receives))
        held = hold([source, received], group)
        # looked up when called, so that any wrapper installed over it (a byte counter) runs
        work = dist.all_to_all_single(received, source, receives, sends, group=group, async_op=True)
        in_flight.append([work, received, plan.mine, held])
        del work  # held by in_flight only: _add drops it before it settles
        if len(in_flight) == 2:  # the previous chunk is added while this one travels
            _add(buffer, in_flight.pop(0), world, me, codec)
    while in_flight:
        _add(buffer, in_flight.pop(0), world, me, codec)


def _encode_each(source: Tensor, sends: list[int], codec: Codec, out: Tensor) -> None:
    """Encode each rank's part of ``source`` (``sends`` elements each) into its part of ``out``."""
    at = written = 0
    for n in sends:
        size = codec.nbytes(n)
        codec.encode_into(source[at : at + n], out[written : written + size])
        at, written = at + n, written + size


def _add(buffer: Tensor, entry: list[Any], world: int, me: int, codec: Codec | None) -> None:
    """Wait for one chunk (``[work, received, this rank's stretches, held]``), then add what the
    others sent onto this rank's values, in rank order (the same bits as one all-to-all);
    encoded, this rank's and the decoded values are summed in fp32 in rank order."""
    entry[0].wait()
    entry[0] = None  # the work holds the windows until it is gone
    _, received, mine, held = entry
    settle(held)  # gloo's thread lets go of the windows before they are used again
    size = sum(b - a for a, b in mine)
    if codec is not None:
        if size:
            _add_decoded(buffer, received, mine, size, world, me, codec)
        return
    rows = received.view(world - 1, size) if size else received
    offset = 0
    for a, b in mine:
        for row in range(world - 1):
            buffer[a:b].add_(rows[row, offset : offset + b - a])
        offset += b - a


def _add_decoded(
    buffer: Tensor,
    received: Tensor,
    mine: Sequence[tuple[int, int]],
    size: int,
    world: int,
    me: int,
    codec: Codec,
) -> None:
    """Sum this rank's stretches (as they are) and each other rank's (decoded) in fp32."""
    own = torch.cat([buffer[a:b] for a, b in mine]).float()
    per, at = codec.nbytes(size), 0
    total: Tensor | None = None
    for rank in range(world):
        if rank == me:
            term = own
        else:
            term, at = codec.decode(received[at : at + per], size), at + per
        total = term.clone() if total is None else total.add_(term)
    assert total is not None
    offset = 0
    for a, b in mine:
        buffer[a:b].copy_(total[offset : offset + b - a])
        offset += b - a


def _run(job: _Job, group: ProcessGroup, windows: _Windows) -> None:
    """One job, on an :class:`Exchanger`'s thread; its error goes to whoever waits for it."""
    try:
        _exchange(job.buffer, job.runs, group, windows, job.codec)
    except BaseException as e:  # raised by the job's wait, on the caller's thread
        job.finish(e)
    else:
        job.finish(None)


class Exchanger:
    """Exchanges over one group, run in the order given by a thread of its own.

    The thread issues them on a twin of ``group`` (made here: collective over its ranks) that only
    it uses, while the caller goes on (DDP's backward). Without a twin (torch < 2.1) each runs at
    once on the caller's thread. The thread ends when the exchanger is dropped.

    Example:
        >>> Exchanger(group).start(torch.arange(3.0), [(0, 3, 0)]).wait()
    """

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group
        self.world = group_size(group)
        self.twin = twin_group(group) if self.world > 1 else None
        self.windows = _Windows()
        self._worker = InOrder("zero-exchange") if self.twin is not None else None
        if self._worker is not None:
            weakref.finalize(self, self._worker.close)  # the thread ends with this object

    def start(self, buffer: Tensor, runs: Runs, codec: Codec | None = None) -> Pending:
        """:func:`start_exchange` on this exchanger's thread (``buffer`` kept until waited for)."""
        if buffer.numel() == 0 or self.world == 1:
            return Pending([])
        if self.twin is None or self._worker is None:
            with torch.no_grad():
                _exchange(buffer, runs, self.group, self.windows, codec)
            return Pending([])
        job = _Job(buffer, runs, codec)
        # what the thread runs holds the job, the twin and the windows, not this object
        self._worker.put(functools.partial(_run, job, self.twin, self.windows))
        return Pending([job])  # type: ignore[list-item]

    def held_bytes(self) -> int:
        """The bytes of the windows kept (at most ``4 x`` :data:`WINDOW_BYTES` per dtype)."""
        return sum(t.numel() * t.element_size() for t in self.windows.kept.values())


def start_exchange(
    buffer: Tensor,
    runs: Runs,
    group: ProcessGroup,
    exchanger: Exchanger | None = None,
    codec: Codec | None = None,
) -> Pending:
    """Start summing each ``(start, stop, rank)`` run of the 1-D ``buffer`` onto its rank.

    Once waited for, each rank's runs hold the sum of every rank's values (its own, then the others'
    in rank order); other elements keep this rank's. Without ``exchanger`` (made over ``group``)
    it is done before this returns. With ``codec``, the others' values arrive encoded (rounded
    once) and the sum is taken in fp32.

    Example:
        >>> start_exchange(torch.arange(3.0), [(0, 3, 0)], group).wait()
    """
    if exchanger is not None:
        if exchanger.group is not group:
            raise ValueError("the exchanger given was made over another process group")
        return exchanger.start(buffer, runs, codec)
    if buffer.numel() and group_size(group) > 1:
        with torch.no_grad():
            _exchange(buffer, runs, group, _Windows(), codec)
    return Pending([])
