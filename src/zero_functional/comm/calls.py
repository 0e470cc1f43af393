"""Calls: each call of the package's collectives named, timed out, and explained when it fails."""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta

from zero_functional.comm.groups import ProcessGroup, Work, group_rank, group_size
from zero_functional.core._validate import by_rank


class CollectiveError(RuntimeError):
    """A collective of this package failed or timed out: the message names the call, its number in
    this group, this rank, the wait, and what every other rank reported doing (or its silence)."""


@dataclass
class _Call:
    name: str
    group: ProcessGroup
    seq: int
    timeout: float | None
    started: float


_local = threading.local()
_SEQ: dict[str, int] = {}
_FAILED: list[str] = []  # every CollectiveError this process raised, oldest first
_SILENT = "did not report (it died, or is not in a call of zero_functional)"
REPORT_GRACE_S = 5.0  # how long a failed rank waits for the others' reports before it raises


@contextlib.contextmanager
def call(name: str, group: ProcessGroup, *, timeout: float | None = None) -> Iterator[None]:
    """Run the collectives of one call of the package under ``name``; name its failures.

    Each collective of the block waits at most ``timeout`` seconds. A failed rank writes its call
    into the group's store and reads the others' for :data:`REPORT_GRACE_S` seconds, so ranks in
    other calls are named, and a dead rank by its silence; calls nest (the outermost name counts).

    Example:
        >>> with call("example()", group, timeout=5.0):
        ...     pass
    """
    if getattr(_local, "call", None) is not None:
        yield
        return
    key = str(getattr(group, "group_name", "") or "default")
    _SEQ[key] = _SEQ.get(key, 0) + 1
    current = _Call(name, group, _SEQ[key], timeout, time.monotonic())
    _local.call = current
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as e:
        error = CollectiveError(_explain(current, e))
        _FAILED.append(str(error))
        raise error from e
    finally:
        _local.call = None


def failures() -> list[str]:
    """The messages of the :class:`CollectiveError` s this process raised, oldest first.

    Example:
        >>> failures()
        []
    """
    return list(_FAILED)


def wait(work: Work) -> None:
    current: _Call | None = getattr(_local, "call", None)
    if current is not None and current.timeout is not None:
        left = current.timeout - (time.monotonic() - current.started)
        work.wait(timedelta(seconds=max(left, 0.001)))
    else:
        work.wait()


def wait_each(works: Sequence[Work]) -> None:
    for work in works:
        wait(work)


def _explain(current: _Call, error: BaseException) -> str:
    group = current.group
    me, world = group_rank(group), group_size(group)
    waited = time.monotonic() - current.started
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    # gloo's messages start with a source path and end with advice for gloo's own users
    first = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", first).split(" This is typically")[0]
    mine = f"{current.name} #{current.seq}"
    reports: dict[int, str] = {}
    try:
        store = group.get_group_store()
        prefix = "zero_functional/failed/"
        store.set(f"{prefix}{me}", mine)
        deadline = time.monotonic() + REPORT_GRACE_S
        while len(reports) < world - 1 and time.monotonic() < deadline:
            for r in range(world):
                if r != me and r not in reports and store.check([f"{prefix}{r}"]):
                    reports[r] = store.get(f"{prefix}{r}").decode()
            if len(reports) < world - 1:
                time.sleep(0.05)
    except Exception:  # no store to talk through (or it died with a peer): say what we know
        pass
    others = by_rank(
        [(r, f"was in {reports[r]}" if r in reports else _SILENT) for r in range(world) if r != me],
        sep=" ",
    )
    return (
        f"{mine} (this process group's collective call #{current.seq} through "
        f"zero_functional) failed on rank {me} of {world} after {waited:.1f} s: {first}. "
        f"The other ranks: {others or 'none'}. Every rank must make the same calls "
        "in the same order (step(), consolidate_state_dict(), add_param_group(), "
        "load_state_dict(), and the backward of a hooked DDP module)."
    )
