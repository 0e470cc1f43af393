"""OverlapState: overlap mode's per-bucket state machine, from arrival to updated and gathered.

It drives each bucket's sync and this rank's shard; the hook adopts a new bucket structure.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor
from torch._C._distributed_c10d import GradBucket
from torch.amp import GradScaler
from torch.futures import Future

from zero_functional import comm
from zero_functional.core.plans import Collectives
from zero_functional.shell.amp import ScalerFacade, overlap_verdict
from zero_functional.shell.bucket_sync import BucketSync, DDPBuckets, bucket_indices
from zero_functional.shell.local_shard import LocalShard
from zero_functional.shell.param_window import ParamWindow


def threaded(buffer: Tensor) -> bool:
    """Whether interleaved overlap mode updates a bucket of ``buffer`` on a thread: on the CPU.

    Example:
        >>> threaded(torch.zeros(2)), threaded(torch.zeros(2, device="meta"))
        (True, False)
    """
    return buffer.device.type == "cpu"


@dataclass(slots=True)
class _Bucket:
    """One bucket of the backward in progress: its parameters, its reduction (issued once
    ``future`` is set, waited for once ``flat`` is) and whether its pieces are updated."""

    indices: tuple[int, ...]
    future: Future[Any] | None = None  # what DDP waits on: ours, or the user's hook's
    sync: BucketSync | None = None  # set when reduced onto its owners (by its BucketSync)
    flat: Tensor | None = None  # its reduced gradients, once waited for
    wide: Tensor | None = None  # the user hook's average in the reduce dtype, if any
    updated: bool = False  # its pieces stepped and their all-gather started

    def ready(self) -> bool:
        """Whether its reduction is done (waiting for it would not block)."""
        if self.flat is not None:
            return True
        if self.sync is not None:
            return self.sync.grad_done()
        assert self.future is not None
        return self.future.done()

    def wait(self) -> Tensor:
        """Its reduced gradients, waiting for the reduction if need be."""
        if self.flat is None:
            if self.sync is not None:
                self.flat = self.sync.finish_grad()
            else:
                assert self.future is not None
                value = self.future.wait()
                self.flat = value if isinstance(value, Tensor) else value[0]
                self.flat = self.flat if self.wide is None else self.wide  # not its rounding
        return self.flat


class _Updater:
    """Updates one backward's buckets on a thread as their reductions arrive, in bucket order.

    On the CPU a reduction completes with no hook running, so the autograd thread would update
    only at the last bucket, the link idle meanwhile. Only this thread uses the twin group while it
    runs; the autograd thread joins it before reading what it did (and raises its error).
    """

    def __init__(self, update: Callable[[int], None]) -> None:
        self._update = update
        self._error: BaseException | None = None
        self._abandoned = False
        self._worker = comm.InOrder("zero-overlap-update")

    def _one(self, j: int) -> None:
        if self._error is None and not self._abandoned:
            try:
                self._update(j)
            except BaseException as e:  # raised by join(), on the autograd thread
                self._error = e

    def put(self, j: int) -> None:
        """Update bucket ``j`` once its reduction is done (after every bucket put before)."""
        self._worker.put(functools.partial(self._one, j))

    def join(self) -> None:
        """Wait until every bucket put is updated; raise what an update raised."""
        self._worker.join()
        if self._error is not None:
            raise self._error

    def abandon(self) -> None:
        """Let the thread end, updating nothing more (a backward that never finished)."""
        self._abandoned = True
        self._worker.close()


@dataclass(slots=True)
class _Backward:
    """What one backward has seen so far."""

    buckets: list[_Bucket] = field(default_factory=list)
    deferred: bool = False  # a bucket differed from the adopted structure: update at the last
    gathering: list[BucketSync] = field(default_factory=list)  # all-gathers started
    updater: _Updater | None = None  # updating its buckets on a thread (CPU, interleaved)

    def next_update(self) -> int:
        """The first bucket not yet updated (they are updated in bucket order)."""
        return sum(b.updated for b in self.buckets)


class OverlapState:
    """What overlap mode keeps between buckets and iterations (one per optimizer).

    Args:
        buckets: Each DDP bucket's sync (``nonblocking`` where gathered on a twin group).
        device: Where the scaler's verdict is agreed when this rank owns nothing.
        interleaved: Update each bucket while backward goes on (else at the last bucket).
        find_unused: DDP's ``find_unused_parameters``: update only what some rank used.
    """

    def __init__(
        self,
        shard: LocalShard,
        window: ParamWindow,
        buckets: DDPBuckets,
        ddp_group: comm.ProcessGroup,
        device: torch.device,
        *,
        shard_buckets: bool = False,
        interleaved: bool = False,
        grad_scaler: GradScaler | None = None,
        find_unused: bool = False,
    ) -> None:
        self.shard, self.window, self.buckets = shard, window, buckets
        self.ddp_group, self.device = ddp_group, device
        self.shard_buckets, self.interleaved = shard_buckets, interleaved
        self.nonblocking = buckets.wire.gather_group is not buckets.wire.group
        self.scaler = grad_scaler
        # DDP's find_unused_parameters: which parameters some rank used, at the last bucket
        self.find_unused, self.used = find_unused, cast("set[int] | None", None)
        self.skipped = 0
        self._facade = ScalerFacade()
        self.structure: tuple[tuple[int, ...], ...] | None = None
        self.restructures = 0
        self.reduced_buckets = 0
        self._backward = _Backward()

    @property
    def collectives(self) -> Collectives:
        """The strategy the buckets are reduced and gathered with."""
        return self.buckets.collectives

    @property
    def gather_group(self) -> comm.ProcessGroup:
        """The group the parameter all-gathers run on (a twin where ``nonblocking``)."""
        return self.buckets.wire.gather_group

    def _scaling(self) -> bool:
        return self.scaler is not None and self.scaler.is_enabled()

    def _sync(self, indices: tuple[int, ...]) -> BucketSync:
        """The sync of the bucket of ``indices`` under the shard's ownership now."""
        shard = self.shard
        return self.buckets.get(indices, shard.table, shard.ownership, shard.rank)

    def begins(self, bucket: GradBucket) -> bool:
        """Whether ``bucket`` is the first of a backward."""
        return bucket.index() == 0 or not self._backward.buckets

    def new_backward(self) -> None:
        """Forget the backward before (its update thread, if it ended early, is let go)."""
        if self._backward.updater is not None:
            self._backward.updater.abandon()
        self._backward = _Backward()

    def start(self, bucket: GradBucket) -> bool:
        """Register ``bucket``; whether to reduce it onto its owners (else the user's hook runs)."""
        i, bw = bucket.index(), self._backward
        indices = bucket_indices(self.shard.table, bucket.parameters())
        bw.buckets.append(_Bucket(indices))
        adopted = self.structure
        known = (  # as adopted: the same parameters, and the last bucket is the last one
            adopted is not None
            and adopted[i : i + 1] == (indices,)
            and not (bucket.is_last() and len(adopted) != i + 1)
        )
        if not bw.deferred and not known:
            bw.deferred = True
            if self.structure is not None:
                self.restructures += 1
            self._drain()
            # Earlier buckets may be reduced onto their owners under the adopted structure:
            # update them before the state moves, or, when a scaler must first see every
            # gradient, have the owners broadcast their runs so the new owners can step them.
            if self._scaling():
                for b in bw.buckets[:i]:
                    flat = b.wait()
                    if b.sync is not None:
                        b.sync.gatherer.start(flat).wait()
            else:
                self._update_until(i)
        return not bw.deferred and self.collectives != "allreduce+broadcast"

    def reduce(self, bucket: GradBucket) -> Future[Tensor]:
        """Average ``bucket`` onto the owners of its pieces; the future DDP waits on."""
        b = self._backward.buckets[bucket.index()]
        b.sync = self._sync(b.indices)
        b.sync.start_grad(bucket.buffer())
        self.reduced_buckets += 1
        out = bucket.buffer()
        # set once the bucket is updated (_update), with the reduced values
        return Future(devices=[out.device] if out.device.type == "cuda" else None)

    def on_bucket(self, bucket: GradBucket, fut: Future[Any], wide: Tensor | None = None) -> None:
        """Record the bucket's future (and ``wide`` average); update the buckets reduced already."""
        bw, i = self._backward, bucket.index()
        bw.buckets[i].future, bw.buckets[i].wide = fut, wide
        if self.interleaved and not bw.deferred and not self._scaling() and not self.find_unused:
            if self.nonblocking and threaded(bucket.buffer()):
                # each bucket as soon as its reduction is done, by a thread (see _Updater)
                if bw.updater is None:
                    bw.updater = _Updater(functools.partial(self._update, bw=bw))
                bw.updater.put(i)
            else:
                # buckets whose reduction is done, in order; without a twin group, one bucket
                # behind whatever it takes (its reduction has had one bucket's backward to finish)
                self._update_until(i, only_ready=self.nonblocking)

    def last_bucket(self) -> tuple[tuple[int, ...], ...] | None:
        """Wait for the update thread; a new bucket structure to adopt, or ``None``."""
        self._drain()
        bw = self._backward
        return tuple(b.indices for b in bw.buckets) if bw.deferred else None

    def finish_backward(self) -> None:
        """Update every bucket not updated yet, and hand the all-gathers to the window."""
        bw = self._backward
        if self.find_unused:  # the parameters some rank used in this backward: with a .grad
            params = self.shard.table.params
            local = torch.tensor([p.grad is not None for p in params], dtype=torch.bool)
            flags = comm.any_rank(local, self.ddp_group).tolist()
            self.used = {k for k, used in enumerate(flags) if used}
        skipped = self._scaling() and self._scaled_step()
        self._update_until(len(bw.buckets))
        for sync in bw.gathering:
            sync.finish_params()
        self._backward = _Backward()
        if not skipped:
            self.shard.hooks.stepped()

    def _drain(self) -> None:
        """Wait for this backward's update thread, if any, to update what it was given."""
        bw = self._backward
        if bw.updater is not None:
            updater, bw.updater = bw.updater, None
            updater.join()

    def _update_until(self, n: int, *, only_ready: bool = False, update: bool = True) -> None:
        """Update the buckets before ``n`` in order (``only_ready``: while reduced already)."""
        bw = self._backward
        while (j := bw.next_update()) < n and not (only_ready and not bw.buckets[j].ready()):
            self._update(j, update=update)

    def _update(self, j: int, *, update: bool = True, bw: _Backward | None = None) -> None:
        """Update this rank's pieces of bucket ``j`` of ``bw`` and start its all-gather."""
        bw = bw or self._backward
        b = bw.buckets[j]
        flat = b.wait()
        b.updated = True
        if update:
            sync = self._sync(b.indices)  # under the ownership now (adopted at the last bucket)
            self.window.finish()  # the last step's all-gathers write what this one updates
            self.shard.update(sync.owned_grads(flat, self.used))
            if self.shard.ownership.world_size > 1:
                # in place: backward no longer reads these parameters
                sync.start_params()
                bw.gathering.append(sync)
        if b.sync is not None:
            # on each rank only the pieces it owns hold the averaged gradient
            assert b.future is not None
            b.future.set_result(b.sync.rounded_back())

    def _scaled_step(self) -> bool:
        """With a GradScaler: one verdict on every rank, then update everything or nothing;
        whether it skipped."""
        assert self.scaler is not None
        buckets = self._backward.buckets
        owned = [
            g
            for b in buckets
            for g in self._sync(b.indices).owned_grads(b.wait(), self.used).values()
        ]
        group = self.buckets.wire.group
        if overlap_verdict(self.scaler, self._facade, owned, self.device, group):
            self.skipped += 1
            self._update_until(len(buckets), update=False)
            return True
        return False
