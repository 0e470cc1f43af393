"""SIGTERM as a request to save and stop, agreed by every rank at a step boundary, with a grace.

A scheduler preempts a job with SIGTERM to every process, then SIGKILL. While a
:class:`Preemption` is entered, SIGTERM only sets a flag; the training loop asks
:meth:`Preemption.agreed` after each step (one all-reduce), so every rank stops after the same
step, saves there and raises :class:`Preempted`. A rank whose grace runs out first exits with
:data:`EXIT_CODE`: the atomic commit keeps the last complete checkpoint.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType

EXIT_CODE = 128 + signal.SIGTERM  # 143, as a shell reports a process SIGTERM ended
DEFAULT_GRACE_S = 20.0  # SIGTERM to the save's end (SLURM's KillWait and Kubernetes' grace: 30)


class Preempted(Exception):
    """Every rank stopped after the same step (``epoch`` epochs and ``step`` steps done) because
    of SIGTERM; ``saved``: with a checkpoint there.

    Example:
        >>> str(Preempted(3, 5, saved=True))
        'stopped by SIGTERM after epoch 3, step 5; saved a checkpoint there'
    """

    def __init__(self, epoch: int, step: int, *, saved: bool) -> None:
        self.epoch, self.step, self.saved = epoch, step, saved
        what = "saved a checkpoint there" if saved else "no new checkpoint"
        super().__init__(f"stopped by SIGTERM after epoch {epoch}, step {step}; {what}")


class Preemption:
    """While entered (in the main thread), SIGTERM sets a flag that :meth:`agreed` shares;
    ``grace_s`` after it the rank exits with :data:`EXIT_CODE`, naming ``rank`` and ``checkpoint``.

    Example (one process, no group needed until :meth:`agreed`):
        >>> with Preemption(20.0, rank=0, checkpoint="ckpt") as p:
        ...     os.kill(os.getpid(), signal.SIGTERM)
        ...     p.requested
        True
        >>> signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        True
    """

    def __init__(self, grace_s: float, *, rank: int, checkpoint: str) -> None:
        self.grace_s, self.rank, self.checkpoint = grace_s, rank, checkpoint
        self.requested = False
        self._timer: threading.Timer | None = None
        self._previous: signal.Handlers | int | None = None  # the handler it replaced, if any

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)  # type: ignore[assignment]
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            return
        self.requested = True
        self._timer = threading.Timer(self.grace_s, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _expire(self) -> None:
        print(
            f"zero-functional train: rank {self.rank}: SIGTERM's grace of {self.grace_s:g} s "
            f"(--grace-s) ran out before a checkpoint was saved to {self.checkpoint}; exiting "
            f"with code {EXIT_CODE} without it: {self.checkpoint} keeps the last complete one",
            file=sys.stderr,
            flush=True,
        )
        os._exit(EXIT_CODE)  # the main thread may be blocked in a write or a collective

    def agreed(self) -> bool:
        """Whether any rank has got SIGTERM: one all-reduce, so call it on every rank at once."""
        import torch  # here, so that the command line reads this module's constants at once

        from zero_functional import comm

        flag = torch.tensor([self.requested])
        return bool(comm.any_rank(flag, comm.default_group(None))[0].item())

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
        # past the block, leaving the group is bounded by the launcher's or scheduler's kill
        if self._timer is not None:
            self._timer.cancel()
