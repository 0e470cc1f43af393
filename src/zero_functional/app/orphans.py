"""A rank that outlives its launcher stops at once (issue 34, item 10).

Each rank holds the writing end of a pipe whose reading end only its launcher holds
(:func:`zero_functional.app.launch.run_ranks`). When the launcher dies, by any signal (SIGKILL
included: nothing runs in it), the kernel closes that reading end and a poll of the writing end
reports an error: :func:`exit_when_orphaned` waits for exactly that in a daemon thread and
kills its own process, so no rank trains on, orphaned, holding the machine.

Example:
    >>> import multiprocessing
    >>> receive, send = multiprocessing.Pipe(duplex=False)
    >>> watcher = exit_when_orphaned(send, kill=lambda: print("orphaned"))
    >>> receive.close()  # as the launcher's death does
    >>> watcher.join(timeout=5)
    orphaned
"""

from __future__ import annotations

import os
import select
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

__all__ = ["exit_when_orphaned"]


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def exit_when_orphaned(
    report: Connection, kill: Callable[[], None] = _kill_self
) -> threading.Thread:
    """Start a daemon thread that calls ``kill`` (SIGKILL of this process) once the reading end
    of ``report`` (the launcher's) is closed; it ends quietly if ``report`` itself is closed."""

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
