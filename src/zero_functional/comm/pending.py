"""Pending: collectives in flight, waited for, then their copies, with nothing left to gloo's
threads (the second rule of :mod:`zero_functional.comm`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Literal, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.futures import Future

from zero_functional.comm.calls import wait_each
from zero_functional.comm.groups import ProcessGroup, Work, global_rank, is_nccl

SETTLE_S = 1.0  # the most Pending.wait waits for the backend's threads to let go of its tensors


def refs(t: Tensor) -> int:
    count = getattr(t, "_use_count", None)  # the tensor's C++ reference count; 0 where absent
    return int(count()) if count is not None else 0


def hold(tensors: Iterable[Tensor], group: ProcessGroup) -> list[tuple[Tensor, int]]:
    """``tensors`` with their reference counts, taken just before a collective is given them;
    nothing on NCCL (only gloo's threads are waited for)."""
    return [] if is_nccl(group) else [(t, refs(t)) for t in tensors]


def settle(held: Sequence[tuple[Tensor, int]]) -> None:
    """Return once the reference counts of ``held`` are back to what they were before their
    collective (:data:`SETTLE_S` at most): the backend has let go of them."""
    deadline = time.monotonic() + SETTLE_S
    for t, count in held:
        while refs(t) > count:
            if time.monotonic() > deadline:
                return
            time.sleep(0)


class Pending:
    """Collectives in flight; :meth:`wait` finishes them, then runs their follow-up copies. It
    keeps the tensors made for them (``held``, :func:`hold`) until the backend lets go."""

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
        """Wait for the collectives, run the copies (once); on return the backend holds nothing."""
        wait_each(self.works)  # (no loop variable here: it would hold the last work)
        finish = self.finish  # and what its copies read, until the backend has let go too
        self._run_finish()
        if self._settle:
            settle(self.held)
        self.held = []
        del finish

    def copy_after(self, dst: Tensor, src: Tensor) -> Pending:
        """Copy ``src`` into ``dst`` once the collectives are done (nothing if they are one
        tensor): a bucket reduced in a wider dtype, rounded back before DDP reads it.

        Example:
            >>> out, wide = torch.zeros(2, dtype=torch.bfloat16), torch.full((2,), 1.5)
            >>> Pending([]).copy_after(out, wide).wait()
            >>> out
            tensor([1.5000, 1.5000], dtype=torch.bfloat16)
        """
        if dst is not src:

            def copy() -> None:
                dst.copy_(src)

            self.finish.append(copy)
        return self

    def _run_finish(self) -> None:
        with torch.no_grad():
            for fn in self.finish:
                fn()
        self.works, self.finish = [], []

    def future(self, value: Tensor) -> Future[Tensor]:
        """A future that completes with ``value`` once every collective and copy is done (what
        a DDP comm hook returns); the copies run in its callback, which issues no collective."""
        try:
            futures = [w.get_future() for w in self.works]
        except RuntimeError:  # a backend whose work has no future (gloo's reduce-scatter)
            futures = []
        if not futures:  # done already, or to be waited for here
            self.wait()
            done: Future[Tensor] = Future()
            done.set_result(value)
            return done
        self._settle = False  # the futures hold the tensors too: `held` is kept, not waited for

        def complete(_: object) -> Tensor:
            # on the backend's thread, which still holds the works: `held` stays with this
            # object, dropped by whoever drops it (the hook's state, on the autograd thread)
            self._run_finish()
            return value

        if len(futures) == 1:
            # the work's own future: on CUDA it carries the collective's stream, so the copies
            # above and DDP's wait are ordered after it (collect_all's result is a CPU future)
            return futures[0].then(complete)
        return torch.futures.collect_all(futures).then(complete)


def issue(
    op: Literal["all_reduce", "broadcast", "reduce"],
    calls: Sequence[tuple[Tensor, int | None]],
    group: ProcessGroup,
    finish: list[Callable[[], None]] | None = None,
    *,
    grouped: bool = False,
) -> Pending:
    """Start ``dist.<op>(tensor, root)`` per ``(tensor, root)`` call in list order (``root``: a
    group rank, ``None`` for an all-reduce); ``grouped`` (NCCL): in one coalesced launch, NCCL's
    own uneven reduce-scatter. The op is looked up per call: a wrapper installed over it runs."""
    held = hold((tensor for tensor, _ in calls), group)

    def start(tensor: Tensor, root: int | None) -> Work:
        roots = () if root is None else (global_rank(group, root),)
        return cast(Work, getattr(dist, op)(tensor, *roots, group=group, async_op=True))

    if len(calls) > 1 and grouped:
        coalescing = dist.distributed_c10d._coalescing_manager
        with coalescing(group, calls[0][0].device, async_ops=True) as cm:
            for tensor, root in calls:
                start(tensor, root)
        return Pending(list(cm.works), finish, held)
    return Pending([start(tensor, root) for tensor, root in calls], finish, held)


def start_one(
    issue: Callable[[], Work | None],
    made: Sequence[Tensor],
    group: ProcessGroup,
    finish: list[Callable[[], None]] | None = None,
) -> Pending:
    """``issue()`` one collective; its :class:`Pending` holds ``made``, the tensors made for it."""
    held = hold(made, group)
    work = issue()
    assert work is not None
    return Pending([work], finish, held)
