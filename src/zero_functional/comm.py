"""Collectives: the only module of zero_functional that talks to ``torch.distributed``.

Everything here is issued from the calling thread in an order that depends only on values every
rank shares (the partition, the bucket layout), never on timing. That is the rule that keeps gloo
from hanging: gloo matches collectives across ranks by the order they are issued.

Nothing is left to gloo's threads once a collective has been waited for: the tensors a collective
was given stay referenced here until the backend has let go of them (:class:`Pending`), so that
no gloo thread frees a tensor that still has a Python object, which needs the GIL. A gloo thread
that asks for the GIL while the interpreter shuts down ends the process with ``std::terminate``
(SIGABRT, "terminate called without an active exception": issue 20).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import io
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, Protocol, cast

import torch
import torch.distributed as dist

# Imported with this package, so before the caller's init_process_group, as torch's own
# ZeroRedundancyOptimizer imports it (through torch.distributed.optim). Its functions bind
# `group=group.WORLD` as default arguments; imported after init_process_group (as it is by the
# first torch.optim.Optimizer built then, through torch._dynamo) they hold the default group
# past destroy_process_group, its gloo threads run on into interpreter shutdown, and one that
# then frees a tensor aborts the process (issue 20). Imported first, the defaults are None.
import torch.distributed.nn.functional  # noqa: F401
from torch import Tensor
from torch.futures import Future

__all__ = [
    "COALESCE_BELOW",
    "CollectiveError",
    "Pending",
    "ProcessGroup",
    "Work",
    "all_gather_objects",
    "all_gather_scalar",
    "all_reduce_scalar",
    "any_rank",
    "backend",
    "broadcast_object",
    "call",
    "collective_device",
    "default_group",
    "exchange_objects",
    "failures",
    "gather_objects",
    "global_rank",
    "group_rank",
    "group_size",
    "is_nccl",
    "rank_or_zero",
    "recv_object",
    "reduce_to_owners",
    "send_object",
    "start_broadcast",
    "start_reduce",
    "start_sync_params",
    "start_sync_units",
    "sync_params",
    "twin_group",
    "unflatten_into",
]

ProcessGroup = dist.ProcessGroup


class CollectiveError(RuntimeError):
    """A collective of this package failed or timed out.

    The message names the call (``step()``, ``consolidate_state_dict()``, ...), its sequence
    number among this process group's calls through the package, this rank, how long it waited,
    and what every other rank reported it was doing when it failed too (or that it did not
    report: it died, or is not in a call of this package).
    """


@dataclass
class _Call:
    name: str
    group: ProcessGroup
    seq: int
    timeout: float | None
    started: float


_local = threading.local()
_SEQ: dict[str, int] = {}
_FAILED: list[str] = []  # every CollectiveError this process raised, oldest first
REPORT_GRACE_S = 5.0
"""How long a failed rank waits for the others' reports before it raises."""


def _group_key(group: ProcessGroup) -> str:
    return str(getattr(group, "group_name", "") or "default")


@contextlib.contextmanager
def call(name: str, group: ProcessGroup, *, timeout: float | None = None) -> Iterator[None]:
    """Run the collectives of one call of the package under ``name``; name its failures.

    Every collective of the block waits at most ``timeout`` seconds (default: the process
    group's own timeout). A failure or a timeout becomes a :class:`CollectiveError` that says
    which call, which rank, and what the other ranks were doing: each failed rank writes its
    call into the process group's store and reads the others' for up to
    :data:`REPORT_GRACE_S` seconds, so ranks that called different things (one ``step()``,
    another ``consolidate_state_dict()``) are named, and a dead rank is named by its silence.
    Nothing is sent when all goes well. Calls nest: the outermost name counts.

    Example:
        >>> import tempfile, torch.distributed as dist
        >>> dist.init_process_group(
        ...     "gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
        >>> with call("example()", dist.group.WORLD, timeout=5.0):
        ...     all_gather_scalar(torch.tensor(1.0), dist.group.WORLD)
        tensor([1.])
        >>> dist.destroy_process_group()
    """
    outer = getattr(_local, "call", None)
    if outer is not None:
        yield
        return
    key = _group_key(group)
    _SEQ[key] = _SEQ.get(key, 0) + 1
    current = _Call(name, group, _SEQ[key], timeout, time.monotonic())
    _local.call = current
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as e:
        error = CollectiveError(_explain(current, e))
        _FAILED.append(str(error))
        raise error from e
    finally:
        _local.call = None


def failures() -> list[str]:
    """The messages of the :class:`CollectiveError` s this process raised, oldest first.

    What a launcher names when a rank cannot leave the process group they broke, even where the
    rank's own code caught them.

    Example:
        >>> failures()  # none in this process
        []
    """
    return list(_FAILED)


def _wait(work: Work | None) -> None:
    if work is None:
        return
    current: _Call | None = getattr(_local, "call", None)
    if current is not None and current.timeout is not None:
        left = current.timeout - (time.monotonic() - current.started)
        work.wait(timedelta(seconds=max(left, 0.001)))
    else:
        work.wait()


def _wait_each(works: Sequence[Work]) -> None:
    for work in works:
        _wait(work)


def _explain(current: _Call, error: BaseException) -> str:
    group = current.group
    me, world = group_rank(group), group_size(group)
    waited = time.monotonic() - current.started
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    # gloo's messages start with a source path and end with advice for gloo's own users
    first = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", first).split(" This is typically")[0]
    mine = f"{current.name} #{current.seq}"
    reports: dict[int, str] = {}
    try:
        store = group.get_group_store()
        prefix = "zero_functional/failed/"
        store.set(f"{prefix}{me}", mine)
        deadline = time.monotonic() + REPORT_GRACE_S
        while len(reports) < world - 1 and time.monotonic() < deadline:
            for r in range(world):
                if r != me and r not in reports and store.check([f"{prefix}{r}"]):
                    reports[r] = store.get(f"{prefix}{r}").decode()
            if len(reports) < world - 1:
                time.sleep(0.05)
    except Exception:  # no store to talk through (or it died with a peer): say what we know
        pass
    others = [
        f"rank {r} was in {reports[r]}"
        if r in reports
        else f"rank {r} did not report (it died, or is not in a call of zero_functional)"
        for r in range(world)
        if r != me
    ]
    return (
        f"{mine} (this process group's collective call #{current.seq} through "
        f"zero_functional) failed on rank {me} of {world} after {waited:.1f} s: {first}. "
        f"The other ranks: {'; '.join(others) or 'none'}. Every rank must make the same calls "
        "in the same order (step(), consolidate_state_dict(), add_param_group(), "
        "load_state_dict(), and the backward of a hooked DDP module)."
    )


class Work(Protocol):
    """The handle an asynchronous collective returns."""

    def wait(self, timeout: timedelta = ...) -> bool: ...

    def get_future(self) -> Future[object]: ...

    def is_completed(self) -> bool: ...


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


def rank_or_zero(group: ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (default: the world), or 0 without a process group.

    Example:
        >>> rank_or_zero()  # no process group in this process
        0
    """
    return int(dist.get_rank(group)) if dist.is_initialized() else 0


def broadcast_object(obj: object, group: ProcessGroup | None = None) -> object:
    """Group rank 0's picklable ``obj`` on every rank of ``group`` (default: the world); ``obj``
    itself without a process group.

    Two broadcasts (size, then bytes) on tensors of this module, as
    ``torch.distributed.broadcast_object_list`` sends them, but waited for as every collective
    here is (:class:`Pending`): within the enclosing :func:`call`'s timeout, and with nothing
    left to the backend's threads.

    Example:
        >>> broadcast_object({"step": 3})  # no process group in this process
        {'step': 3}
    """
    if not dist.is_initialized():
        return obj
    group = default_group(group)
    device = collective_device(group, torch.device("cpu"))
    root, me = global_rank(group, 0), group_rank(group)
    payload = _to_bytes(obj).to(device) if me == 0 else None
    size = torch.tensor([payload.numel() if payload is not None else 0], device=device)
    _start(lambda: dist.broadcast(size, root, group=group, async_op=True), [size], group).wait()
    data = (
        payload
        if payload is not None
        else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    )
    _start(lambda: dist.broadcast(data, root, group=group, async_op=True), [data], group).wait()
    return obj if me == 0 else _from_bytes(data)


def all_gather_objects(obj: object, group: ProcessGroup) -> list[object]:
    """Every rank's picklable ``obj``, in rank order, on every rank (for small messages).

    Two all-gathers (sizes, then bytes padded to the longest) on tensors of this module, as
    ``torch.distributed.all_gather_object`` sends them, but waited for as every collective here
    is (:class:`Pending`).

    Example:
        >>> import tempfile, torch.distributed as dist
        >>> dist.init_process_group(
        ...     "gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
        >>> all_gather_objects(("ok", 3), dist.group.WORLD)
        [('ok', 3)]
        >>> dist.destroy_process_group()
    """
    device = collective_device(group, torch.device("cpu"))
    payload = _to_bytes(obj).to(device)
    sizes = [int(n) for n in all_gather_scalar(torch.tensor(payload.numel()), group).tolist()]
    padded = _padded(payload, max(sizes))
    out = [torch.empty_like(padded) for _ in sizes]
    _start(
        lambda: dist.all_gather(out, padded, group=group, async_op=True), [*out, padded], group
    ).wait()
    return [_from_bytes(t[:n]) for t, n in zip(out, sizes)]


def twin_group(group: ProcessGroup) -> ProcessGroup | None:
    """A second process group over ``group``'s ranks, or ``None`` where one cannot be made.

    Collectives on the twin are ordered among themselves only, so one kind of traffic (the
    parameter all-gather) can be issued when it is ready without breaking the issue order of
    the other (the gradient reduce-scatter). Collective over ``group``'s ranks (only they
    take part); ``None`` on a torch without local synchronisation of new groups.
    """
    ranks = [global_rank(group, r) for r in range(group_size(group))]
    try:
        twin = dist.new_group(ranks=ranks, use_local_synchronization=True)
    except TypeError:  # torch < 2.1: new_group would need every rank of the world
        return None
    return cast(ProcessGroup | None, twin)


def backend(group: ProcessGroup) -> str:
    """The name of ``group``'s backend (``"gloo"``, ``"nccl"``, ...)."""
    return str(dist.get_backend(group))


def is_nccl(group: ProcessGroup) -> bool:
    """Whether ``group`` runs on NCCL (whose collectives can be grouped into one launch)."""
    return "nccl" in backend(group).lower()


SETTLE_S = 1.0
"""How long :meth:`Pending.wait` waits, after its collectives completed, for the backend's
threads to let go of the tensors they were given (microseconds, unless a thread is starved)."""


def _refs(t: Tensor) -> int:
    count = getattr(t, "_use_count", None)  # the tensor's C++ reference count; 0 where absent
    return int(count()) if count is not None else 0


def _hold(tensors: Iterable[Tensor], group: ProcessGroup) -> list[tuple[Tensor, int]]:
    """``tensors`` with their reference counts, taken just before a collective is given them.

    Nothing on NCCL, whose watchdog thread keeps finished collectives for up to its polling
    interval (and whose tensors torch keeps for the caching allocator): only gloo's threads
    are waited for (:func:`_settle`).
    """
    if is_nccl(group):
        return []
    return [(t, _refs(t)) for t in tensors]


def _settle(held: Sequence[tuple[Tensor, int]]) -> None:
    """Return once no collective holds a tensor of ``held`` any more (:data:`SETTLE_S` at most).

    A gloo thread lets go of a collective's tensors just after marking it complete, so a rank
    that waited for it can run ahead. Were the tensors' Python objects gone first, the thread
    would free them, which needs the GIL; asked for while the interpreter shuts down (a program
    that returns right after its last collective), the GIL ends that thread with
    ``pthread_exit`` and the process with ``std::terminate`` (issue 20). So the caller keeps the
    tensors until their counts are back to what they were before the collective.
    """
    deadline: float | None = None
    for t, count in held:
        while _refs(t) > count:
            now = time.monotonic()
            if deadline is None:
                deadline = now + SETTLE_S
            elif now > deadline:
                return
            time.sleep(0)


class Pending:
    """Collectives in flight; :meth:`wait` finishes them, then runs their follow-up copies.

    ``held`` are the tensors made for the collectives (with their counts from :func:`_hold`):
    kept until the backend has let go of them, so that none is freed by a backend thread.
    Those passed in by the caller are the caller's to keep (their counts change with the views
    a forward takes of them, so they could not be waited for).
    """

    def __init__(
        self,
        works: list[Work],
        finish: list[Callable[[], None]] | None = None,
        held: Sequence[tuple[Tensor, int]] = (),
    ) -> None:
        self.works = works
        self.finish = finish or []
        self.held = list(held)
        self._settle = True

    @property
    def finished(self) -> bool:
        """Whether :meth:`wait` has run (collectives completed and data copied in place)."""
        return not self.works and not self.finish

    def done(self) -> bool:
        """Whether every collective has completed (never blocks)."""
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        """Wait for every collective, then copy received data where it belongs (once).

        On return the backend holds nothing of these collectives (see :func:`_settle`).
        """
        _wait_each(self.works)  # (no loop variable here: it would hold the last work)
        finish = self.finish  # and what its copies read, until the backend has let go too
        self._run_finish()
        if self._settle:
            _settle(self.held)
        self.held = []
        del finish

    def _run_finish(self) -> None:
        with torch.no_grad():
            for fn in self.finish:
                fn()
        self.works, self.finish = [], []

    def future(self, value: Tensor) -> Future[Tensor]:
        """A future that completes with ``value`` once every collective and copy is done.

        What a DDP communication hook returns; the copies run in the completion callback
        (no collective is issued there, so ranks cannot issue them in different orders).
        """
        if not self.works:
            self._run_finish()
            done: Future[Tensor] = Future()
            done.set_result(value)
            return done
        try:
            futures = [w.get_future() for w in self.works]
        except RuntimeError:  # a backend whose work has no future (gloo's reduce-scatter)
            self.wait()
            done = Future()
            done.set_result(value)
            return done
        self._settle = False  # the futures hold the tensors too: `held` is kept, not waited for

        def complete(_: object) -> Tensor:
            # on the backend's thread, which still holds the works: `held` stays with this
            # object, dropped by whoever drops it (the hook's state, on the autograd thread)
            self._run_finish()
            return value

        return torch.futures.collect_all(futures).then(complete)


def _issue(
    op: Literal["broadcast", "reduce"],
    calls: Sequence[tuple[Tensor, int]],
    group: ProcessGroup,
    finish: list[Callable[[], None]] | None = None,
) -> Pending:
    """Start ``dist.<op>(tensor, root, group=..., async_op=True)`` per call, in list order.

    On NCCL several calls go into one coalesced group (one launch, as NCCL's own uneven
    reduce-scatter and all-gather are built) and the block's handle is what to wait for;
    elsewhere each is its own collective. ``root`` is a group rank. The collective is looked
    up when called, so that it is the one any wrapper installed. The tensors are made here (or
    waited for at once): the :class:`Pending` holds them.
    """
    held = _hold((tensor for tensor, _ in calls), group)
    if len(calls) > 1 and is_nccl(group):
        coalescing = dist.distributed_c10d._coalescing_manager
        with coalescing(group, calls[0][0].device, async_ops=True) as cm:
            for tensor, root in calls:
                getattr(dist, op)(tensor, global_rank(group, root), group=group, async_op=True)
        return Pending(list(cm.works), finish, held)
    handles: list[Work] = []
    for tensor, root in calls:
        work = getattr(dist, op)(tensor, global_rank(group, root), group=group, async_op=True)
        assert work is not None
        handles.append(work)
    return Pending(handles, finish, held)


def _start(
    issue: Callable[[], Work | None],
    made: Sequence[Tensor],
    group: ProcessGroup,
    finish: list[Callable[[], None]] | None = None,
) -> Pending:
    """``issue()`` one asynchronous collective; its :class:`Pending`, holding ``made`` (the
    tensors made for it here)."""
    held = _hold(made, group)
    work = issue()
    assert work is not None
    return Pending([work], finish, held)


def _reduce_scatter_single(output: Tensor, input: Tensor, **kw: object) -> Work | None:
    # looked up per call (torch < 2.13 has only the older name; tools may wrap either)
    op = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return op(output, input, **kw)  # type: ignore[no-any-return]


def _all_gather_single(output: Tensor, input: Tensor, **kw: object) -> Work | None:
    op = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return op(output, input, **kw)  # type: ignore[no-any-return]


def _padded(buffer: Tensor, size: int) -> Tensor:
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
        return _issue("reduce", [(buffer[a:b], rank) for a, b, rank in runs], group)
    world, me = group_size(group), group_rank(group)
    source = _padded(buffer, chunk * world)
    out = torch.empty(chunk, dtype=buffer.dtype, device=buffer.device)
    lo, hi = min(me * chunk, buffer.numel()), min((me + 1) * chunk, buffer.numel())

    def copy_back() -> None:
        buffer[lo:hi].copy_(out[: hi - lo])

    return _start(
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
        return _issue("broadcast", [(buffer[a:b], rank) for a, b, rank in runs], group)
    world, me = group_size(group), group_rank(group)
    target = _padded(buffer, chunk * world)
    mine = target[me * chunk : (me + 1) * chunk]

    def copy_back() -> None:
        buffer.copy_(target[: buffer.numel()])

    if target is buffer:
        return _start(
            lambda: _all_gather_single(target, mine, group=group, async_op=True), [mine], group
        )
    return _start(
        lambda: _all_gather_single(target, mine, group=group, async_op=True),
        [target, mine],
        group,
        [copy_back],
    )


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
        return [(_issue("broadcast", calls, group, done), sorted(i for _, c in plan for i in c))]
    out: list[tuple[Pending, list[int]]] = []
    for owner, indices in plan:
        if before is not None and owner == me:
            before(indices)
        buffer, finish = unit(owner, indices)
        pending = _issue("broadcast", [(buffer, owner)], group, [finish] if finish else None)
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
    _issue("reduce", calls, group).wait()


def all_reduce_scalar(value: Tensor, group: ProcessGroup, *, op: str = "sum") -> Tensor:
    """The sum (or max) of a 0-d tensor over the group, on every rank (one small all-reduce).

    The tensor travels on :func:`collective_device`; the result comes back on ``value``'s.
    """
    device = collective_device(group, value.device)
    t = value.detach().reshape(1).to(device, copy=True)
    reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
    _start(lambda: dist.all_reduce(t, op=reduce_op, group=group, async_op=True), [t], group).wait()
    return t.reshape(()).to(value.device)


def any_rank(flags: Tensor, group: ProcessGroup) -> Tensor:
    """Elementwise "any rank's flag is set" of a bool vector, on every rank (one all-reduce).

    Example:
        >>> import tempfile, torch.distributed as dist
        >>> dist.init_process_group(
        ...     "gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
        >>> any_rank(torch.tensor([True, False]), dist.group.WORLD)
        tensor([ True, False])
        >>> dist.destroy_process_group()
    """
    device = collective_device(group, flags.device)
    t = flags.detach().to(device=device, dtype=torch.uint8, copy=True)
    work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True)
    assert work is not None
    _wait(work)
    return t.to(flags.device).bool()


def all_gather_scalar(value: Tensor, group: ProcessGroup) -> Tensor:
    """Every rank's 0-d ``value``, stacked in rank order, on every rank (one small all-gather).

    Unlike a sum, the gathered values are exact: a caller combines them however it must (for
    instance as a norm of norms, the way ``torch.nn.utils.clip_grad_norm_`` does). The values
    travel on :func:`collective_device`; the result comes back on ``value``'s.

    Example:
        >>> import tempfile, torch.distributed as dist
        >>> dist.init_process_group(
        ...     "gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
        >>> all_gather_scalar(torch.tensor(2.5), dist.group.WORLD)
        tensor([2.5000])
        >>> dist.destroy_process_group()
    """
    device = collective_device(group, value.device)
    local = value.detach().reshape(1).to(device, copy=True)
    out = [torch.empty_like(local) for _ in range(group_size(group))]
    _start(
        lambda: dist.all_gather(out, local, group=group, async_op=True), [*out, local], group
    ).wait()
    return torch.cat(out).to(value.device)


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
    to = global_rank(group, dst)
    payload = _to_bytes(obj).to(device)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    _start(lambda: dist.isend(size, dst=to, group=group), [size], group).wait()
    _start(lambda: dist.isend(payload, dst=to, group=group), [payload], group).wait()


def recv_object(src: int, group: ProcessGroup, device: torch.device) -> object:
    """Receive one object sent by :func:`send_object` from group rank ``src``, on the CPU."""
    source = global_rank(group, src)
    size = torch.zeros(1, dtype=torch.int64, device=device)
    _start(lambda: dist.irecv(size, src=source, group=group), [size], group).wait()
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    _start(functools.partial(dist.irecv, data, src=source, group=group), [data], group).wait()
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
