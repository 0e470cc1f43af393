"""How the ranks a cluster launcher started meet: a roll call bounded by a timeout that names
the ranks that did not come, where ``init_process_group`` would wait for them silently.

Rank 0 hosts a TCP store at ``MASTER_ADDR:MASTER_PORT`` (:class:`~.cluster.ClusterRank`), every
rank signs in there, rank 0 waits for them all until the deadline and posts the ranks missing,
which each rank that came reads before rank 0 leaves. The process group then forms on that
store. torchrun's agent holds its own rendezvous: its workers join through it.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

from zero_functional.app.cluster import ClusterRank
from zero_functional.app.launch import format_seconds
from zero_functional.core._validate import first_of

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Store

JOINED, HEARD = "zero_functional/joined/", "zero_functional/heard/"  # + the rank
MISSING = "zero_functional/missing"  # rank 0's word: the ranks missing, "" for none
RETRY_S = 0.1  # between tries to reach rank 0's store before it listens
HEARD_S = 2.0  # rank 0's wait, once ranks are missing, for the others to read which


class JoinError(RuntimeError):
    """Ranks did not meet within the timeout; ``missing`` says which (rank 0 where it never
    opened the rendezvous, or left it), and the message, in one line, where."""

    def __init__(self, message: str, missing: Sequence[int]) -> None:
        super().__init__(message)
        self.missing = tuple(missing)


def rank_names(ranks: Sequence[int], source: str) -> str:
    """Ranks for a message, runs as ranges; under SLURM a rank is its task (``SLURM_PROCID``).

    Example:
        >>> rank_names([1], "SLURM"), rank_names([2, 3, 4, 7], "torchrun")
        ('rank 1 (SLURM task 1)', 'ranks 2-4, 7')
        >>> rank_names(range(1, 4096, 2), "torchrun")  # 2,048 ranks, one line
        'ranks 1, 3, 5, 7, 9, 11, 13, 15 and 2040 more'
    """
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = first_of([str(a) if a == b else f"{a}-{b}" for a, b in runs])  # short at any size
    s = "s" if len(ranks) > 1 else ""
    return f"rank{s} {text}" + (f" (SLURM task{s} {text})" if source == "SLURM" else "")


def rendezvous(where: ClusterRank, timeout_s: float, env: Mapping[str, str]) -> Store | None:
    """Meet every other rank of ``where``'s job at rank 0's store within ``timeout_s``; the store
    for ``init_process_group``, or ``None`` where torchrun's agent hosts it (``env`` says).

    Raises:
        JoinError: Ranks did not come within ``timeout_s``; the message names them and the address.

    Example:
        >>> from zero_functional.app.launch import free_port
        >>> alone = ClusterRank(0, 1, 0, "127.0.0.1", free_port(), "SLURM")
        >>> rendezvous(alone, 5.0, {}) is not None
        True
        >>> rendezvous(ClusterRank(1, 2, 1, "127.0.0.1", free_port(), "SLURM"), 0.2, {})
        Traceback (most recent call last):
        ...
        zero_functional.app.rendezvous.JoinError: rank 0 (SLURM task 0), which hosts the rendezvous, did not open it at 127.0.0.1:... within 0.2 s
    """
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    from torch.distributed import DistError, TCPStore  # type: ignore[attr-defined]

    host, port, world, rank = where.master_addr, where.master_port, where.world_size, where.rank
    deadline = time.monotonic() + timeout_s
    at = f"at {host}:{port}"
    master = rank_names([0], where.source)
    closed = JoinError(
        f"{master}, which hosts the rendezvous, did not open it {at} within "
        f"{format_seconds(timeout_s)}",
        [0],
    )
    if rank != 0 and not _reachable(host, port, deadline):  # before c10d logs a C++ stack
        raise closed
    try:
        store = TCPStore(host, port, world, rank == 0, _left(deadline), wait_for_workers=False)
    except DistError:
        if rank == 0:
            raise  # its own port: the error says why
        raise closed from None
    store.set(f"{JOINED}{rank}", "")
    if rank == 0:
        everyone = [f"{JOINED}{r}" for r in range(world)]
        missing = [] if _wait(store, everyone, deadline) else _absent(store, world)
        store.set(MISSING, ",".join(map(str, missing)))
        if missing:  # the ranks that came read the word before the store goes with this process
            came = [f"{HEARD}{r}" for r in range(1, world) if r not in missing]
            _wait(store, came, time.monotonic() + HEARD_S)
    else:
        try:
            missing = _word(store, rank, world, deadline)
        except DistError:
            raise JoinError(
                f"{master} left the rendezvous {at} before every rank came", [0]
            ) from None
    if missing:
        names = rank_names(missing, where.source)
        raise JoinError(
            f"{names} did not join the rendezvous {at} within {format_seconds(timeout_s)}", missing
        )
    store.set_timeout(timedelta(seconds=timeout_s))
    return store


def _left(deadline: float) -> timedelta:
    return timedelta(seconds=max(deadline - time.monotonic(), 0.001))


def _reachable(host: str, port: int, deadline: float) -> bool:
    """Whether ``host:port`` accepts a connection before ``deadline`` (tried every RETRY_S)."""
    while True:
        try:
            socket.create_connection((host, port), timeout=_left(deadline).total_seconds()).close()
            return True
        except OSError:
            if time.monotonic() + RETRY_S >= deadline:
                return False
            time.sleep(RETRY_S)  # nothing to wait on: rank 0's port opens when it starts


def _wait(store: Store, keys: list[str], deadline: float) -> bool:
    """Whether every key of ``keys`` is in ``store`` before ``deadline``."""
    from torch.distributed import DistStoreError

    try:
        store.wait(keys, _left(deadline))
    except DistStoreError:  # a timeout
        return False
    return True


def _absent(store: Store, world: int) -> list[int]:
    return [r for r in range(world) if not store.check([f"{JOINED}{r}"])]


def _word(store: Store, rank: int, world: int, deadline: float) -> list[int]:
    """Another rank: the ranks missing, as rank 0 posts them; this rank's own count if its
    deadline comes first (it started before rank 0). Either way it tells rank 0 it knows."""
    if _wait(store, [MISSING], deadline):
        missing = [int(r) for r in store.get(MISSING).decode().split(",") if r]
    else:
        missing = _absent(store, world)
    store.set(f"{HEARD}{rank}", "")
    return missing
