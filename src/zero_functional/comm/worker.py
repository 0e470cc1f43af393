"""A thread that runs what it is given, one at a time, in the order given.

Two parts of the package do work off the thread that issued it, in an order every rank shares:
:class:`~zero_functional.comm.exchange.Exchanger` (the reduce onto owners, chunk by chunk) and
overlap mode's update of each bucket as its reduction arrives
(:mod:`zero_functional.shell.overlap`). Both run on an :class:`InOrder`, which holds the two
facts such a thread must get right: grad mode is per thread (the in-place updates need it off),
and so is the intra-op thread count under OpenMP (a new thread would run its ops on as many
threads as cores, spinning after each: measured, backward ran 11 ms slower of 27 at 2 ranks on
2 cores), so it takes its creator's.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

__all__ = ["InOrder"]


def _serve(todo: queue.SimpleQueue[Callable[[], None] | None], threads: int) -> None:
    torch.set_num_threads(threads)
    with torch.no_grad():
        while (task := todo.get()) is not None:
            task()
            del task  # nothing given is held while waiting for the next


class InOrder:
    """A daemon thread that runs the callables :meth:`put` gives it, in order, until
    :meth:`close`. A callable must not raise: it reports its own errors (the thread would end,
    and whoever waits for the rest would wait for ever). The thread holds its queue, not this
    object, so an owner may close it when it is dropped (``weakref.finalize``).

    Example:
        >>> seen = []
        >>> worker = InOrder("example")
        >>> for i in range(3):
        ...     worker.put(lambda i=i: seen.append(i))
        >>> worker.join()
        >>> seen
        [0, 1, 2]
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
