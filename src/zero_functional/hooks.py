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
from zero_functional.ownership import Run, bucket_ownership
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


@dataclass
class _Iteration:
    """What one backward has seen so far."""

    indices: list[tuple[int, ...]] = field(default_factory=list)
    futures: list[Future[Any]] = field(default_factory=list)
    # per bucket reduced onto its owners: the reduce in flight and the future handed to DDP
    reduces: dict[int, tuple[comm.Pending, Future[Tensor], Tensor]] = field(default_factory=dict)
    # per bucket whose reduction is done: its gradients and the future handed to DDP (if ours)
    complete: dict[int, tuple[Tensor, Future[Tensor] | None]] = field(default_factory=dict)
    processed: int = 0
    deferred: bool = False
    pending: list[tuple[comm.Pending, Sequence[Tensor]]] = field(default_factory=list)


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
        self.zero = zero
        # DDP's find_unused_parameters: a parameter no rank used has no gradient afterwards
        # and torch's optimizers skip it; that is known on every rank only at the last bucket
        self.find_unused = find_unused
        self.used: set[int] | None = None
        self.shard_buckets = shard_buckets
        self.interleaved = interleaved
        self.collectives: Collectives = collectives
        self.scaler = grad_scaler
        # interleaved: the all-gather runs on a twin group, so a bucket is updated as soon as
        # its reduction is done, never waited for on the autograd thread
        self.gather_group = zero.process_group
        self.nonblocking = False
        if interleaved and zero.world_size > 1:
            twin = comm.twin_group(zero.process_group)
            if twin is not None:
                self.gather_group, self.nonblocking = twin, True
        self.skipped = 0  # backwards whose update the scaler skipped (non-finite gradients)
        self._facade = ScalerFacade()
        self.params = [p for g in zero.param_groups for p in g["params"]]
        self.index = {p: i for i, p in enumerate(self.params)}
        self.structure: tuple[tuple[int, ...], ...] | None = None
        self.it: _Iteration | None = None
        self.restructures = 0
        self.reduced_buckets = 0
        self._runs: dict[int, tuple[tuple[Run, ...], int | None]] = {}

    # -------------------------------------------------------------- per bucket

    def start(self, bucket: GradBucket) -> bool:
        """Register ``bucket``; whether to reduce it onto its owners (else the user's hook runs).

        Every input of this decision (bucket indices, the structure adopted so far) is the same
        on every rank, so all ranks issue the same collectives in the same order.
        """
        i = bucket.index()
        if i == 0 or self.it is None:
            self.zero.check_trainable()  # unfreezing is an error before anything moves
            self.it = _Iteration()
        it = self.it
        try:
            indices = tuple(self.index[p] for p in bucket.parameters())
        except KeyError as e:
            raise RuntimeError(
                "a DDP gradient bucket holds a parameter this ZeroRedundancyOptimizer does not "
                "manage: build it from ddp.parameters() (or model.parameters())"
            ) from e
        it.indices.append(indices)
        s = self.structure
        known = (
            s is not None
            and i < len(s)
            and s[i] == indices
            and not (bucket.is_last() and len(s) != i + 1)
        )
        if not known and not it.deferred:
            it.deferred = True
            if s is not None:
                self.restructures += 1
            # Buckets before this one match the adopted structure and may have been reduced onto
            # their owners under it: finish them with that ownership before adopt() moves state,
            # or, when a scaler must first see every gradient, give every rank their reduced
            # values (the owners broadcast their runs) so the new owners can step them.
            if self._scaling():
                for j in range(i):
                    self._complete_everywhere(j)
            else:
                while it.processed < i:
                    self._process(it.processed)
        return not it.deferred and self.collectives != "allreduce+broadcast"

    def reduce(self, bucket: GradBucket) -> Future[Tensor]:
        """Average ``bucket`` onto the owners of its pieces; the future DDP waits on."""
        it = self.it
        assert it is not None
        i = bucket.index()
        flat = bucket.buffer()
        flat.div_(self.zero.world_size)  # as DDP's allreduce_hook: divide, then sum
        runs, chunk = self._runs[i]
        pending = comm.start_reduce(flat, runs, self.zero.process_group, chunk=chunk)
        fut: Future[Tensor] = Future(devices=[flat.device] if flat.device.type == "cuda" else None)
        it.reduces[i] = (pending, fut, flat)
        self.reduced_buckets += 1
        return fut

    def on_bucket(self, bucket: GradBucket, fut: Future[Any]) -> None:
        """Record the bucket's future; update finished buckets (the last bucket: all of them)."""
        it = self.it
        assert it is not None
        i = bucket.index()
        it.futures.append(fut)
        scaling = self._scaling()
        if self.interleaved and not it.deferred and not scaling and not self.find_unused:
            # buckets whose reduction is done, in order; without a twin group, one bucket
            # behind whatever it takes (its reduction has had one bucket's backward to finish)
            while it.processed < i and (not self.nonblocking or self._ready(it.processed)):
                self._process(it.processed)
        if bucket.is_last():
            if it.deferred:
                self.adopt(tuple(it.indices))
            if self.find_unused:
                self.used = self._used_anywhere()
            if scaling:
                self._scaled_step()
            while it.processed < len(it.indices):
                self._process(it.processed)
            self._finish()

    def _scaling(self) -> bool:
        return self.scaler is not None and self.scaler.is_enabled()

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
        even = self.collectives == "reduce_scatter+all_gather"
        # an uneven bucket takes reduces and broadcasts under either strategy
        self._runs = {
            b: buffer_runs(ownership, indices, even=even) for b, indices in enumerate(structure)
        }
        self.structure = structure

    def _ready(self, j: int) -> bool:
        it = self.it
        assert it is not None
        if j in it.reduces:
            return it.reduces[j][0].done()
        return j in it.complete or it.futures[j].done()

    def _reduced(self, j: int) -> tuple[Tensor, Future[Tensor] | None]:
        """Bucket ``j``'s gradients once reduced, and the future DDP waits on (if ours)."""
        it = self.it
        assert it is not None
        if j in it.reduces:
            pending, fut, flat = it.reduces.pop(j)
            pending.wait()
            it.complete[j] = (flat, fut)
            return flat, fut
        if j in it.complete:
            return it.complete[j]
        value = it.futures[j].wait()
        flat = value if isinstance(value, Tensor) else value[0]
        it.complete[j] = (flat, None)
        return flat, None

    def _complete_everywhere(self, j: int) -> None:
        """Give every rank bucket ``j``'s reduced values (owners broadcast their runs)."""
        flat, _ = self._reduced(j)
        if self.collectives != "allreduce+broadcast":
            runs, _ = self._runs[j]
            comm.start_broadcast(flat, runs, self.zero.process_group).wait()

    def _used_anywhere(self) -> set[int]:
        """The parameters some rank used in this backward: those with a gradient now (DDP fills
        the buckets of unused ones with zeros but leaves their ``.grad`` as it was)."""
        local = torch.tensor([p.grad is not None for p in self.params], dtype=torch.bool)
        flags = comm.any_rank(local, self.zero.process_group)
        return {k for k, used in enumerate(flags.tolist()) if used}

    def _owned_grads(self, j: int, flat: Tensor) -> dict[int, Tensor]:
        it = self.it
        assert it is not None
        zero = self.zero
        used = self.used
        return {
            k: flat[a:b]
            for k, a, b in zero.ownership.owned_slices(it.indices[j], zero.rank)
            if used is None or k in used
        }

    def _process(self, j: int, *, update: bool = True) -> None:
        """Update this rank's pieces of bucket ``j`` and start the all-gather of the bucket."""
        it = self.it
        assert it is not None
        it.processed = j + 1
        flat, fut = self._reduced(j)
        if update:
            self.zero.update_owned(self._owned_grads(j, flat))
            if self.zero.world_size > 1:
                # in place: these parameters' grads are final, so backward no longer reads
                # them; the owners' values are on every rank by _finish
                runs, chunk = self._runs[j]
                it.pending.extend(
                    self.zero.param_sync.start_gather(it.indices[j], self.gather_group, runs, chunk)
                )
        if fut is not None:
            # on each rank only the pieces it owns hold the averaged gradient
            fut.set_result(flat)

    def _scaled_step(self) -> None:
        """With a GradScaler: unscale every owned gradient, decide on every rank together
        whether any was non-finite, tell the scaler, then update everything or nothing."""
        it = self.it
        assert it is not None and self.scaler is not None
        owned = [
            g
            for j in range(len(it.indices))
            for g in self._owned_grads(j, self._reduced(j)[0]).values()
        ]
        device = owned[0].device if owned else self.zero.join_device
        found = unscale_and_check_(owned, 1.0 / self.scaler.get_scale(), device)
        found = comm.all_reduce_scalar(found, self.zero.process_group, op="max")
        self._facade.record(self.scaler, found)
        if bool(found.item()):
            self.skipped += 1
            while it.processed < len(it.indices):
                self._process(it.processed, update=False)

    def _finish(self) -> None:
        it = self.it
        assert it is not None
        # waited for now, or (overlap_param_gather) by the next forward, module by module
        self.zero.defer_param_sync(it.pending)
        self.it = None


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
        try:
            indices = tuple(index[p] for p in bucket.parameters())
        except KeyError as e:
            raise RuntimeError(
                "a DDP gradient bucket holds a parameter this ZeroRedundancyOptimizer does not "
                "manage: build it from ddp.parameters() (or model.parameters())"
            ) from e
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
