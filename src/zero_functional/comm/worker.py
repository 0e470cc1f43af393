"""InOrder: a thread that runs what it is given, one at a time, in the order given.

It sets what is per thread: grad mode (off) and the intra-op thread count, its creator's (under
OpenMP a new thread would spin as many threads as cores after each op, slowing backward)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch


def _serve(todo: queue.SimpleQueue[Callable[[], None] | None], threads: int) -> None:
    torch.set_num_threads(threads)
    with torch.no_grad():
        while (task := todo.get()) is not None:
            task()
            del task  # nothing given is held while waiting for the next


class InOrder:
    """A daemon thread that runs what :meth:`put` gives it, in order, until :meth:`close`; a task
    must not raise (its waiters would wait for ever), and may outlive this object's owner.

    Example:
        >>> seen, worker = [], InOrder("example")
        >>> worker.put(lambda: seen.append(1)); worker.join()
        >>> seen
        [1]
    """

    def __init__(self, name: str) -> None:
        self._todo: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        args = (self._todo, torch.get_num_threads())  # the creator's count, per thread
        self._thread = threading.Thread(target=_serve, args=args, name=name, daemon=True)
        self._thread.start()

    def put(self, task: Callable[[], None]) -> None:
        """Run ``task`` after everything put before."""
        self._todo.put(task)

    def close(self) -> None:
        """Let the thread end once it has run what it was given."""
        self._todo.put(None)

    def join(self) -> None:
        """:meth:`close`, then wait until the thread has run everything and ended."""
        self.close()
        self._thread.join()
