"""How a rank's process is doing, in words: how it ended, or that it was stopped (SIGSTOP).

A rank stopped by SIGSTOP (or SIGTSTP, SIGTTIN, SIGTTOU) neither reports nor dies: its peers
wait in their collectives, and without this a launcher would find out only at its timeout,
blaming the first peer whose collective timed out. :class:`StoppedRanks` reads each rank's state
from ``/proc/<pid>/stat`` (``T``: stopped by a signal; a debugger's ``t`` is left alone) and names
a rank once it has been seen stopped for :data:`STOPPED_S` without a break, so that a job
suspended and resumed as a whole (the launcher stopped with it) is not taken for a failure.
Where there is no ``/proc`` (macOS) nothing is seen stopped and the launcher's timeout applies.

Example:
    >>> import os
    >>> watch = StoppedRanks()
    >>> watch.reason(0, os.getpid()) is None  # this process runs
    True
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

__all__ = ["STOPPED_S", "StoppedRanks", "describe_exit", "format_seconds", "process_state"]

STOPPED_S = 5.0
"""Seconds a rank's process must be seen stopped, without a break, before it is named."""


def format_seconds(seconds: float) -> str:
    """A duration for a message: whole seconds from 10 s on, three digits below.

    Example:
        >>> format_seconds(600.0), format_seconds(12.7), format_seconds(0.5), format_seconds(1.25)
        ('600 s', '13 s', '0.5 s', '1.25 s')
    """
    if seconds >= 10:
        return f"{seconds:.0f} s"
    return f"{seconds:.3g} s"


def describe_exit(exitcode: int) -> str:
    """How a process ended, from ``multiprocessing.Process.exitcode``.

    Example:
        >>> describe_exit(-9), describe_exit(3), describe_exit(0)
        ('was killed by signal SIGKILL', 'exited with code 3', 'exited with code 0')
    """
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = str(-exitcode)
        return f"was killed by signal {name}"
    return f"exited with code {exitcode}"


def process_state(pid: int) -> str:
    """The state letter of process ``pid`` in ``/proc`` (``R``, ``S``, ``T``: stopped, ``Z``,
    ...), or ``""`` where it is gone or there is no ``/proc``.

    Example:
        >>> import os
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
    """Since when each rank's process has been seen stopped; :meth:`reason` names the ones
    stopped for ``after_s`` (:data:`STOPPED_S`) or longer.

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
        """Why ``rank`` (process ``pid``) counts as failed: it has been stopped for ``after_s``
        (the end of a sentence that starts ``rank N``); ``None`` while it runs, or has been
        stopped for less time. A rank seen running starts its count again."""
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
