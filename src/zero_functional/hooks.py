"""DDP communication hooks: the ZeRO step inside backward, and DDP's bytes after it.

Two uses:

* :func:`hook_with_zero_step` / :func:`hook_with_zero_step_interleaved` (``overlap_with_ddp``):
  the step runs inside DDP's backward, bucket by bucket.
* :func:`reduce_scatter_hook` (step after backward): each bucket's gradients are reduced onto
  the ranks that own them only, so that ``step()``'s parameter all-gather completes one
  all-reduce's worth of bytes instead of adding half of one to DDP's (pytorch#69591).

Why torch's overlap hooks hang on gloo (pytorch#62300): they issue broadcasts from future
callbacks, which run on whichever communication thread finishes first, so ranks issue
collectives in different orders, and gloo pairs collectives by issue order. Here every collective
is issued from the hook itself, which DDP calls on the autograd thread in bucket order on every
rank; the only waits are on futures of collectives already issued in that shared order.

Why torch's lose 2 to 3 iterations: they wait for DDP to rebuild its buckets before they assign
buckets to ranks. Here the bucket structure is read off the buckets as they arrive; the first
backward (and any backward after DDP rebuilt its buckets) defers the updates to the last bucket,
where the whole structure is known, builds the ownership of that structure
(:func:`~zero_functional.ownership.bucket_ownership`), asks the optimizer to
:meth:`~zero_functional.optimizer.ZeroRedundancyOptimizer.reshard` its state to it, and updates.
Later backwards update bucket by bucket.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch._C._distributed_c10d import GradBucket
from torch.amp import GradScaler
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from zero_functional import comm
from zero_functional.amp import ScalerFacade, common_verdict, unscale_and_check_
from zero_functional.optimizer import ZeroRedundancyOptimizer
from zero_functional.ownership import Ownership, Run, bucket_ownership
from zero_functional.plans import COLLECTIVES, Collectives, buffer_runs, choose_collectives

__all__ = [
    "Collectives",
    "OverlapState",
    "choose_collectives",
    "hook_with_zero_step",
    "hook_with_zero_step_interleaved",
    "overlap_state",
    "reduce_scatter_hook",
]

Hook = Callable[[Any, GradBucket], Future[Tensor]]

_STATES: weakref.WeakKeyDictionary[ZeroRedundancyOptimizer, OverlapState] = (
    weakref.WeakKeyDictionary()
)


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
class _Reduce:
    """A reduce onto the owners in flight, and the future handed to DDP (set once updated)."""

    pending: comm.Pending
    future: Future[Tensor]
    flat: Tensor

    @classmethod
    def start(
        cls, flat: Tensor, runs: tuple[Run, ...], chunk: int | None, group: comm.ProcessGroup
    ) -> _Reduce:
        """Start reducing each run of ``flat`` onto its owner."""
        pending = comm.start_reduce(flat, runs, group, chunk=chunk)
        fut: Future[Tensor] = Future(devices=[flat.device] if flat.device.type == "cuda" else None)
        return cls(pending, fut, flat)


@dataclass(slots=True)
class _Bucket:
    """One bucket of the backward in progress: its parameters and its reduction."""

    indices: tuple[int, ...]
    status: BucketStatus = BucketStatus.ARRIVED
    future: Future[Any] | None = None  # what DDP waits on: ours, or the user's hook's
    reduce: _Reduce | None = None  # set when reduced onto its owners
    flat: Tensor | None = None  # its reduced gradients, once REDUCED

    def ready(self) -> bool:
        """Whether its reduction is done (waiting for it would not block)."""
        if self.flat is not None:
            return True
        if self.reduce is not None:
            return self.reduce.pending.done()
        assert self.future is not None
        return self.future.done()

    def wait(self) -> Tensor:
        """Its reduced gradients, waiting for the reduction if need be."""
        if self.flat is None:
            if self.reduce is not None:
                self.reduce.pending.wait()
                self.flat = self.reduce.flat
            else:
                assert self.future is not None
                value = self.future.wait()
                self.flat = value if isinstance(value, Tensor) else value[0]
            self.status = BucketStatus.REDUCED
        return self.flat

    def owned_grads(
        self, zero: ZeroRedundancyOptimizer, used: set[int] | None
    ) -> dict[int, Tensor]:
        """The gradients of the pieces ``zero``'s rank owns (of ``used`` parameters only)."""
        flat = self.wait()
        return {
            k: flat[lo:hi]
            for k, lo, hi in zero.ownership.owned_slices(self.indices, zero.rank)
            if used is None or k in used
        }


@dataclass(slots=True)
class _Backward:
    """What one backward has seen so far."""

    buckets: list[_Bucket] = field(default_factory=list)
    deferred: bool = False  # a bucket differed from the adopted structure: update at the last
    gathers: list[tuple[comm.Pending, Sequence[Tensor]]] = field(default_factory=list)

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


def _bucket_runs(
    ownership: Ownership, structure: tuple[tuple[int, ...], ...], collectives: Collectives
) -> dict[int, tuple[tuple[Run, ...], int | None]]:
    """Per bucket of ``structure``, its buffer's runs under ``ownership`` and their chunk."""
    even = collectives == "reduce_scatter+all_gather"
    # an uneven bucket takes reduces and broadcasts under either strategy
    return {b: buffer_runs(ownership, indices, even=even) for b, indices in enumerate(structure)}


def _indices(index: dict[Tensor, int], bucket: GradBucket) -> tuple[int, ...]:
    """The global indices of ``bucket``'s parameters, or an error naming the fix."""
    try:
        return tuple(index[p] for p in bucket.parameters())
    except KeyError as e:
        raise RuntimeError(
            "a DDP gradient bucket holds a parameter this ZeroRedundancyOptimizer does not "
            "manage: build it from ddp.parameters() (or model.parameters())"
        ) from e


def _used_anywhere(params: Sequence[Tensor], group: comm.ProcessGroup) -> set[int]:
    """The parameters some rank used in this backward: those with a gradient now (DDP fills
    the buckets of unused ones with zeros but leaves their ``.grad`` as it was)."""
    local = torch.tensor([p.grad is not None for p in params], dtype=torch.bool)
    flags = comm.any_rank(local, group)
    return {k for k, used in enumerate(flags.tolist()) if used}


def _gather_group(
    zero: ZeroRedundancyOptimizer, interleaved: bool
) -> tuple[comm.ProcessGroup, bool]:
    """The group the parameter all-gathers run on, and whether it is not ``zero``'s own.

    Interleaved, the all-gathers run on a twin group where one can be made, so a bucket is
    updated as soon as its reduction is done, never waited for on the autograd thread.
    """
    if interleaved and zero.world_size > 1:
        twin = comm.twin_group(zero.process_group)
        if twin is not None:
            return twin, True
    return zero.process_group, False


class OverlapState:
    """What overlap mode keeps between buckets and iterations (one per optimizer).

    Attributes:
        collectives: The strategy the hook uses (see :func:`choose_collectives`).
        structure: The bucket structure adopted (per bucket, its parameters' global indices),
            or ``None`` before the first backward.
        restructures: Backwards whose buckets differed from the adopted structure.
        reduced_buckets: Buckets reduced onto their owners (rather than by the user's hook).
        skipped: Backwards whose update was skipped because a gradient was not finite (with
            a ``GradScaler``).
    """

    def __init__(
        self,
        zero: ZeroRedundancyOptimizer,
        shard_buckets: bool,
        interleaved: bool,
        collectives: Collectives,
        grad_scaler: GradScaler | None = None,
        find_unused: bool = False,
    ) -> None:
        # weakly: _STATES is keyed by `zero`, and a value that held its key would keep the
        # optimizer, its process group and the twin group alive to interpreter exit (issue 20)
        self._zero = weakref.ref(zero)
        # DDP's find_unused_parameters: a parameter no rank used has no gradient afterwards
        # and torch's optimizers skip it; that is known on every rank only at the last bucket
        self.find_unused = find_unused
        self.used: set[int] | None = None
        self.shard_buckets = shard_buckets
        self.interleaved = interleaved
        self.collectives: Collectives = collectives
        self.scaler = grad_scaler
        self.gather_group, self.nonblocking = _gather_group(zero, interleaved)
        self.skipped = 0  # backwards whose update the scaler skipped (non-finite gradients)
        self._facade = ScalerFacade()
        self.params = [p for g in zero.param_groups for p in g["params"]]
        self.index = {p: i for i, p in enumerate(self.params)}
        self.structure: tuple[tuple[int, ...], ...] | None = None
        self.restructures = 0
        self.reduced_buckets = 0
        self._runs: dict[int, tuple[tuple[Run, ...], int | None]] = {}
        self._backward = _Backward()

    @property
    def zero(self) -> ZeroRedundancyOptimizer:
        """The optimizer (held weakly; its hook holds it while DDP runs the hook)."""
        zero = self._zero()
        assert zero is not None, "the ZeroRedundancyOptimizer was garbage-collected"
        return zero

    def _scaling(self) -> bool:
        return self.scaler is not None and self.scaler.is_enabled()

    def start(self, bucket: GradBucket) -> bool:
        """Register ``bucket``; whether to reduce it onto its owners (else the user's hook runs).

        Every input of this decision (bucket indices, the structure adopted so far) is the same
        on every rank, so all ranks issue the same collectives in the same order.
        """
        i, bw = bucket.index(), self._backward
        if i == 0 or not bw.buckets:  # a new backward
            self.zero.check_trainable()  # unfreezing is an error before anything moves
            bw = self._backward = _Backward()
        indices = _indices(self.index, bucket)
        bw.buckets.append(_Bucket(indices))
        if not bw.deferred and not _known(self.structure, i, indices, bucket.is_last()):
            bw.deferred = True
            if self.structure is not None:
                self.restructures += 1
            # Buckets before this one match the adopted structure and may have been reduced onto
            # their owners under it: finish them with that ownership before adopt() moves state,
            # or, when a scaler must first see every gradient, give every rank their reduced
            # values (the owners broadcast their runs) so the new owners can step them.
            if self._scaling():
                for j, b in enumerate(bw.buckets[:i]):
                    flat = b.wait()
                    if self.collectives != "allreduce+broadcast":
                        comm.start_broadcast(flat, self._runs[j][0], self.zero.process_group).wait()
            else:
                self._update_until(i)
        return not bw.deferred and self.collectives != "allreduce+broadcast"

    def reduce(self, bucket: GradBucket) -> Future[Tensor]:
        """Average ``bucket`` onto the owners of its pieces; the future DDP waits on."""
        b = self._backward.buckets[bucket.index()]
        flat = bucket.buffer()
        flat.div_(self.zero.world_size)  # as DDP's allreduce_hook: divide, then sum
        runs, chunk = self._runs[bucket.index()]
        b.reduce = _Reduce.start(flat, runs, chunk, self.zero.process_group)
        self.reduced_buckets += 1
        return b.reduce.future

    def on_bucket(self, bucket: GradBucket, fut: Future[Any]) -> None:
        """Record the bucket's future; update finished buckets (the last bucket: all of them)."""
        bw, i = self._backward, bucket.index()
        bw.buckets[i].future, bw.buckets[i].status = fut, BucketStatus.REDUCING
        if self.interleaved and not bw.deferred and not self._scaling() and not self.find_unused:
            # buckets whose reduction is done, in order; without a twin group, one bucket
            # behind whatever it takes (its reduction has had one bucket's backward to finish)
            self._update_until(i, only_ready=self.nonblocking)
        if bucket.is_last():
            if bw.deferred:
                self.adopt(tuple(b.indices for b in bw.buckets))
            if self.find_unused:
                self.used = _used_anywhere(self.params, self.zero.process_group)
            if self._scaling():
                self._scaled_step()
            self._update_until(len(bw.buckets))
            # waited for now, or (overlap_param_gather) by the next forward, module by module
            self.zero.defer_param_sync(bw.gathers)
            self._backward = _Backward()

    def adopt(self, structure: tuple[tuple[int, ...], ...]) -> None:
        """Own the buckets of ``structure`` and move the optimizer's state accordingly.

        Collective: every rank calls it with the same structure (the hook does, at the last
        bucket of a backward whose buckets are new). Tests call it to simulate a rebuild.
        """
        zero = self.zero
        ownership = bucket_ownership(
            structure,
            zero.ownership.numels,
            zero.world_size,
            partition=zero.partition,
            shard_buckets=self.shard_buckets,
        )
        zero.reshard(ownership)
        self._runs = _bucket_runs(ownership, structure, self.collectives)
        self.structure = structure

    def _update_until(self, n: int, *, only_ready: bool = False, update: bool = True) -> None:
        """Update the buckets before ``n`` in order (``only_ready``: while reduced already)."""
        bw = self._backward
        while (j := bw.next_update()) < n and not (only_ready and not bw.buckets[j].ready()):
            self._update(j, update=update)

    def _update(self, j: int, *, update: bool = True) -> None:
        """Update this rank's pieces of bucket ``j`` and start the all-gather of the bucket."""
        bw, zero = self._backward, self.zero
        b = bw.buckets[j]
        flat = b.wait()
        b.status = BucketStatus.UPDATED
        if update:
            zero.update_owned(b.owned_grads(zero, self.used))
            if zero.world_size > 1:
                # in place: these parameters' grads are final, so backward no longer reads
                # them; the owners' values are on every rank once the backward has finished
                runs, chunk = self._runs[j]
                bw.gathers += zero.param_sync.start_gather(
                    b.indices, self.gather_group, runs, chunk
                )
        if b.reduce is not None:
            # on each rank only the pieces it owns hold the averaged gradient
            b.reduce.future.set_result(flat)

    def _scaled_step(self) -> None:
        """With a GradScaler: unscale every owned gradient, decide on every rank together
        whether any was non-finite, tell the scaler, then update everything or nothing."""
        assert self.scaler is not None
        buckets = self._backward.buckets
        owned = [g for b in buckets for g in b.owned_grads(self.zero, self.used).values()]
        device = owned[0].device if owned else self.zero.join_device
        found = unscale_and_check_(owned, 1.0 / self.scaler.get_scale(), device)
        found = comm.all_reduce_scalar(found, self.zero.process_group, op="max")
        self._facade.record(self.scaler, found)
        if bool(found.item()):
            self.skipped += 1
            self._update_until(len(buckets), update=False)


def overlap_state(zero: ZeroRedundancyOptimizer) -> OverlapState | None:
    """The overlap state of the hook registered for ``zero``, or ``None`` (for inspection)."""
    return _STATES.get(zero)


def _check_ddp(ddp: DistributedDataParallel, zero: ZeroRedundancyOptimizer) -> None:
    ddp_params = {p for p in ddp.parameters() if p.requires_grad}
    mine = {p for g in zero.param_groups for p in g["params"]}
    missing = ddp_params - mine
    if missing:
        raise ValueError(
            f"{len(missing)} trainable parameters of the DDP module are not in the "
            "ZeroRedundancyOptimizer: build it from ddp.parameters()"
        )
    ddp_group = getattr(ddp, "process_group", None) or zero.process_group
    if comm.group_size(ddp_group) != zero.world_size:
        raise ValueError(
            f"the DDP module runs on {comm.group_size(ddp_group)} ranks but the "
            f"ZeroRedundancyOptimizer on {zero.world_size}: give both the same process group"
        )


def _with_annotations(fn: Hook) -> Hook:
    # DDP checks the annotations themselves, which `from __future__ import annotations` turns
    # into strings: give it the real objects.
    fn.__annotations__ = {
        "state": Any,
        "bucket": GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }
    return fn


def _make_hook(
    hook: Hook,
    ddp: DistributedDataParallel,
    zero: ZeroRedundancyOptimizer,
    shard_buckets: bool,
    interleaved: bool,
    collectives: Collectives | None,
    grad_scaler: GradScaler | None,
) -> Hook:
    if not isinstance(zero, ZeroRedundancyOptimizer) or not zero.overlap_with_ddp:
        raise ValueError(
            "ZeroRedundancyOptimizer must be constructed with `overlap_with_ddp=True` to use "
            "this hook properly"
        )
    if zero in _STATES:
        raise RuntimeError("this ZeroRedundancyOptimizer already has an overlap hook registered")
    _check_ddp(ddp, zero)
    ddp_ref = weakref.ref(ddp)
    default = hook is default_hooks.allreduce_hook
    if collectives is None:
        collectives = choose_collectives(
            comm.backend(zero.process_group),
            zero.world_size,
            hook_is_allreduce=default,
            even=zero.partition == "flat",
        )
    elif collectives not in COLLECTIVES:
        raise ValueError(f"collectives must be one of {COLLECTIVES}, got {collectives!r}")
    elif collectives != "allreduce+broadcast" and not default:
        raise ValueError(
            f"collectives={collectives!r} replaces DDP's default allreduce_hook; a custom "
            f"hook ({getattr(hook, '__name__', hook)!r}) keeps its own reduction: use "
            "'allreduce+broadcast'"
        )
    if zero.world_size == 1:
        collectives = "allreduce+broadcast"
    if grad_scaler is not None and not isinstance(grad_scaler, GradScaler):
        raise TypeError(
            f"grad_scaler must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}"
        )
    overlap = OverlapState(
        zero,
        shard_buckets,
        interleaved,
        collectives,
        grad_scaler,
        find_unused=bool(getattr(ddp, "find_unused_parameters", False)),
    )
    _STATES[zero] = overlap

    def hook_with_zero_fn(state: Any, bucket: GradBucket) -> Future[Tensor]:
        assert ddp_ref() is not None, "the DDP module was garbage-collected"
        name = f"backward() (hook_with_zero_step, bucket {bucket.index()})"
        with comm.call(name, zero.process_group, timeout=zero.timeout):
            substitute = overlap.start(bucket) and (state is None or state is zero.process_group)
            fut = overlap.reduce(bucket) if substitute else hook(state, bucket)
            overlap.on_bucket(bucket, fut)
        return fut

    return _with_annotations(hook_with_zero_fn)


def hook_with_zero_step(
    hook: Hook,
    ddp: DistributedDataParallel,
    zero: ZeroRedundancyOptimizer,
    shard_buckets: bool = False,
    *,
    collectives: Collectives | None = None,
    grad_scaler: GradScaler | None = None,
) -> Hook:
    """Wrap a DDP comm hook so that the ZeRO step runs at the end of backward.

    Each gradient bucket is reduced (by ``hook``, or, for DDP's default ``allreduce_hook``
    where :func:`choose_collectives` says so, onto the owners of its pieces only: plain DDP's
    bytes); when the last bucket arrives, each rank updates the pieces of every bucket it owns
    and the owners' values are gathered everywhere, bucket by bucket. Works on every backend,
    gloo included, and updates from the first iteration. Under ``partition="flat"`` every rank
    owns ``1 / world_size`` of every bucket, so a model in one bucket is sharded too.

    After backward, ``p.grad`` holds the averaged gradient on every rank with
    ``"allreduce+broadcast"``; otherwise only in the pieces this rank owns (elsewhere it is a
    partial sum), as in any reduce-scatter ZeRO.

    Args:
        hook: A DDP communication hook, e.g. ``default_hooks.allreduce_hook``.
        ddp: The ``DistributedDataParallel`` module.
        zero: A ``ZeroRedundancyOptimizer`` built with ``overlap_with_ddp=True`` from
            ``ddp.parameters()``.
        shard_buckets: Under ``"sorted_greedy"``, split each bucket across ranks to balance
            the update (torch's rule).
        collectives: Override :func:`choose_collectives` (anything but
            ``"allreduce+broadcast"`` needs the default ``allreduce_hook``, which it replaces).
        grad_scaler: The ``torch.amp.GradScaler`` that scaled the loss. Gradients are unscaled
            before the update; if any rank has a non-finite gradient in this backward, no
            parameter changes on any rank, and the next ``scaler.update()`` lowers the scale,
            exactly as ``scaler.step(optimizer)`` would with DDP. Deciding "skip" needs every
            bucket, so with a scaler the update waits for the last bucket (no interleaving).

    Returns:
        The hook to pass to ``ddp.register_comm_hook(None, ...)``.

    Example:
        >>> # ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
        >>> # with mixed precision:
        >>> # hook_with_zero_step(allreduce_hook, ddp, zero, grad_scaler=scaler)
        >>> # scaler.scale(loss).backward(); scaler.update()   # no scaler.step(zero)
    """
    return _make_hook(
        hook,
        ddp,
        zero,
        shard_buckets,
        interleaved=False,
        collectives=collectives,
        grad_scaler=grad_scaler,
    )


def hook_with_zero_step_interleaved(
    hook: Hook,
    ddp: DistributedDataParallel,
    zero: ZeroRedundancyOptimizer,
    shard_buckets: bool = False,
    *,
    collectives: Collectives | None = None,
    grad_scaler: GradScaler | None = None,
) -> Hook:
    """Like :func:`hook_with_zero_step`, but each bucket is updated while backward goes on.

    When bucket ``i`` arrives, every earlier bucket whose reduction has completed is updated
    and its all-gather started, in bucket order, so the step overlaps the backward computation
    too, and the autograd thread never waits for a reduction. The all-gathers go through a
    second process group over the same ranks (made when the hook is), so each group's
    collectives are issued in the same order on every rank whatever the timing: it never
    hangs on gloo. (Where no second group can be made, bucket ``i - 1`` is updated when
    bucket ``i`` arrives, waiting for its reduction if need be.)

    Example:
        >>> # ddp.register_comm_hook(None, hook_with_zero_step_interleaved(allreduce_hook, ddp, zero))
    """
    return _make_hook(
        hook,
        ddp,
        zero,
        shard_buckets,
        interleaved=True,
        collectives=collectives,
        grad_scaler=grad_scaler,
    )


def reduce_scatter_hook(
    ddp: DistributedDataParallel,
    zero: ZeroRedundancyOptimizer,
    *,
    grad_scaler: GradScaler | None = None,
) -> Hook:
    """DDP's gradient averaging, but each piece summed onto its owner only (step after backward).

    The recipe that gives ZeRO plain DDP's bytes outside overlap mode::

        zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, partition="flat")
        ddp.register_comm_hook(None, reduce_scatter_hook(ddp, zero))
        loss.backward()   # gradients reduced onto their owners: half an all-reduce
        zero.step()       # owners update, then all-gather: the other half

    Without it, DDP all-reduces every gradient and ``step()`` broadcasts on top: 1.5x. After
    backward, ``p.grad`` holds the averaged gradient only in the pieces this rank owns; use
    :meth:`~zero_functional.optimizer.ZeroRedundancyOptimizer.clip_grad_norm_` rather than
    ``torch.nn.utils.clip_grad_norm_``, which would read other ranks' pieces. Gradient
    accumulation with ``ddp.no_sync()`` works as with DDP (the hook runs on the syncing
    backward). Each bucket's reduces are issued from the hook, in bucket order on every rank,
    so it is safe on gloo.

    With mixed precision, pass the ``GradScaler``: ``scaler.step(zero)`` decides on each rank
    from that rank's gradients, and after a reduce-scatter no rank sees them all, so the hook
    makes the verdict common: at the last bucket it checks the pieces this rank owns, combines
    the verdicts (one all-reduce of a flag), zeroes the pieces it does not own and, if any rank
    saw a non-finite gradient, puts a NaN in the last bucket on every rank. Every rank's
    scaler then skips (or takes) the step together, and lowers the scale together.

    Args:
        ddp: The ``DistributedDataParallel`` module.
        zero: A ``ZeroRedundancyOptimizer`` (not in overlap mode) over ``ddp.parameters()``.
        grad_scaler: The ``torch.amp.GradScaler`` whose ``step(zero)`` follows backward.

    Returns:
        The hook to pass to ``ddp.register_comm_hook(None, ...)``.

    Example:
        >>> # ddp.register_comm_hook(None, reduce_scatter_hook(ddp, zero))
        >>> # ddp.register_comm_hook(None, reduce_scatter_hook(ddp, zero, grad_scaler=scaler))
    """
    if not isinstance(zero, ZeroRedundancyOptimizer) or zero.overlap_with_ddp:
        raise ValueError(
            "reduce_scatter_hook serves a ZeroRedundancyOptimizer that steps after backward; "
            "with overlap_with_ddp=True use hook_with_zero_step(allreduce_hook, ddp, zero)"
        )
    _check_ddp(ddp, zero)
    params = [p for g in zero.param_groups for p in g["params"]]
    index = {p: i for i, p in enumerate(params)}
    world = zero.world_size
    even = choose_collectives(comm.backend(zero.process_group), world, even=True) == (
        "reduce_scatter+all_gather"
    )
    cache: dict[tuple[int, ...], tuple[tuple[Run, ...], int | None]] = {}
    seen: list[object] = [zero.ownership]

    def runs_of(indices: tuple[int, ...]) -> tuple[tuple[Run, ...], int | None]:
        ownership = zero.ownership
        if ownership is not seen[0]:
            cache.clear()
            seen[0] = ownership
        if indices not in cache:
            cache[indices] = buffer_runs(ownership, indices, even=even)
        return cache[indices]

    def reduce_scatter_fn(state: Any, bucket: GradBucket) -> Future[Tensor]:
        flat = bucket.buffer()
        if world == 1:
            done: Future[Tensor] = Future()
            done.set_result(flat)
            return done
        indices = _indices(index, bucket)
        runs, chunk = runs_of(indices)
        flat.div_(world)
        name = f"backward() (reduce_scatter_hook, bucket {bucket.index()})"
        with comm.call(name, zero.process_group, timeout=zero.timeout):
            pending = comm.start_reduce(flat, runs, zero.process_group, chunk=chunk)
            if grad_scaler is None or not grad_scaler.is_enabled():
                return pending.future(flat)
            if bucket.index() == 0:
                scaled.clear()
            scaled.append((flat, runs, pending))
            if bucket.is_last():
                common_verdict(scaled, zero.rank, zero.process_group)
                scaled.clear()
        return pending.future(flat)

    scaled: list[tuple[Tensor, tuple[Run, ...], comm.Pending]] = []
    return _with_annotations(reduce_scatter_fn)
