"""In-memory snapshots: each rank's share in its node's memory, a copy on another node, read back.

:func:`start` copies a rank's share on the caller's thread (as a background save does), then a
thread writes it into ``step-<S>/`` of the node's snapshot directory (a memory file system by
default), sends it to its partner (:func:`~.shares.partners`) and writes the copy it gets from
the rank whose partner it is, over a gloo group of its own (:class:`Peers`); the ranks' threads
then agree on the verdict, and once every share of step ``S`` is on two ranks, each node's first
rank removes its older snapshots. :func:`newest` finds the newest complete snapshot across the
nodes, fetches the shares a node lacks from a node that has them, and gives a directory that
:func:`zero_functional.checkpoint.load` reads (:func:`~.shares.assemble`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import operator
import os
import shutil
import socket
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from zero_functional import comm
from zero_functional.checkpoint import atomic_dir, background, shares, storage
from zero_functional.checkpoint.shares import Key
from zero_functional.checkpoint.storage import CheckpointError, Pieces
from zero_functional.comm import ProcessGroup
from zero_functional.core._validate import by_rank

MEMORY_ROOT = "/dev/shm"
"""Where the default snapshot directory goes (a memory file system on Linux); elsewhere the
temporary directory."""
_SKIP = "skip"  # what a rank that skipped a call gives the call's agreement


def default_snapshot_dir(env: Mapping[str, str] | None = None) -> str:
    """``/dev/shm/zero_functional-<run id>``, the run id torchrun's (``TORCHELASTIC_RUN_ID``) or
    SLURM's job id: every node's ranks, and their restarts, find the same directory.

    Raises:
        ValueError: No run id in the environment: pass ``snapshot_dir``.

    Example:
        >>> default_snapshot_dir({"TORCHELASTIC_RUN_ID": "job7"})
        '/dev/shm/zero_functional-job7'
    """
    env = os.environ if env is None else env
    run = env.get("TORCHELASTIC_RUN_ID") or env.get("SLURM_JOB_ID")
    if not run or run == "none":
        raise ValueError(
            "snapshots need a directory that outlives the workers: pass snapshot_dir=, or run "
            "under torchrun with --rdzv-id (TORCHELASTIC_RUN_ID) or SLURM (SLURM_JOB_ID)"
        )
    root = MEMORY_ROOT if os.path.isdir(MEMORY_ROOT) else tempfile.gettempdir()
    return os.path.join(root, f"zero_functional-{run}")


@dataclass(frozen=True)
class Peers:
    """The ranks of a snapshot as nodes: this rank's place (``rank`` of ``world_size``), each
    rank's node (its host and snapshot directory), the rank it sends its copy to and those it
    keeps copies of, and a gloo group of the same ranks for the copies (``None`` at one rank)."""

    group: ProcessGroup | None
    directory: str
    rank: int
    world_size: int
    nodes: tuple[int, ...]
    partner: int | None
    sources: tuple[int, ...]
    copies: ProcessGroup | None
    world: object = None  # the default group they were made in

    @property
    def leader(self) -> bool:
        """Whether this rank is the first of its node (it cleans and fetches for the node)."""
        return self.nodes.index(self.nodes[self.rank]) == self.rank

    def leaders(self) -> list[int]:
        """The first rank of each node, by node."""
        return [self.nodes.index(n) for n in sorted(set(self.nodes))]


_PEERS: dict[str, Peers] = {}
_REAL: dict[str, str] = {}  # an absolute directory as given: its real path


def peers(group: ProcessGroup | None, directory: str) -> Peers:
    """This rank's :class:`Peers` over ``group`` (default: the world) for ``directory``; made
    once per group and directory, collectively (every rank of ``group`` calls it).

    Example:
        >>> import tempfile
        >>> alone = peers(group, tempfile.mkdtemp())
        >>> alone.rank, alone.partner, alone.copies, alone.leader
        (0, None, None, True)
    """
    if (real := _REAL.get(directory)) is None:  # an absolute path resolved once per process
        real = os.path.realpath(directory)
        if os.path.isabs(directory):
            _REAL[directory] = real
    directory = real
    made = _PEERS.get(directory)
    if made is not None and made.group is group and made.world is dist.group.WORLD:
        return made  # the same world: a new one (a process that made another) makes new peers
    rank, world = comm.rank_or_zero(group), comm.group_size(comm.default_group(group))
    where = (socket.gethostname(), directory)
    seen = cast(list[tuple[str, str]], comm.all_gather_objects(where, comm.default_group(group)))
    ids: dict[tuple[str, str], int] = {}
    nodes = tuple(ids.setdefault(where, len(ids)) for where in seen)  # by their first rank
    partner = shares.partners(nodes)
    copies = None
    if world > 1 and (copies := comm.host_group(comm.default_group(group))) is None:
        raise RuntimeError("snapshots need torch >= 2.1: a group of their own for the copies")
    made = Peers(
        group,
        directory,
        rank,
        world,
        nodes,
        partner[rank],
        tuple(q for q, p in enumerate(partner) if p == rank),
        copies,
        dist.group.WORLD,
    )
    _PEERS[directory] = made
    return made


def _read_files(directory: str) -> dict[str, bytes]:
    return {
        name: open(os.path.join(directory, name), "rb").read()  # noqa: SIM115 - read whole
        for name in sorted(os.listdir(directory))
    }


def _write_files(directory: str, files: Mapping[str, bytes | memoryview]) -> None:
    """Write ``files`` into a temporary beside ``directory`` and rename it into place."""
    tmp = os.path.join(os.path.dirname(directory), f".{os.path.basename(directory)}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for name, raw in files.items():
        with open(os.path.join(tmp, name), "wb") as f:
            f.write(raw)
    _into_place(tmp, directory)


def _into_place(tmp: str, directory: str) -> None:
    """Rename the written ``tmp`` onto ``directory``, an older one there removed first."""
    if os.path.exists(directory):
        shutil.rmtree(directory)
    os.rename(tmp, directory)


def _packed(files: Mapping[str, bytes] | None) -> Tensor:
    """A share's files (``None``: this rank has none to send) as one byte tensor: a JSON head
    of the names and sizes, its length first, then the files' bytes (each copied once)."""
    names = [] if files is None else [[n, len(b)] for n, b in files.items()]
    head = json.dumps({"ok": files is not None, "files": names}).encode()
    out = bytearray(8 + len(head) + sum(len(b) for b in (files or {}).values()))
    out[:8] = len(head).to_bytes(8, "little")
    out[8 : 8 + len(head)] = head
    at, view = 8 + len(head), memoryview(out)
    for raw in (files or {}).values():
        view[at : at + len(raw)] = raw
        at += len(raw)
    return torch.frombuffer(out, dtype=torch.uint8)  # shares the bytes: no copy


def _unpacked(payload: Tensor) -> dict[str, memoryview] | None:
    """What :func:`_packed` packed (``None``: the sender had no share), each file a view of
    one copy of ``payload``'s bytes."""
    raw = memoryview(comm.bytes_of(payload))
    n_head = int.from_bytes(raw[:8], "little")
    head = json.loads(bytes(raw[8 : 8 + n_head]))
    if not head["ok"]:
        return None
    out, at = {}, 8 + n_head
    for name, size in head["files"]:
        out[name] = raw[at : at + size]
        at += size
    return out


@dataclass(frozen=True)
class _Job:
    """A snapshot as its thread takes it: ``pieces`` copied on the caller's thread (with the
    events that say when their device copies land); ``later`` lays out the rest, which the
    thread copies first (their device's work until the call, ``ready``, waited for) while the
    optimizer's next update waits for it."""

    peers: Peers
    steps: Callable[[], int | None]  # this rank's count (None: it cannot tell), by the thread
    pieces: Pieces
    objects: dict[str, Any]
    max_box_numel: int | None
    copied: list[torch.cuda.Event]
    later: Callable[[], tuple[Pieces, dict[str, Any]]] | None
    ready: list[torch.cuda.Event]


class SnapshotHandle:
    """A snapshot being taken behind training (what ``checkpoint.snapshot`` returns). Once
    :meth:`wait` returns, ``step`` is the step it holds, or ``None`` with ``skipped`` true: a rank
    was still taking the previous one and every rank skipped this call.

    Example:
        >>> import tempfile, torch, zero_functional.checkpoint as ckpt
        >>> where, model = tempfile.mkdtemp(), torch.nn.Linear(2, 2)
        >>> handle = ckpt.snapshot(model=model, step=1, snapshot_dir=where)
        >>> handle.wait(); handle.step, handle.skipped
        (1, False)
        >>> ckpt.snapshot(model=model, step=2, snapshot_dir=where, when_busy="wait").wait()
    """

    def __init__(self, peers_: Peers, copies: bool) -> None:
        self.directory, self._rank = peers_.directory, peers_.rank
        self.step: int | None = None  # once taken
        self.skipped = False  # once the ranks agreed to skip it (some rank's thread was busy)
        self._error: CheckpointError | None = None
        self._reported = False
        self._ended, self._copied = threading.Event(), threading.Event()
        if not copies:
            self._copied.set()  # a skipped call holds nothing still
        self.hold: RemovableHandle | None = None  # what holds the next update for the copy
        self.held_s = 0.0  # how long the next update waited for the copy

    def _run(self, peers_: Peers, job: _Job | None) -> None:
        """The thread, for one call: copy ``job`` (``None``: this rank skipped the call) while
        the update waits, agree on the call with the other ranks, and take it if they all do."""
        mine: Answer = _SKIP  # what this rank gives the call's agreement
        try:
            try:
                if job is not None:
                    job, mine = _copy(job)
            except BaseException as e:  # noqa: BLE001 - agreed on, every rank raises
                mine = _Failed(f"{type(e).__name__}: {e}")
            finally:
                self._copied.set()  # the update held for it goes on (a failure said later)
            step = _agreed_step(peers_, mine)
            if step is not None:
                assert job is not None  # every rank took the call: this one too
                self.step = _take(job, step)
            self.skipped = step is None
        except CheckpointError as e:
            self._error = e
        except BaseException as e:  # noqa: BLE001 - surfaced on wait(), never lost in the thread
            self._error = CheckpointError(
                f"snapshot in {self.directory} failed: rank {self._rank}: {type(e).__name__}: {e}"
            )
        finally:
            self._ended.set()

    def done(self) -> bool:
        """Whether the snapshot has ended: complete on both copies, skipped, or failed."""
        return self._ended.is_set()

    def copied(self) -> None:
        """Wait until the thread has copied what it copies (what the next update waits for)."""
        self._copied.wait()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the snapshot is complete on both copies or skipped (:attr:`skipped`), at
        most ``timeout`` seconds; raise what it failed with (the same on every rank).

        Raises:
            CheckpointError: It failed, naming each rank's cause; the previous one is kept.
            TimeoutError: ``timeout`` passed with the snapshot still being taken.
        """
        if not self._ended.wait(timeout):
            raise TimeoutError(f"rank {self._rank}: the snapshot is still being taken")
        if self._error is not None:
            self._reported = True
            raise self._error


_IN_FLIGHT: list[SnapshotHandle] = []  # this process's calls not yet settled, in order
_WORKERS: dict[int, comm.InOrder] = {}  # by process: a forked child makes its own


def _worker() -> comm.InOrder:
    """This process's snapshot thread, started at its first snapshot and kept."""
    if (worker := _WORKERS.get(os.getpid())) is None:
        _WORKERS.clear()
        worker = _WORKERS[os.getpid()] = comm.InOrder("zero_functional-snapshots")
    return worker


_STAGED: dict[tuple[str, int, int], Tensor] = {}  # the last snapshot's host copies: the caller's
_STAGED_LATER: dict[tuple[str, int, int], Tensor] = {}  # and the thread's


def copied() -> None:
    """Wait until this process's snapshot being taken, if any, has copied what it holds (what
    may then change: a load writes the model and the optimizer).

    Example:
        >>> copied()  # none in flight: returns at once
    """
    for handle in _IN_FLIGHT:
        handle.copied()


def settle() -> None:
    """Wait for this process's snapshots being taken, if any, and raise a failure no
    :meth:`SnapshotHandle.wait` raised (every rank's thread agreed on it: every rank raises).

    Example:
        >>> settle()  # none in flight: returns at once
    """
    for handle in _IN_FLIGHT:
        handle._ended.wait()
    _reap()


def busy() -> bool:
    """Whether this process's snapshot thread is still taking (or agreeing on) an earlier call;
    raises the failure of one that ended, as :func:`settle` does.

    Example:
        >>> busy()
        False
    """
    _reap()
    return bool(_IN_FLIGHT)


def _reap() -> None:
    """Drop the calls that ended, in order; raise the first failure no one was told of."""
    failed = None
    while _IN_FLIGHT and _IN_FLIGHT[0].done():
        handle = _IN_FLIGHT.pop(0)
        if handle.hold is not None:
            handle.hold.remove()
        if failed is None and handle._error is not None and not handle._reported:
            failed = handle._error
    if failed is not None:
        raise CheckpointError(f"the previous snapshot failed: {failed}")


Hold = Callable[[Callable[[], None]], RemovableHandle]
"""Registers a callback run before the optimizer next changes what a snapshot copies."""


class Later(NamedTuple):
    """The optimizer's part of a share, which only its next update changes: ``layout`` gives
    its pieces and objects (run by the thread), ``hold`` makes that update wait for the thread's
    copy, and ``devices`` are where its tensors are (their streams' work until the call is
    awaited first)."""

    layout: Callable[[], tuple[Pieces, dict[str, Any]]]
    hold: Hold
    devices: Collection[torch.device]


def skip(peers_: Peers) -> SnapshotHandle:
    """Skip this call (this rank's thread is :func:`busy`): its thread takes part in the call's
    agreement with nothing, and every rank skips it.

    Raises:
        CheckpointError: A previous snapshot failed.

    Example:
        >>> import tempfile
        >>> handle = skip(peers(group, tempfile.mkdtemp()))
        >>> handle.wait(); handle.skipped, handle.step
        (True, None)
    """
    _reap()
    handle = SnapshotHandle(peers_, copies=False)
    _IN_FLIGHT.append(handle)
    _worker().put(functools.partial(handle._run, peers_, None))
    return handle


def start(
    pieces: Pieces,
    objects: Mapping[str, object],
    peers_: Peers,
    steps: Callable[[], int | None],
    max_box_numel: int | None,
    later: Later | None = None,
) -> SnapshotHandle:
    """Copy ``pieces`` and ``objects`` now and take the snapshot in a thread, which first lays
    out and copies ``later`` (:class:`Later`) while the optimizer's next update waits for it.
    ``steps`` counts the steps taken (called by the thread: the ranks agree on one). Every
    rank's call is one snapshot: if some rank :func:`skip` ped it, no rank takes it.

    Raises:
        CheckpointError: A previous snapshot failed (:func:`settle`).
    """
    settle()
    copied, events = background.copy_pieces(pieces, _STAGED)
    devices = later.devices if later is not None else ()
    ready = [torch.cuda.current_stream(d).record_event() for d in devices]
    owned = copy.deepcopy(dict(objects))
    layout = later.layout if later is not None else None
    job = _Job(peers_, steps, copied, owned, max_box_numel, events, layout, ready)
    handle = SnapshotHandle(peers_, copies=True)

    def gate() -> None:  # once: the next update waits for the copy, the later ones do not
        start = time.perf_counter()
        handle.copied()
        handle.held_s = time.perf_counter() - start
        if handle.hold is not None:
            handle.hold.remove()

    if later is not None:
        handle.hold = later.hold(gate)
    _IN_FLIGHT.append(handle)
    # last, once its hold is registered: a queue, no thread start to wait on
    _worker().put(functools.partial(handle._run, peers_, job))
    return handle


class _Failed(NamedTuple):
    """What a rank that could not copy its share gives the call's agreement."""

    why: str


Answer = int | None | str | _Failed  # a rank's answer to a call: a count, None, _SKIP, a failure
_CODES: dict[str | None, int] = {None: -1, _SKIP: -2}  # a count is itself (>= 0); a failure -3


def _agree_call(peers_: Peers, mine: Answer) -> list[Answer]:
    """Every rank's answer to a call (a count, ``None``, :data:`_SKIP` or a :class:`_Failed`,
    whose reason is left out), as one integer each: a call's agreement costs one gather of a few
    bytes (it runs for every call, skipped or not)."""
    if peers_.copies is None:
        return [mine]
    code = -3 if isinstance(mine, _Failed) else mine if isinstance(mine, int) else _CODES[mine]
    every = comm.all_gather_scalar(torch.tensor(code, dtype=torch.int64), peers_.copies)
    answers = {c: a for a, c in _CODES.items()}
    return [c if c >= 0 else _Failed("") if c == -3 else answers[c] for c in every.tolist()]


def _agree(peers_: Peers, mine: object) -> list[Any]:
    """Every rank's ``mine`` (over the copies' group: this runs in the thread)."""
    if peers_.copies is None:
        return [mine]
    return comm.all_gather_objects(mine, peers_.copies)


def _copy(job: _Job) -> tuple[_Job, int | None]:
    """The thread, while the optimizer's next update waits: the device's work until the call
    awaited, the optimizer's part laid out and copied; the whole job and this rank's count."""
    for event in job.ready:
        event.synchronize()  # the device's work until the call, the step's too
    rest, objects = job.later() if job.later is not None else ({}, {})
    count = job.steps()
    count = None if count is None else operator.index(count)  # an int to agree on, or raise
    if count is not None and count < 0:
        raise ValueError(f"the optimizer's count of steps is {count}: pass step=")
    later, events = background.copy_pieces(rest, _STAGED_LATER)
    for event in [*job.copied, *events]:
        event.synchronize()
    pieces, objects = {**job.pieces, **later}, {**job.objects, **objects}
    return dataclasses.replace(job, pieces=pieces, objects=objects, later=None), count


def _agreed_step(p: Peers, mine: Answer) -> int | None:
    """The thread: the step every rank takes this call at (``mine``: this rank's answer), or
    ``None`` if some rank skipped it.

    Raises:
        CheckpointError: A rank could not copy its share (each rank's reason named), or the
            ranks' counts differ.
    """
    steps = _agree_call(p, mine)
    if any(isinstance(v, _Failed) for v in steps):  # every rank knows: the reasons gathered
        why = _agree(p, mine.why if isinstance(mine, _Failed) else None)
        failed = [(r, str(v)) for r, v in enumerate(why) if v is not None]
        raise CheckpointError(f"snapshot failed: cannot copy the share: {by_rank(failed)}")
    if _SKIP in steps:
        return None
    known = sorted({s for s in steps if isinstance(s, int)})
    if len(known) != 1:
        told = "no rank could tell" if not known else f"the ranks passed {known}"
        raise CheckpointError(
            f"snapshot failed: the ranks must agree on its step, and {told}: pass step="
        )
    return known[0]


def _take(job: _Job, step: int) -> int:
    """The thread, once the ranks agreed on ``step``: write this rank's share, swap copies with
    the partner ranks, agree on the verdict; the first rank of each node then drops the older
    snapshots. Returns the step."""
    p = job.peers
    step_dir = os.path.join(p.directory, shares.step_name(step))
    files, failure = None, None
    try:
        os.makedirs(step_dir, exist_ok=True)
        target = os.path.join(step_dir, shares.share_name(p.rank, p.world_size))
        tmp = os.path.join(step_dir, f".{shares.share_name(p.rank, p.world_size)}-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        storage.write_alone(tmp, job.pieces, {**job.objects}, job.max_box_numel)
        shares.seal(tmp, p.rank, p.world_size)
        files = _read_files(tmp) if p.partner is not None else None
        _into_place(tmp, target)
    except (OSError, CheckpointError) as e:
        failure = f"cannot write its share into {step_dir}: {atomic_dir.os_error(e) or e}"
    if p.copies is not None:
        failure = _swap_copies(p, step_dir, files if failure is None else None) or failure
    verdicts = _agree(p, failure)
    if failed := [(r, str(v)) for r, v in enumerate(verdicts) if v is not None]:
        raise CheckpointError(f"snapshot of step {step} failed: {by_rank(failed)}")
    if p.leader:
        _remove_steps(p.directory, keep=lambda s: s >= step)
    return step


def _swap_copies(p: Peers, step_dir: str, mine: dict[str, bytes] | None) -> str | None:
    """Send this rank's share to its partner and keep the copies sent to it; why that
    failed, or ``None``."""
    assert p.copies is not None and p.partner is not None
    failure = None
    arrived = comm.swap_bytes({p.partner: _packed(mine)}, p.sources, p.copies)
    for q, payload in arrived.items():
        if (got := _unpacked(payload)) is None:
            continue  # rank q failed to write its share: its failure is its own to report
        target = os.path.join(step_dir, shares.share_name(q, p.world_size, copy=True))
        try:  # checked when read: a restore skips a copy damaged since (or on the way)
            _write_files(target, got)
        except OSError as e:
            failure = f"cannot keep the copy of rank {q}'s share in {step_dir}: {e}"
    return failure


def _remove_steps(directory: str, keep: Callable[[int], bool]) -> None:
    """Remove the snapshot directories whose step ``keep`` rejects (a node's first rank)."""
    for name in os.listdir(directory) if os.path.isdir(directory) else ():
        if (m := shares.STEP_RE.match(name)) is not None and not keep(int(m[1])):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


@dataclass(frozen=True)
class Found:
    """The snapshot a restore reads: its step and world size, and the directory that reads
    as a checkpoint of it (its shares linked, their indexes merged)."""

    step: int
    world_size: int
    view: str


def _warn(line: str) -> None:
    warnings.warn(line, RuntimeWarning, stacklevel=4)  # at the caller of restore


@contextlib.contextmanager
def newest(
    group: ProcessGroup | None, directory: str, min_step: int | None
) -> Iterator[Found | None]:
    """The newest snapshot every share of which some node holds (at ``min_step`` or later),
    fetched where a node lacks a share and assembled for reading; ``None`` if there is none.
    Collective. Leaving it removes the reading directory and, on each node, every other
    snapshot (the one read stays until a newer one is complete)."""
    settle()
    p = peers(group, directory)
    held: dict[Key, dict[int, str]] = {}
    if p.leader:
        held, skipped = shares.inventory(p.directory)
        for line in skipped:
            _warn(f"skipping a snapshot share: {line}; its other copy is used if there is one")
    everyone = cast(list[dict[Key, dict[int, str]]], _all(p, held))
    chosen = shares.newest_complete([everyone[r] for r in p.leaders()], min_step)
    if chosen is None:
        yield None
        return
    step, world = chosen
    fetched = cast(list[dict[int, str]], _all(p, _fetch(p, everyone, chosen)))
    leader = p.nodes.index(p.nodes[p.rank])  # whose inventory and fetches are this node's
    local = {**everyone[leader].get(chosen, {}), **fetched[leader]}
    view = os.path.join(p.directory, f".restore-{p.rank}-{os.getpid()}")
    shutil.rmtree(view, ignore_errors=True)
    try:
        shares.assemble(view, local)
        yield Found(step, world, view)
    finally:
        shutil.rmtree(view, ignore_errors=True)
    _all(p, None)
    if p.leader:
        _remove_steps(p.directory, keep=lambda s: s == step)


def _all(p: Peers, mine: object) -> list[object]:
    return comm.all_gather_objects(mine, comm.default_group(p.group))


def _fetch(p: Peers, everyone: list[dict[Key, dict[int, str]]], chosen: Key) -> dict[int, str]:
    """Send and receive the shares some node lacks (its first rank receives each from the first
    node that has it), in one order on every rank; the paths this rank received into."""
    step, world = chosen
    leaders = p.leaders()
    moves = []
    for leader in leaders:
        have = everyone[leader].get(chosen, {})
        for q in range(world):
            if q not in have:
                holder = next(r for r in leaders if q in everyone[r].get(chosen, {}))
                moves.append((holder, leader, q))
    got: dict[int, str] = {}
    for holder, receiver, q in moves:  # one at a time: a fetch is rare
        assert p.copies is not None
        files = _read_files(everyone[holder][chosen][q]) if p.rank == holder else None
        send = {receiver: _packed(files)} if p.rank == holder else {}
        received = comm.swap_bytes(send, [holder] if p.rank == receiver else [], p.copies)
        if p.rank != receiver:
            continue
        step_dir = os.path.join(p.directory, shares.step_name(step))
        target = os.path.join(step_dir, shares.share_name(q, world, copy=True))
        os.makedirs(step_dir, exist_ok=True)
        if (files_got := _unpacked(received[holder])) is not None:
            _write_files(target, files_got)
        if (why := shares.check_share(target)) is not None:
            raise CheckpointError(f"rank {q}'s share fetched from rank {holder}: {why}")
        got[q] = target
    return got


def remove(p: Peers) -> None:
    """Remove the node's snapshot directory once every rank's snapshot in flight is done (the
    first rank of each node); collective."""
    with contextlib.suppress(CheckpointError):  # a failed one leaves nothing to keep
        settle()
    _all(p, None)
    if p.leader:
        shutil.rmtree(p.directory, ignore_errors=True)
    _all(p, None)
