"""Overlap mode's state: per bucket of a backward, from arrival to reduced, updated and gathered.

What :func:`~zero_functional.hooks.hook_with_zero_step` and its interleaved twin keep between
buckets and iterations (:class:`OverlapState`): a state machine per bucket
(:class:`BucketStatus`), small records for the work in flight, and the bucket structure adopted
so far. It drives each bucket's :class:`~zero_functional.shell.bucket_sync.BucketSync` (the
reduction onto the owners, the all-gather back) and this rank's
:class:`~zero_functional.shell.local_shard.LocalShard` (the update); the hook, which holds the
optimizer, adopts a new bucket structure.
"""

from __future__ import annotations

import enum
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
from zero_functional.core.param_table import ParamTable
from zero_functional.core.plans import Collectives
from zero_functional.shell.amp import ScalerFacade, overlap_verdict
from zero_functional.shell.bucket_sync import BucketSync, DDPBuckets, bucket_indices
from zero_functional.shell.local_shard import LocalShard
from zero_functional.shell.param_window import ParamWindow

__all__ = ["BucketStatus", "OverlapState", "threaded"]


def threaded(buffer: Tensor) -> bool:
    """Whether interleaved overlap mode updates a bucket of ``buffer`` on a thread of its own
    as soon as its reduction is done (:class:`_Updater`): on the CPU. On a GPU the hooks'
    thread only launches the work, in stream order, so it stays there.

    Example:
        >>> threaded(torch.zeros(2)), threaded(torch.zeros(2, device="meta"))
        (True, False)
    """
    return buffer.device.type == "cpu"


class BucketStatus(enum.Enum):
    """Where a bucket of the backward in progress stands; buckets move on in bucket order.

    ``ARRIVED``: the hook registered it. ``REDUCING``: its reduction is issued (onto its owners
    by :meth:`OverlapState.reduce`, or by the user's hook). ``REDUCED``: waited for, its
    gradients final. ``UPDATED``: this rank's pieces stepped (or the step skipped) and their
    all-gather started.
    """

    ARRIVED = enum.auto()
    REDUCING = enum.auto()
    REDUCED = enum.auto()
    UPDATED = enum.auto()


@dataclass(slots=True)
class _Bucket:
    """One bucket of the backward in progress: its parameters and its reduction."""

    indices: tuple[int, ...]
    status: BucketStatus = BucketStatus.ARRIVED
    future: Future[Any] | None = None  # what DDP waits on: ours, or the user's hook's
    sync: BucketSync | None = None  # set when reduced onto its owners (by its BucketSync)
    flat: Tensor | None = None  # its reduced gradients, once REDUCED
    wide: Tensor | None = None  # the user hook's average in the reduce dtype, if any

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
            self.status = BucketStatus.REDUCED
        return self.flat


class _Updater:
    """Updates one backward's buckets as their reductions arrive, in order, on a thread
    (:class:`~zero_functional.comm.worker.InOrder`).

    On the CPU a bucket's reduction is done without any hook running: the next bucket may be
    the last, at the end of backward (DDP's small first bucket, then one large one), so the
    autograd thread would update and all-gather the first bucket only then, with the link
    idle meanwhile. The thread waits for each reduction in bucket order (never on one of
    gloo's threads: a work's future runs its callbacks before the work counts as completed),
    updates this rank's pieces and starts the bucket's all-gather on the twin group, while the
    autograd thread goes on with backward. Only this thread issues the twin group's
    collectives while it runs, in bucket order, so every rank issues them in the same order.
    The autograd thread hands it buckets (:meth:`put`) and joins it (:meth:`join`) before
    reading what it did; an error here is raised there, and nothing after it is updated.
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
        return sum(b.status is BucketStatus.UPDATED for b in self.buckets)


def _known(
    structure: tuple[tuple[int, ...], ...] | None, i: int, indices: tuple[int, ...], last: bool
) -> bool:
    """Whether bucket ``i`` (its parameters' ``indices``; the last bucket or not) is as adopted.

    Example:
        >>> s = ((0, 1), (2,))
        >>> _known(s, 1, (2,), last=True), _known(s, 0, (0, 1), last=True)
        (True, False)
        >>> _known(s, 1, (2, 3), last=True), _known(None, 0, (0, 1), last=False)
        (False, False)
    """
    return (
        structure is not None
        and i < len(structure)
        and structure[i] == indices
        and not (last and len(structure) != i + 1)
    )


def _used_anywhere(table: ParamTable, group: comm.ProcessGroup) -> set[int]:
    """The parameters some rank used in this backward: those with a gradient now (DDP fills
    the buckets of unused ones with zeros but leaves their ``.grad`` as it was)."""
    local = torch.tensor([p.grad is not None for p in table.params], dtype=torch.bool)
    flags = comm.any_rank(local, group)
    return {k for k, used in enumerate(flags.tolist()) if used}


class OverlapState:
    """What overlap mode keeps between buckets and iterations (one per optimizer).

    Args:
        shard: This rank's pieces and their update.
        window: Where the parameter all-gathers go when the backward ends.
        buckets: Each DDP bucket's sync (the strategy, the plans, the wire: its gathers run on
            a twin group where the buckets are updated without waiting: ``nonblocking``).
        ddp_group: The group DDP averages over (which parameters some rank used).
        device: Where the scaler's verdict is agreed when this rank owns nothing.
        shard_buckets: Torch's rule of splitting each bucket under ``"sorted_greedy"``.
        interleaved: Update each bucket while backward goes on (else at the last bucket).
        grad_scaler: The ``GradScaler`` whose verdict every rank shares.
        find_unused: DDP's ``find_unused_parameters``: update only what some rank used.

    Attributes:
        structure: The bucket structure adopted (per bucket, its parameters' global indices;
            ``None`` before the first backward); ``restructures`` counts changes of it,
            ``reduced_buckets`` the buckets reduced onto their owners (not by the user's hook)
            and ``skipped`` the backwards a ``GradScaler`` skipped.
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
        """Whether ``bucket`` is the first of a backward (the hook then checks what trains and
        calls :meth:`new_backward`)."""
        return bucket.index() == 0 or not self._backward.buckets

    def new_backward(self) -> None:
        """Forget the backward before (its update thread, if it ended early, is let go)."""
        if self._backward.updater is not None:
            self._backward.updater.abandon()
        self._backward = _Backward()

    def start(self, bucket: GradBucket) -> bool:
        """Register ``bucket``; whether to reduce it onto its owners (else the user's hook runs).

        Every input of this decision (bucket indices, the structure adopted so far) is the same
        on every rank, so all ranks issue the same collectives in the same order.
        """
        i, bw = bucket.index(), self._backward
        indices = bucket_indices(self.shard.table, bucket.parameters())
        bw.buckets.append(_Bucket(indices))
        if not bw.deferred and not _known(self.structure, i, indices, bucket.is_last()):
            bw.deferred = True
            if self.structure is not None:
                self.restructures += 1
            self._drain()
            # Buckets before this one match the adopted structure and may have been reduced onto
            # their owners under it: finish them with that ownership before the state moves,
            # or, when a scaler must first see every gradient, give every rank their reduced
            # values (the owners broadcast their runs) so the new owners can step them.
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
        """Record the bucket's future (and ``wide``: its average in the reduce dtype, which
        the update reads); update the buckets whose reduction is done."""
        bw, i = self._backward, bucket.index()
        bw.buckets[i].future, bw.buckets[i].status = fut, BucketStatus.REDUCING
        bw.buckets[i].wide = wide
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
        """At the last bucket: wait for the update thread; the bucket structure to adopt
        before the update (a new one: the hook reshards the state to it), or ``None``."""
        self._drain()
        bw = self._backward
        return tuple(b.indices for b in bw.buckets) if bw.deferred else None

    def finish_backward(self) -> None:
        """Update every bucket not updated yet (all or none, with a scaler), and hand the
        all-gathers to the window: waited for now, or (overlap_param_gather) by the next forward."""
        bw = self._backward
        if self.find_unused:
            self.used = _used_anywhere(self.shard.table, self.ddp_group)
        if self._scaling():
            self._scaled_step()
        self._update_until(len(bw.buckets))
        for sync in bw.gathering:
            sync.finish_params()
        self._backward = _Backward()

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
        """Update this rank's pieces of bucket ``j`` (of ``bw``, by default the backward in
        progress) and start the all-gather of the bucket."""
        bw = bw or self._backward
        b = bw.buckets[j]
        flat = b.wait()
        b.status = BucketStatus.UPDATED
        if update:
            sync = self._sync(b.indices)  # under the ownership now (adopted at the last bucket)
            self.window.finish()  # the last step's all-gathers write what this one updates
            self.shard.update(sync.owned_grads(flat, self.used))
            if self.shard.ownership.world_size > 1:
                # in place: these parameters' grads are final, so backward no longer reads
                # them; the owners' values are on every rank once the backward has finished
                sync.start_params()
                bw.gathering.append(sync)
        if b.sync is not None:
            # on each rank only the pieces it owns hold the averaged gradient
            assert b.future is not None
            b.future.set_result(b.sync.rounded_back())

    def _scaled_step(self) -> None:
        """With a GradScaler: unscale every owned gradient, one verdict on every rank
        (:func:`~zero_functional.shell.amp.overlap_verdict`), then update everything or nothing."""
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
