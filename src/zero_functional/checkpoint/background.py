"""Checkpoints written behind training (``checkpoint.save(..., blocking=False)``): copy and plan
now, on the caller's thread; write later, in a thread that does file I/O only.

:func:`start` copies every tensor (a CUDA one to pinned host memory, waited for by the thread)
and the objects, since the next step changes them in place; enters the
:class:`~zero_functional.checkpoint.storage.AtomicSave` and exchanges DCP's plans, on the
caller's thread (the thread never issues a collective). Each rank's thread writes its data
file, then ``.zero_functional-rank-<r>`` (its results or its error); rank 0's waits for every
rank's, writes the index and commits; the others wait for their file in the committed directory
or ``.zero_functional-failed`` (rank 0's verdict) in the temporary. A process killed at any
moment leaves the previous checkpoint. One save is in flight per process: the next waits for it
(:func:`settle`) and raises, on every rank, an error of it nobody was told of.
"""

from __future__ import annotations

import copy
import os
import pickle
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from zero_functional import comm
from zero_functional.checkpoint import atomic_dir, storage
from zero_functional.checkpoint.storage import CheckpointError, Pieces
from zero_functional.core._validate import by_rank

RENDEZVOUS_TIMEOUT_S = 1800.0
"""How long a rank's thread waits for the other ranks' files (rank 0) or for the commit (the
others) before it gives up, naming the ranks it did not hear from; what a dead peer costs."""

_POLL_S = 0.01
_FAILED = ".zero_functional-failed"
_STAGED: dict[tuple[str, int, int], Tensor] = {}
"""The last save's host copies, by (key, start, stop), which the next one copies into (a fresh
pinned allocation costs more than the copy), as DCP's ``async_save`` caches its staging."""


def _results_file(directory: str, rank: int) -> str:
    return os.path.join(directory, f".zero_functional-rank-{rank}")


def _put(path: str, value: object) -> None:
    """Write ``value`` to ``path`` whole: a reader sees no file or all of it."""
    with open(path + ".part", "wb") as f:
        pickle.dump(value, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(path + ".part", path)


def _get(path: str) -> Any:
    """What :func:`_put` wrote at ``path``, or ``None`` while there is none."""
    try:
        with open(path, "rb") as f:
            return pickle.load(f)  # our own file, in a directory this save made
    except (OSError, EOFError, pickle.UnpicklingError):
        return None


@dataclass(frozen=True)
class _Job:
    """What a rank's thread needs: everything decided and copied on the caller's thread."""

    rank: int
    world_size: int
    save: storage.AtomicSave
    planner: SavePlanner
    writer: FileSystemWriter
    plan: SavePlan
    metadata: Metadata | None  # rank 0's, from the global plan
    copied: list[torch.cuda.Event]  # recorded after the copies to pinned memory


def copy_pieces(
    pieces: Pieces, cache: dict[tuple[str, int, int], Tensor]
) -> tuple[Pieces, list[torch.cuda.Event]]:
    """Each range's tensor copied off the training's hands into host memory, and the events
    that say when the device copies have landed. ``cache`` holds the last copies, which this
    one reuses and replaces: call it with no write of them in flight.

    Example:
        >>> cache = {}
        >>> copied, events = copy_pieces({"w": ((2,), torch.float32, [(0, 2, torch.ones(2))])}, cache)
        >>> copied["w"][2][0][2] is cache["w", 0, 2], events
        (True, [])
    """
    out: dict[str, Any] = {}
    staged: dict[tuple[str, int, int], Tensor] = {}
    devices: set[torch.device] = set()
    for key, (shape, dtype, ranges) in pieces.items():
        for start, stop, t in ranges:
            t, host = t.detach(), cache.get((key, start, stop))
            kind = (t.shape, t.dtype, t.is_cuda)  # pinned for a device copy
            if host is None or (host.shape, host.dtype, host.is_pinned()) != kind:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            staged[key, start, stop] = host.copy_(t, non_blocking=t.is_cuda)
            if t.is_cuda:
                devices.add(t.device)
        out[key] = (shape, dtype, [(a, z, staged[key, a, z]) for a, z, _ in ranges])
    cache.clear()
    cache.update(staged)
    return out, [torch.cuda.current_stream(device).record_event() for device in devices]


def _plan(
    objects: dict[str, Any],
    planner: SavePlanner,
    writer: FileSystemWriter,
    group: dist.ProcessGroup | None,
) -> tuple[SavePlan, Metadata | None]:
    """DCP's plan exchange (``_save_state_dict``'s ``reduce_scatter``), on this thread."""
    rank = comm.rank_or_zero(group)
    local: SavePlan | str
    try:
        planner.set_up_planner(objects, writer.storage_meta(), rank == 0)
        writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
        local = writer.prepare_local_plan(planner.create_local_plan())
    except Exception as e:  # one rank's bad input fails every rank, not a hang
        local = f"{type(e).__name__}: {e}"
    group = comm.default_group(group) if dist.is_initialized() else None
    # as one bytes object: torch.save (comm's pickler) of a plan's small objects is slow
    mine = pickle.dumps(local)
    packed = comm.all_gather_objects(mine, group) if group is not None else [mine]
    plans = [pickle.loads(cast(bytes, b)) for b in packed]
    verdict: tuple[list[SavePlan] | None, str | None] = (None, None)
    metadata = None
    if rank == 0:
        try:
            if failed := [(r, p) for r, p in enumerate(plans) if isinstance(p, str)]:
                raise CheckpointError(by_rank(failed))
            central, metadata = planner.create_global_plan(cast(list[SavePlan], plans))
            verdict = (writer.prepare_global_plan(central), None)
        except Exception as e:
            verdict = (None, str(e))
    if group is not None:
        verdict = pickle.loads(cast(bytes, comm.broadcast_object(pickle.dumps(verdict), group)))
    central_plans, error = verdict
    if error is not None or central_plans is None:
        raise CheckpointError(f"checkpoint save failed: {error}")
    return planner.finish_plan(central_plans[rank]), metadata


def _write(job: _Job) -> None:
    """A rank's thread: its data file, its results file; rank 0 commits, the others wait."""
    for event in job.copied:
        event.synchronize()
    tmp, target = job.save.tmp, job.save.target
    try:
        results = job.writer.write_data(job.plan, job.planner).value()
    except Exception as e:
        _put(_results_file(tmp, job.rank), (tmp, None, str(e)))  # rank 0 names the rank
        raise CheckpointError(f"checkpoint save to {target} failed: rank {job.rank}: {e}") from e
    _put(_results_file(tmp, job.rank), (tmp, results, None))
    if job.rank == 0:
        _commit(job)
    else:
        _await_commit(job)


def _fail(job: _Job, message: str) -> CheckpointError:
    """Rank 0's verdict, left in the temporary for the other ranks' threads to read."""
    message = f"checkpoint save to {job.save.target} failed: {message}"
    _put(os.path.join(job.save.tmp, _FAILED), message)
    atomic_dir.release(job.save.tmp)  # rank 0's hold; the next save removes what is left
    return CheckpointError(message)


def _commit(job: _Job) -> None:
    """Rank 0: every rank's results, then the index and the commit."""
    tmp, results, errors = job.save.tmp, {}, []  # results: each rank's DCP WriteResults
    deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_S
    waiting = set(range(job.world_size))
    while waiting and time.monotonic() <= deadline:
        for r in sorted(waiting):
            if (got := _get(_results_file(tmp, r))) is not None:
                waiting.discard(r)
                if got[2] is None:
                    results[r] = got[1]
                else:
                    errors.append((r, got[2]))
        if waiting:
            time.sleep(_POLL_S)
    late = f"within {RENDEZVOUS_TIMEOUT_S:.0f} s"
    errors += [(r, f"wrote no {_results_file(tmp, r)} {late}") for r in sorted(waiting)]
    if errors:
        raise _fail(job, by_rank(sorted(errors)))
    assert job.metadata is not None
    try:
        job.writer.finish(job.metadata, [results[r] for r in range(job.world_size)])
    except OSError as e:
        raise _fail(job, f"rank 0: cannot write {os.path.join(tmp, '.metadata')}: {e}") from e
    if (error := job.save.commit()) is not None:
        raise _fail(job, f"rank 0: {error}")


def _await_commit(job: _Job) -> None:
    """Another rank: until its results file is in the committed directory, or rank 0 failed."""
    tmp, target = job.save.tmp, job.save.target
    deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_S
    while True:
        if (failed := _get(os.path.join(tmp, _FAILED))) is not None:
            raise CheckpointError(str(failed))
        if (committed := _get(_results_file(target, job.rank))) is not None and committed[0] == tmp:
            return
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"rank {job.rank}: rank 0 did not commit {target} within "
                f"{RENDEZVOUS_TIMEOUT_S:.0f} s (its files are in {tmp})"
            )
        time.sleep(_POLL_S)


class SaveHandle:
    """A checkpoint being written behind training (what ``save(..., blocking=False)`` returns).

    Example:
        >>> import tempfile, torch, zero_functional.checkpoint as ckpt
        >>> handle = ckpt.save(tempfile.mkdtemp() + "/c", model=torch.nn.Linear(2, 2), blocking=False)
        >>> handle.wait(); handle.done()
        True
    """

    def __init__(self, job: _Job) -> None:
        self.path, self._rank = job.save.target, job.rank
        self._error: CheckpointError | None = None
        self._reported = False
        self._thread = threading.Thread(
            target=self._run, args=(job,), name=f"zero_functional-save-rank{job.rank}"
        )
        self._thread.start()

    def _run(self, job: _Job) -> None:
        try:
            _write(job)
        except CheckpointError as e:
            self._error = e
        except BaseException as e:  # noqa: BLE001 - surfaced on wait(), never lost in the thread
            self._error = CheckpointError(
                f"checkpoint save to {self.path} failed: rank {job.rank}: {type(e).__name__}: {e}"
            )

    def done(self) -> bool:
        """Whether the write has ended: committed (on every rank) or failed."""
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the checkpoint is committed (at most ``timeout`` seconds); raise what the
        write failed with.

        Raises:
            CheckpointError: The write failed, naming each failed rank and its file; the
                previous checkpoint at the path is untouched.
            TimeoutError: ``timeout`` passed with the write still running.
        """
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"rank {self._rank}: {self.path} is still being written")
        if self._error is not None:
            self._reported = True
            raise self._error


_IN_FLIGHT: list[SaveHandle] = []  # this process's save in flight: at most one


def settle(process_group: dist.ProcessGroup | None) -> None:
    """Wait for this process's save in flight, if any; collective when there was one.

    Raises:
        CheckpointError: On every rank: it failed and no rank's :meth:`SaveHandle.wait` said so.

    Example:
        >>> settle(None)  # nothing in flight: returns at once
    """
    if not _IN_FLIGHT:
        return
    handle = _IN_FLIGHT.pop()
    handle._thread.join()
    unreported = None if handle._error is None or handle._reported else str(handle._error)
    verdicts: list[object] = [unreported]
    if dist.is_initialized():
        verdicts = comm.all_gather_objects(unreported, comm.default_group(process_group))
    if failed := [str(v) for v in verdicts if v is not None]:
        raise CheckpointError(f"the previous background save failed: {failed[0]}")


def start(
    path: str | os.PathLike[str],
    pieces: Pieces,
    objects: Mapping[str, object],
    process_group: dist.ProcessGroup | None,
    *,
    max_box_numel: int | None,
) -> SaveHandle:
    """Copy ``pieces`` and ``objects``, plan their save to ``path``, and write them behind
    training; collective, as :func:`~zero_functional.checkpoint.storage.save_pieces`.

    Raises:
        CheckpointError: On every rank, before anything is written: a refused ``path``, a
            piece that does not fit, copies of one key that disagree.

    Example:
        >>> import os, tempfile, torch
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> handle = start(path, {"w": ((2,), torch.float32, [(0, 2, torch.ones(2))])}, {}, None,
        ...                max_box_numel=None)
        >>> handle.wait(); sorted(os.listdir(path))[:2]
        ['.metadata', '.metadata.crc32']
    """
    settle(process_group)
    copied, events = copy_pieces(pieces, _STAGED)
    owned = copy.deepcopy(dict(objects))
    with storage.AtomicSave(path, process_group) as save:
        planner, writer = storage.dcp_parts(save.tmp, copied, max_box_numel)
        plan, metadata = _plan(owned, planner, writer, process_group)
        save.hand_off()  # the thread commits; the ranks agree through files
    rank = comm.rank_or_zero(process_group)
    world = comm.group_size(comm.default_group(process_group)) if dist.is_initialized() else 1
    handle = SaveHandle(_Job(rank, world, save, planner, writer, plan, metadata, events))
    _IN_FLIGHT.append(handle)
    return handle
