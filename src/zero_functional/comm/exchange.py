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

import torch
import torch.distributed as dist
from torch import Tensor

from zero_functional.comm.groups import ProcessGroup, group_rank, group_size, is_nccl
from zero_functional.comm.pending import Pending, start_one
from zero_functional.core.plans import exchange_splits

POOL_BUFFERS = 4
"""Receive buffers kept between exchanges, the largest (each a DDP bucket's size at most: DDP's
default buckets of an 8M-parameter model are three, whose buffers then all come back).

A fresh receive buffer costs more than the exchange's own copies: on the 2-core CPU machine, a
25 MB bucket at 2 ranks took 39.9 ms through the all-to-all into a new buffer and 21.1 ms into a
reused one (glibc returning freed buffers, as the benchmarks run it: every page faulted again),
where gloo's reduce per owner took 41.1 ms."""

_pool: list[Tensor] = []
_pool_lock = threading.Lock()  # given back on the backend's thread (a future's callback)


def _take(numel: int, like: Tensor) -> Tensor:
    """A 1-D buffer of at least ``numel`` elements of ``like``'s dtype and device: a kept one
    (the smallest that fits) or a new one."""
    with _pool_lock:
        fits = [
            i
            for i, t in enumerate(_pool)
            if t.dtype == like.dtype and t.device == like.device and t.numel() >= numel
        ]
        if fits:
            return _pool.pop(min(fits, key=lambda i: _pool[i].numel()))
    return torch.empty(numel, dtype=like.dtype, device=like.device)


def _give(buffer: Tensor) -> None:
    """Keep ``buffer`` for a later exchange (the largest :data:`POOL_BUFFERS` are kept)."""
    with _pool_lock:
        _pool.append(buffer)
        _pool.sort(key=lambda t: t.numel(), reverse=True)
        del _pool[POOL_BUFFERS:]


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
    # the runs cover the buffer in its order: sending in rank order needs no copy when the
    # owners already come in rank order
    in_place = order == tuple((a, b) for a, b, _ in runs)
    source = buffer if in_place else torch.cat([buffer[a:b] for a, b in order])
    mine = splits[me]
    kept = _take(world * mine, buffer)
    received = kept[: world * mine]
    spans = [(a, b) for a, b, rank in runs if rank == me and b > a]

    def add_up() -> None:
        # onto this rank's own values (in place, no copy), the others' in rank order
        rows = received.view(world, mine)
        offset = 0
        for a, b in spans:
            for r in range(world):
                if r != me:
                    buffer[a:b].add_(rows[r, offset : offset + b - a])
            offset += b - a
        _give(kept)

    def issue() -> object:
        # looked up when called, so that any wrapper installed over it (a byte counter) runs
        return dist.all_to_all_single(
            received, source, [mine] * world, list(splits), group=group, async_op=True
        )

    made = [received] if source is buffer else [received, source]
    return start_one(issue, made, group, [add_up])  # type: ignore[arg-type]
