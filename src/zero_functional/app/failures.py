"""What went wrong on the ranks, in words: the failures :func:`~.launch.run_ranks` raises, the
cause first; how a process ended or was stopped (SIGSTOP); a full disk in one line.

Example:
    >>> e = LaunchError([RankFailure(1, "was killed by signal SIGKILL"),
    ...                  RankFailure(0, "was stopped after rank 1 failed", primary=False)])
    >>> print(e)
    rank 1 was killed by signal SIGKILL
    rank 0 was stopped after rank 1 failed
    >>> e.headline
    'rank 1 was killed by signal SIGKILL'
"""

from __future__ import annotations

import errno
import os
import re
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

STOPPED_S = 5.0  # seen stopped this long without a break, a rank is named


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
    message has a line per failed rank, then the tracebacks of the primary ones."""

    def __init__(
        self, failures: Sequence[RankFailure], results: Mapping[int, object] | None = None
    ) -> None:
        if not failures:
            raise ValueError("LaunchError needs at least one RankFailure")
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

    def __init__(
        self, after_s: float = STOPPED_S, state: Callable[[int], str] = process_state
    ) -> None:
        self.after_s = after_s
        self._state = state
        self._since: dict[int, float] = {}

    def reason(self, rank: int, pid: int | None, now: float | None = None) -> str | None:
        """Why ``rank`` (process ``pid``) counts as failed, once stopped for ``after_s``; ``None``
        before, or while it runs (which starts the count again)."""
        if pid is None or self._state(pid) != "T":
            self._since.pop(rank, None)
            return None
        now = time.monotonic() if now is None else now
        since = self._since.setdefault(rank, now)
        if now - since < self.after_s:
            return None
        return (
            "stopped reporting: its process was stopped (state T: SIGSTOP or SIGTSTP) "
            f"{format_seconds(now - since)} ago and has not resumed"
        )


_NO_SPACE = re.compile(
    rf"(?:rank (?P<rank>\d+): )?(?:cannot write (?P<file>\S+): )?\[Errno {errno.ENOSPC}\]"
    rf"[^'\n]*(?:'(?P<quoted>[^'\n]+)')?"
)


def disk_full(error: LaunchError, checkpoint: str | None) -> str | None:
    """One line naming the rank that found no space left on device, its file and the
    checkpoint, instead of a traceback per rank; ``None`` if no failure says ENOSPC.

    Example:
        >>> e = LaunchError([RankFailure(0, "raised CheckpointError: checkpoint save failed: "
        ...     "rank 1: cannot write /d/c.tmp-0/__1_0.distcp: [Errno 28] No space left on device")])
        >>> print(disk_full(e, "/d/c"))
        rank 1: no space left on device writing /d/c.tmp-0/__1_0.distcp; /d/c is unchanged: free space there or pass another --checkpoint
    """
    for failure in error.failures:
        found = _NO_SPACE.search(failure.reason)
        if found is None:
            continue
        rank = found["rank"] or str(failure.rank)
        where = found["file"] or found["quoted"] or checkpoint or "the checkpoint"
        kept = f"; {checkpoint} is unchanged" if checkpoint else ""
        return (
            f"rank {rank}: {os.strerror(errno.ENOSPC).lower()} writing {where}{kept}: free "
            "space there or pass another --checkpoint"
        )
    return None
