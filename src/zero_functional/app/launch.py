"""The one launcher: start N ranks of a gloo group on 127.0.0.1, run a function on each, collect
the results, and name what went wrong (``train``, the tests, the benchmarks and the notebooks all
use :func:`run_ranks`).

A rank's result or traceback comes back pickled over its own pipe; a rank that dies, is stopped
(SIGSTOP) or hangs is named, the cause first (:class:`LaunchError`). SIGTERM to the launcher
stops every rank first, then raises :class:`Terminated`; a rank whose launcher dies is killed
(Linux's ``PR_SET_PDEATHSIG``, else :func:`exit_when_orphaned`). A rank leaves with ``os._exit``
after a barrier: finalizing a spawned interpreter with gloo's threads alive can abort it
(``torch.distributed.nn.functional`` binds ``group.WORLD`` as a default argument, so each rank
imports it before it joins). Ranks start with ``TORCH_CPP_LOG_LEVEL=ERROR`` unless it is set: a
dead peer makes c10d log a C++ stack.
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing import connection
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Literal, TypeVar, cast

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Store

R = TypeVar("R")
StartMethod = Literal["spawn", "fork", "forkserver"]

DEFAULT_TIMEOUT_S = 120.0  # run_ranks's wait for every rank's result
GRACE_S = 1.0  # the others' time to report after the first failure, before they are killed
REAP_S = 5.0  # to reap a rank whose files are closed (it is exiting) before its code is read
POLL_S = 1.0  # between looks at whether a rank's process is stopped (SIGSTOP)
SETTLE_S = 0.25  # after the first rank that raised, for a death behind it to show
EXIT_WAIT_S = 30.0  # for a rank that returned to leave its group and exit
TERM_GRACE_S = 2.0  # between SIGTERM and SIGKILL to a rank being stopped
CHILD_ENV = {"TORCH_CPP_LOG_LEVEL": "ERROR"}  # set for the ranks unless set (module doc)
STOPPED_S = 5.0  # seen stopped this long without a break, a rank is named
PR_SET_PDEATHSIG = 1  # prctl's option: the signal this process gets when its parent dies


@dataclass(frozen=True, slots=True)
class RankFailure:
    """What went wrong on one rank: ``reason`` ends a sentence that starts with ``rank N``
    (``was killed by signal SIGKILL``), ``traceback`` is its own if it raised, and ``primary``
    says whether it came first (several if seen together) or is most likely a consequence."""

    rank: int
    reason: str
    traceback: str = ""
    primary: bool = True

    def __str__(self) -> str:
        return f"rank {self.rank} {self.reason}"


class LaunchError(RuntimeError):
    """One or more ranks failed; ``failures`` says which and how, the first failure first. The
    message has a line per failed rank, then the tracebacks of the primary ones.

    Example:
        >>> LaunchError([RankFailure(0, "was stopped after rank 1 failed", primary=False),
        ...              RankFailure(1, "was killed by signal SIGKILL")]).headline
        'rank 1 was killed by signal SIGKILL'
    """

    def __init__(
        self, failures: Sequence[RankFailure], results: Mapping[int, object] | None = None
    ) -> None:
        self.failures = tuple(sorted(failures, key=lambda f: (not f.primary, f.rank)))
        self.results: dict[int, object] = dict(results or {})
        """What the ranks that returned before the failure returned (a failed exit included)."""
        lines = [str(f) for f in self.failures]
        lines += [
            f"--- rank {f.rank}:\n{f.traceback.rstrip()}"
            for f in self.failures
            if f.primary and f.traceback
        ]
        super().__init__("\n".join(lines))

    @property
    def headline(self) -> str:
        """The first failure, in one line."""
        return str(self.failures[0])


def blame(
    died: Sequence[RankFailure], raised: Sequence[RankFailure], first: RankFailure | None
) -> list[RankFailure]:
    """Failures seen together (``raised`` in the order the ranks raised), the first primary and
    the rest its consequences. A death comes before what was raised at the same moment: a dead
    peer breaks the others' collectives, a rank that raises reports before it leaves.

    Example:
        >>> [str(f) for f in blame([], [RankFailure(1, "raised A"), RankFailure(0, "raised B")], None)]
        ['rank 1 raised A', 'rank 0 raised B after rank 1 failed']
    """
    primary = (list(died) or list(raised[:1])) if first is None else []
    first = first or primary[0]
    return [
        f
        if f in primary
        else RankFailure(f.rank, f"{f.reason} after rank {first.rank} failed", f.traceback, False)
        for f in [*died, *raised]
    ]


def last_line(text: str, limit: int = 300) -> str:
    """The last line of a traceback (the exception), cut to ``limit`` characters.

    Example:
        >>> last_line("Traceback (most recent call last):\\nValueError: boom\\n")
        'ValueError: boom'
    """
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return cut(lines[-1] if lines else "an exception", limit)


def cut(text: str, limit: int) -> str:
    """``text``, cut to ``limit`` characters (the last three an ellipsis)."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_seconds(seconds: float) -> str:
    """A duration for a message: whole seconds from 10 s on, three digits below.

    Example:
        >>> format_seconds(600.0), format_seconds(12.7), format_seconds(0.5), format_seconds(1.25)
        ('600 s', '13 s', '0.5 s', '1.25 s')
    """
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.3g} s"


def describe_exit(exitcode: int) -> str:
    """How a process ended, from ``multiprocessing.Process.exitcode``.

    Example:
        >>> describe_exit(-9), describe_exit(3)
        ('was killed by signal SIGKILL', 'exited with code 3')
    """
    if exitcode >= 0:
        return f"exited with code {exitcode}"
    try:
        return f"was killed by signal {signal.Signals(-exitcode).name}"
    except ValueError:
        return f"was killed by signal {-exitcode}"


def process_state(pid: int) -> str:
    """The state letter of process ``pid`` in ``/proc`` (``R``, ``S``, ``T``: stopped, ...), or
    ``""`` where it is gone or there is no ``/proc``.

    Example:
        >>> process_state(os.getpid()) in ("R", "")
        True
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            # the name, in parentheses, may hold spaces and parentheses: the state follows the last
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


@dataclass
class StoppedRanks:
    """Since when each rank's process has been seen stopped (``T`` in ``/proc/<pid>/stat``; a
    debugger's ``t`` is left alone), naming it after ``after_s`` without a break, so that a job
    suspended as a whole is not taken for a failure. Without ``/proc`` the timeout applies.

    Example:
        >>> watch = StoppedRanks(after_s=5.0, state=lambda pid: "T")
        >>> watch.reason(1, 1234, now=100.0) is None  # first seen stopped
        True
        >>> watch.reason(1, 1234, now=105.0)
        'stopped reporting: its process was stopped (state T: SIGSTOP or SIGTSTP) 5 s ago and has not resumed'
    """

    after_s: float = STOPPED_S
    state: Callable[[int], str] = process_state
    since: dict[int, float] = field(default_factory=dict)

    def reason(self, rank: int, pid: int | None, now: float | None = None) -> str | None:
        """Why ``rank`` (process ``pid``) counts as failed, once stopped for ``after_s``; ``None``
        before, or while it runs (which starts the count again)."""
        if pid is None or self.state(pid) != "T":
            self.since.pop(rank, None)
            return None
        now = time.monotonic() if now is None else now
        since = self.since.setdefault(rank, now)
        if now - since < self.after_s:
            return None
        return (
            "stopped reporting: its process was stopped (state T: SIGSTOP or SIGTSTP) "
            f"{format_seconds(now - since)} ago and has not resumed"
        )


class Terminated(SystemExit):
    """The launcher got SIGTERM while its ranks ran; it stopped every rank, then raised this: exit
    code 143 (128 + SIGTERM), as SIGTERM would have ended it, with no rank left behind.

    Example:
        >>> e = Terminated(2)
        >>> e.code, e.message
        (143, 'stopped by SIGTERM; its 2 ranks were stopped too')
    """

    def __init__(self, ranks: int) -> None:
        super().__init__(128 + signal.SIGTERM)
        self.message = (
            f"stopped by SIGTERM; its {ranks} rank{'s' if ranks != 1 else ''} were stopped too"
        )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now (the kernel's pick).

    Example:
        >>> 0 < free_port() < 2**16
        True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@contextmanager
def process_group(
    backend: str = "gloo",
    *,
    rank: int | None = None,
    world_size: int | None = None,
    timeout_s: float | None = None,
    store: Store | None = None,
) -> Iterator[None]:
    """Join the default process group for the block (``rank`` and ``world_size`` None: from the
    environment, as torchrun sets it; ``store``: where the ranks met, else ``MASTER_ADDR`` and
    ``MASTER_PORT``); leave it cleanly after: on a clean exit every rank waits in a barrier (in
    gloo it also waits for pending collectives), then the group is destroyed; after an exception,
    without the barrier, which the others may never reach.

    Example (one rank; :func:`run_ranks` sets ``MASTER_ADDR`` and ``MASTER_PORT`` for its ranks):
        >>> import os, torch
        >>> os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        >>> with process_group("gloo", rank=0, world_size=1, timeout_s=30):
        ...     torch.distributed.all_reduce(torch.ones(2))
        >>> torch.distributed.is_initialized()
        False
    """
    import torch.distributed as dist

    # Imported before the group exists, so that its `group=group.WORLD` defaults are None and
    # do not keep the default group alive after destroy_process_group (see the module doc).
    import torch.distributed.nn.functional  # noqa: F401

    dist.init_process_group(
        backend,
        rank=-1 if rank is None else rank,
        world_size=-1 if world_size is None else world_size,
        timeout=None if timeout_s is None else timedelta(seconds=timeout_s),
        store=store,
    )
    try:
        yield
        gc.collect()  # objects in reference cycles (modules with hooks, optimizers) hold the group
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _failure() -> bytes:
    return pickle.dumps((False, traceback.format_exc(), time.monotonic()))


def _die_with_parent(parent: int | None) -> None:
    """Have the kernel SIGKILL this rank when its launcher, process ``parent``, dies (Linux's
    ``PR_SET_PDEATHSIG``: no thread of ours must run for it, so it holds under load), and kill it
    now if the launcher died before the call. ``None`` (a forkserver's child, whose parent is the
    server) or no such call: :func:`exit_when_orphaned` alone watches."""
    if parent is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    zero = ctypes.c_ulong(0)
    if prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL), zero, zero, zero) != 0:
        return
    if os.getppid() != parent:  # the launcher died first: no signal will come
        os.kill(os.getpid(), signal.SIGKILL)


def _rank_main(
    rank: int,
    parent: int | None,
    world_size: int,
    port: int,
    backend: str,
    pg_timeout_s: float,
    num_threads: int | None,
    job: bytes | tuple[Callable[..., object], tuple[object, ...]],
    report: Connection,
) -> None:
    """The body of each rank's process, ended with ``os._exit``. ``job``, ``(fn, args)``, comes
    pickled (but when forked), to be unpickled once the launcher's death is watched: importing
    ``fn``'s module (torch) takes seconds. The report goes out while the rank is still in the
    group: the reports of peers whose collectives fail once it leaves must not overtake the one
    that explains why."""
    _die_with_parent(parent)  # the launcher killed (any signal): this rank stops at once
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the launcher's handler: ends a rank
    exit_when_orphaned(report)  # where the kernel cannot: a thread that watches the pipe
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    code, sent, returned = 1, False, False
    try:
        try:
            fn, args = pickle.loads(job) if isinstance(job, bytes) else job
            import torch

            if num_threads is not None:
                torch.set_num_threads(num_threads)  # the ranks share the machine's cores
            with process_group(backend, rank=rank, world_size=world_size, timeout_s=pg_timeout_s):
                try:
                    data = pickle.dumps((True, fn(rank, world_size, *args), time.monotonic()))
                except BaseException:  # assertions and Ctrl-C included
                    report.send_bytes(_failure())
                    sent = True
                    raise  # out of the group without the barrier: the others may never reach it
                report.send_bytes(data)
                sent = returned = True
            code = 0
        except BaseException:
            if not sent:  # joining the group failed
                report.send_bytes(_failure())
            elif returned:  # leaving it failed: why, and the CollectiveErrors that broke it
                comm = sys.modules.get("zero_functional.comm")  # imported if its calls were used
                errors: list[str] = comm.failures() if comm is not None else []
                report.send_bytes(pickle.dumps(("exit", traceback.format_exc(), errors)))
        report.close()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)  # see the module doc: no interpreter finalization with gloo threads alive


# ----------------------------------------------------------------------------- the launcher


@dataclass
class _Rank:
    rank: int
    process: BaseProcess
    conn: Connection | None  # None once closed
    state: Literal["running", "returned", "failed"] = "running"
    value: object = None


@dataclass
class _SigtermGuard:
    """Armed, SIGTERM raises :class:`Terminated` in the main thread; disarmed (the ranks are
    being stopped), it is only noted, for the launcher to raise after."""

    ranks: Sequence[_Rank]
    armed: bool = False
    received: bool = False
    previous: object = None  # the handler it replaced, if it installed its own

    def __enter__(self) -> _SigtermGuard:
        # not over a handler someone installed, nor outside the main thread (Python refuses)
        if (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        ):
            self.previous = signal.signal(signal.SIGTERM, self._handle)
        self.armed = True
        return self

    def _handle(self, signum: int, frame: object) -> None:
        self.received = True
        if self.armed:
            self.armed = False
            raise Terminated(len(self.ranks))

    def __exit__(self, *exc: object) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, cast(signal.Handlers, self.previous))


def run_ranks(
    fn: Callable[..., R],
    world_size: int,
    *args: object,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    pg_timeout_s: float | None = None,
    start_method: StartMethod = "spawn",
    backend: str = "gloo",
    num_threads: int | None = 1,
    grace_s: float = GRACE_S,
    term_grace_s: float = TERM_GRACE_S,
) -> list[R]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return the values in rank order.

    Args:
        fn: Run in every rank's group; a module's top-level function for ``"spawn"``.
        *args: Passed after ``rank`` and ``world_size``; picklable for ``"spawn"``.
        timeout_s: Every rank must have reported by then; the rest are killed and named.
        pg_timeout_s: The group's timeout per collective; default ``min(60, timeout_s)``.
        start_method: ``"spawn"`` (the safe default), ``"fork"`` or ``"forkserver"`` (no
            second import of torch; the parent must hold no thread that holds a lock).
        num_threads: ``torch.set_num_threads`` per rank (1: the ranks share the cores).
        grace_s: The other ranks' time to report after the first failure.
        term_grace_s: Between SIGTERM and SIGKILL to a rank being stopped (the time a rank
            that saves a checkpoint on SIGTERM needs).

    Raises:
        LaunchError: A rank raised, died, hung past ``timeout_s``, or crashed while exiting
            after it had returned; every failed rank is named, the first failure first.

    Example:
        >>> run_ranks(divmod, 2, start_method="fork")  # divmod(rank, world_size) on each rank
        [(0, 0), (0, 1)]
        >>> import math
        >>> run_ranks(math.log, 2, start_method="fork")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        zero_functional.app.launch.LaunchError: rank 0 raised ValueError: math domain error
        --- rank 0:
        Traceback (most recent call last):
        ...
        ValueError: math domain error
    """
    import multiprocessing

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    ctx = multiprocessing.get_context(start_method)
    pg_timeout = min(60.0, timeout_s) if pg_timeout_s is None else pg_timeout_s
    parent = None if start_method == "forkserver" else os.getpid()  # the ranks' parent
    job = (fn, args) if start_method == "fork" else pickle.dumps((fn, args))  # _rank_main's doc
    same = (parent, world_size, free_port(), backend, pg_timeout, num_threads, job)
    ranks: list[_Rank] = []
    with _SigtermGuard(ranks) as sigterm:
        try:
            with _rank_environment():
                for rank in range(world_size):
                    # one pipe per rank, made just before its process: no other rank inherits it
                    receive, send = ctx.Pipe(duplex=False)
                    process: BaseProcess = ctx.Process(  # type: ignore[attr-defined]
                        target=_rank_main, args=(rank, *same, send), name=f"rank {rank}"
                    )
                    process.start()
                    send.close()
                    ranks.append(_Rank(rank, process, receive))
            failures = _collect(ranks, timeout_s, grace_s) or _await_exit(ranks)
        finally:
            sigterm.armed = False  # a SIGTERM from here on waits until every rank is stopped
            _release(ranks, term_grace_s)
        if sigterm.received:
            raise Terminated(len(ranks))
    if failures:
        raise LaunchError(failures, {r.rank: r.value for r in ranks if r.state == "returned"})
    return [r.value for r in ranks]  # type: ignore[misc]


def _read(r: _Rank) -> tuple[bool, object, float] | None:
    """The rank's report if one is waiting: ``(True, value, t)`` or ``(False, traceback, t)``;
    ``t``, the rank's ``time.monotonic()`` (one clock on Linux and macOS), orders failures."""
    if r.conn is None:
        return None
    try:
        if not r.conn.poll():
            return None
        data = r.conn.recv_bytes()
    except (EOFError, OSError):  # closed without a report: the process's end will tell how
        r.conn.close()
        r.conn = None
        return None
    try:
        ok, value, t = pickle.loads(data)
    except Exception as e:
        message = f"{type(e).__name__}: the launcher cannot unpickle its result: {e}"
        return False, message, time.monotonic()
    return bool(ok), value, float(t)


def _poll(
    running: Sequence[_Rank],
    raised: list[tuple[float, RankFailure]],
    died: list[RankFailure],
    stops: StoppedRanks,
) -> None:
    """Take in what the running ranks have reported, which have ended, which are stopped."""
    for r in running:
        if r.state != "running":
            continue
        code = r.process.exitcode
        if code is None and connection.wait([r.process.sentinel], timeout=0):
            # Its files are closed, so it is exiting (and its peers' sockets are reset), but it
            # may not be reapable yet: wait for that, or its death is missed this round.
            r.process.join(REAP_S)
            code = r.process.exitcode
        report = _read(r)  # after the exit code: a rank reports, then ends
        if report is not None and report[0]:
            r.state, r.value = "returned", report[1]
        elif report is not None:
            r.state, tb = "failed", str(report[1])
            raised.append((report[2], RankFailure(r.rank, f"raised {last_line(tb)}", tb)))
        elif code is not None:
            r.state = "failed"
            died.append(RankFailure(r.rank, describe_exit(code)))
        elif (stopped := stops.reason(r.rank, r.process.pid)) is not None:
            r.state = "failed"  # SIGSTOP: it neither reports nor dies, while its peers wait
            died.append(RankFailure(r.rank, stopped))


def _collect(ranks: Sequence[_Rank], timeout_s: float, grace_s: float) -> list[RankFailure]:
    """Wait until every rank has reported or ended, or until the first failure's grace is over."""
    stop_at = deadline = time.monotonic() + timeout_s
    failures: list[RankFailure] = []
    stops = StoppedRanks()
    while True:
        running = [r for r in ranks if r.state == "running"]
        left = stop_at - time.monotonic()
        if not running or left <= 0:
            break
        handles: list[object] = [r.process.sentinel for r in running]
        handles += [r.conn for r in running if r.conn is not None]
        connection.wait(handles, timeout=min(left, POLL_S))  # type: ignore[arg-type]
        raised: list[tuple[float, RankFailure]] = []
        died: list[RankFailure] = []
        _poll(running, raised, died, stops)
        first = next((f for f in failures if f.primary), None)
        if first is None and raised and not died:
            # A peer's death can reach a survivor (a reset connection) before the dead process
            # can be reaped: give the deaths behind these errors a moment to show.
            if still := [r for r in running if r.state == "running"]:
                connection.wait([r.process.sentinel for r in still], timeout=SETTLE_S)
                _poll(still, raised, died, stops)
        if raised or died:
            failures += blame(died, [f for _, f in sorted(raised)], first)
            if first is None:
                stop_at = min(deadline, time.monotonic() + grace_s)
    first = next((f for f in failures if f.primary), None)
    for r in ranks:
        if r.state == "running":
            if first is None:
                reason, primary = f"gave no result within {format_seconds(timeout_s)}", True
            else:
                reason, primary = f"was stopped after rank {first.rank} failed", False
            failures.append(RankFailure(r.rank, reason, primary=primary))
    return failures


def _await_exit(ranks: Sequence[_Rank]) -> list[RankFailure]:
    """After every rank returned: each must leave its group and exit with code 0 (a rank
    killed by a signal comes first: the others' exit barrier fails because of it)."""
    deadline = time.monotonic() + EXIT_WAIT_S
    killed: list[RankFailure] = []
    other: list[RankFailure] = []
    for r in ranks:
        r.process.join(max(deadline - time.monotonic(), 0.0))
        code = r.process.exitcode
        tb = ""
        if code is None:
            reason = f"returned its result but had not exited {format_seconds(EXIT_WAIT_S)} later"
        elif code != 0:
            reason = f"returned its result, then {describe_exit(code)} while exiting"
            if (why := _why_not_left(r)) is not None:
                reason, tb = f"{reason}: {cut(why[0], 400)}", why[1]
        else:
            continue
        failure = RankFailure(r.rank, reason, tb)
        (killed if code is not None and code < 0 else other).append(failure)
    return blame(killed, other, None) if killed or other else []


def _why_not_left(r: _Rank) -> tuple[str, str] | None:
    """What a rank that returned reported on failing to leave its group: a line naming the last
    CollectiveError it raised (what broke the group), else what leaving raised; the details."""
    try:
        if r.conn is None or not r.conn.poll():
            return None
        kind, tb, errors = pickle.loads(r.conn.recv_bytes())
    except Exception:  # nothing more came, or not this: the exit code says what is known
        return None
    if kind != "exit":
        return None
    named = [f"zero_functional.comm.CollectiveError: {e}" for e in errors]
    line = (
        f"it could not leave its process group after {named[-1]}"
        if named
        else f"leaving its process group raised {last_line(tb)}"
    )
    return line, "\n".join([*named, tb])


@contextmanager
def _rank_environment() -> Iterator[None]:
    """:data:`CHILD_ENV`'s variables the environment lacks, set while ranks start."""
    added = [k for k in CHILD_ENV if k not in os.environ]
    os.environ.update({k: CHILD_ENV[k] for k in added})
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def _release(ranks: Sequence[_Rank], term_grace_s: float) -> None:
    """Stop every rank still alive (SIGTERM, then SIGKILL), reap it, close its pipe and handles."""
    alive = [r for r in ranks if r.process.is_alive()]
    for r in alive:
        r.process.terminate()  # as a scheduler stops a job: a rank may handle SIGTERM
    deadline = time.monotonic() + term_grace_s
    for r in alive:
        r.process.join(max(deadline - time.monotonic(), 0.0))
        if r.process.is_alive():
            r.process.kill()
    for r in ranks:
        r.process.join()
        r.process.close()
        if r.conn is not None:
            r.conn.close()


def exit_when_orphaned(
    report: Connection, kill: Callable[[], None] = lambda: os.kill(os.getpid(), signal.SIGKILL)
) -> threading.Thread:
    """Start a daemon thread that calls ``kill`` (SIGKILL of this process) once the reading end
    of ``report``, which only the launcher holds, is closed: the launcher died, by any signal
    (the kernel closes it). The thread ends quietly if ``report`` itself is closed.

    Example:
        >>> import multiprocessing
        >>> receive, send = multiprocessing.Pipe(duplex=False)
        >>> killed = threading.Event()
        >>> watcher = exit_when_orphaned(send, kill=killed.set)
        >>> receive.close()  # as the launcher's death does
        >>> killed.wait(timeout=5)
        True
    """

    def watch() -> None:
        poller = select.poll()
        poller.register(report.fileno(), select.POLLERR | select.POLLHUP)
        while True:
            for _, events in poller.poll():
                if events & select.POLLNVAL:
                    return  # this end was closed: the rank is leaving anyway
                if events & (select.POLLERR | select.POLLHUP):
                    kill()
                    return

    thread = threading.Thread(target=watch, name="zero_functional-orphan-watch", daemon=True)
    thread.start()
    return thread
