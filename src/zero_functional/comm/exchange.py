"""Gradients summed onto their owners through one all-to-all: the reduce at its byte floor.

Summing each stretch of a buffer onto the rank that owns it needs each rank to send every other
rank that rank's stretches once: ``S - owned`` bytes per rank, ``(N - 1) S`` in all, the floor
of a reduce-scatter. gloo's own ``reduce`` and ``reduce_scatter`` send more (measured on a
loopback shaped to 2 Gbit/s, 32 MB, ``benchmarks/bench_collectives.py --link 2gbit``: a reduce
per owner 2.28x that floor at 2 ranks and 1.25x at 4, ``reduce_scatter_tensor`` 2.12x and 2.03x).
gloo's all-to-all sends each rank's stretches straight to their owner over its point-to-point
pairs, which is that floor; the owner then adds what arrived onto its own values, in rank
order (only the owner computes a sum, so after the broadcast every rank holds the same bits).
It is one collective with a future, issued in order like the rest.
NCCL keeps its native reduce (grouped) and reduce-scatter.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from zero_functional.comm.groups import ProcessGroup, group_rank, group_size, is_nccl
from zero_functional.comm.pending import Pending, start_one
from zero_functional.core.plans import exchange_splits

POOL_BUFFERS = 4
"""Receive buffers kept between exchanges, for a later exchange of the same size (the last
ones given back: DDP's buckets come back in the same sizes every backward, three for the
default buckets of an 8M-parameter model).

A fresh receive buffer costs more than the exchange's own copies: on the 2-core CPU machine, a
25 MB bucket at 2 ranks took 39.9 ms through the all-to-all into a new buffer and 21.1 ms into a
reused one (glibc returning freed buffers, as the benchmarks run it: every page faulted again),
where gloo's reduce per owner took 41.1 ms. Only a buffer of the very size asked for is reused:
handing out any larger one that fits kept, at 2 ranks, a 30 MiB buffer for a bucket of which a
rank owns nothing, and the next bucket allocated its own (61 MiB kept, not 30)."""

STALE_PASSES = 2 * POOL_BUFFERS
"""A kept buffer passed over by this many takes in a row (a size no bucket has any more: DDP
rebuilt its buckets after the first backward) is let go."""

_pool: list[list[Any]] = []  # [buffer, takes that passed it over since it was given]
_pool_lock = threading.Lock()


def _take(numel: int, like: Tensor) -> Tensor:
    """A 1-D buffer of ``numel`` elements of ``like``'s dtype and device: a kept one of that
    size, or a new one."""
    if numel == 0:
        return like.new_empty(0)
    found: Tensor | None = None
    with _pool_lock:
        for i, (t, _) in enumerate(_pool):
            if t.numel() == numel and t.dtype == like.dtype and t.device == like.device:
                found = _pool.pop(i)[0]
                break
        for entry in _pool:  # passed over by this take
            entry[1] += 1
        _pool[:] = [entry for entry in _pool if entry[1] < STALE_PASSES]
    if found is not None:
        return found
    return torch.empty(numel, dtype=like.dtype, device=like.device)


def _give(buffer: Tensor) -> None:
    """Keep ``buffer`` for a later exchange of its size (the last :data:`POOL_BUFFERS` given)."""
    if buffer.numel() == 0:
        return
    with _pool_lock:
        _pool.append([buffer, 0])
        del _pool[:-POOL_BUFFERS]


def kept_bytes() -> int:
    """The bytes of the receive buffers kept for later exchanges (held between steps).

    Example:
        >>> kept_bytes() >= 0
        True
    """
    with _pool_lock:
        return sum(t.numel() * t.element_size() for t, _ in _pool)


def exchanges(group: ProcessGroup, buffer: Tensor) -> bool:
    """Whether a reduce onto owners of ``buffer`` over ``group`` goes through
    :func:`start_exchange` (a CPU buffer on a backend other than NCCL, more than one rank)."""
    return not is_nccl(group) and buffer.device.type == "cpu" and group_size(group) > 1


def start_exchange(
    buffer: Tensor, runs: Sequence[tuple[int, int, int]], group: ProcessGroup
) -> Pending:
    """Start summing each run of the 1-D ``buffer`` onto its rank through one all-to-all.

    Afterwards (``wait()``, or the future DDP waits on) each rank's runs hold the sum of every
    rank's values: its own, plus the others' in rank order; the other elements keep this
    rank's values. Each rank
    sends only the runs of other ranks, once.

    Example:
        >>> import tempfile, torch.distributed as dist
        >>> dist.init_process_group(
        ...     "gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
        >>> t = torch.arange(3.0)
        >>> start_exchange(t, [(0, 3, 0)], dist.group.WORLD).wait()
        >>> t
        tensor([0., 1., 2.])
        >>> dist.destroy_process_group()
    """
    world, me = group_size(group), group_rank(group)
    splits, order = exchange_splits(runs, world)
    if buffer.numel() == 0:
        return Pending([])
    mine = splits[me]
    others = [(a, b) for a, b, rank in sorted(runs, key=lambda run: run[2]) if rank != me]
    # The stretches go out grouped by owner, in rank order. This rank's own need not travel
    # (nor take a slot of the receive buffer) where the others' are one stretch of the
    # buffer: at 2 ranks always, and for the first and last rank when the owners come in rank
    # order. Otherwise, with the owners in rank order, the whole buffer goes out as it is
    # (this rank's own run to itself: no copy); else the others' stretches are copied out.
    joined = all(b == c for (_, b), (c, _) in zip(others, others[1:]))
    copied = False
    if joined:  # (none: this rank owns the whole buffer and only receives)
        source, skip = buffer[others[0][0] : others[-1][1]] if others else buffer[:0], True
    elif order == tuple((a, b) for a, b, _ in runs):
        source, skip = buffer, False
    else:
        source, skip, copied = (
            torch.cat([buffer[a:b] for a, b in others] or [buffer[:0]]),
            True,
            True,
        )
    senders = [r for r in range(world) if not (skip and r == me)]
    kept = _take(len(senders) * mine, buffer)
    received = kept[: len(senders) * mine]
    spans = [(a, b) for a, b, rank in runs if rank == me and b > a]

    def add_up() -> None:
        # onto this rank's own values (in place, no copy), the others' in rank order
        rows = received.view(len(senders), mine)
        offset = 0
        for a, b in spans:
            for row, r in enumerate(senders):
                if r != me:
                    buffer[a:b].add_(rows[row, offset : offset + b - a])
            offset += b - a
        _give(kept)

    send_splits = [0 if skip and r == me else splits[r] for r in range(world)]
    receive_splits = [0 if skip and r == me else mine for r in range(world)]

    def issue() -> object:
        # looked up when called, so that any wrapper installed over it (a byte counter) runs
        return dist.all_to_all_single(
            received, source, receive_splits, send_splits, group=group, async_op=True
        )

    made = [received, source] if copied else [received]
    return start_one(issue, made, group, [add_up])  # type: ignore[arg-type]
