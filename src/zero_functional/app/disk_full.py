"""A full disk named in one line: which rank, which file, which checkpoint (issue 34, item 8).

A rank whose disk fills during ``train --checkpoint`` fails with a
:class:`~zero_functional.checkpoint.storage.CheckpointError` naming the errno (``cannot write
<file>: [Errno 28] No space left on device``), and the other ranks with it; the launcher's
report is one line per rank and each traceback. :func:`disk_full` finds the first failure that
says ENOSPC and turns it into the one line the CLI prints instead.

Example:
    >>> from zero_functional.app.launch import LaunchError, RankFailure
    >>> e = LaunchError([RankFailure(0, "raised CheckpointError: checkpoint save failed: rank 1: "
    ...     "cannot write /d/c.tmp-0/__1_0.distcp: [Errno 28] No space left on device")])
    >>> print(disk_full(e, "/d/c"))
    rank 1: no space left on device writing /d/c.tmp-0/__1_0.distcp; /d/c is unchanged: free space there or pass another --checkpoint
"""

from __future__ import annotations

import errno
import os
import re

from zero_functional.app.launch import LaunchError

__all__ = ["disk_full"]

_NO_SPACE = re.compile(
    rf"(?:rank (?P<rank>\d+): )?(?:cannot write (?P<file>\S+): )?\[Errno {errno.ENOSPC}\]"
    rf"[^'\n]*(?:'(?P<quoted>[^'\n]+)')?"
)


def disk_full(error: LaunchError, checkpoint: str | None) -> str | None:
    """One line naming the rank that found no space left on device, the file it was writing
    and the checkpoint; ``None`` if no rank's failure says ENOSPC.

    Example:
        >>> from zero_functional.app.launch import LaunchError, RankFailure
        >>> disk_full(LaunchError([RankFailure(1, "exited with code 3")]), "ckpt") is None
        True
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
