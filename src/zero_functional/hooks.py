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
(:func:`~zero_functional.core.ownership.bucket_ownership`), asks the optimizer to
:meth:`~zero_functional.optimizer.ZeroRedundancyOptimizer.reshard` its state to it, and updates.
Later backwards update bucket by bucket.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch._C._distributed_c10d import GradBucket
from torch.amp import GradScaler
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from zero_functional import comm
from zero_functional.core._validate import first_of
from zero_functional.core.ownership import Run
from zero_functional.core.plans import COLLECTIVES, Collectives, choose_collectives
from zero_functional.optimizer import ZeroRedundancyOptimizer
from zero_functional.shell.amp import common_verdict
from zero_functional.shell.bucket_sync import DDPBuckets, all_reduce_widened, bucket_indices
from zero_functional.shell.overlap import OverlapState

__all__ = [
    "Collectives",
    "OverlapState",
    "adopt_buckets",
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


def overlap_state(zero: ZeroRedundancyOptimizer) -> OverlapState | None:
    """The overlap state of the hook registered for ``zero``, or ``None`` (for inspection)."""
    return _STATES.get(zero)


def _check_reduce_dtype(reduce_dtype: object, hook: Hook | None = None) -> torch.dtype | None:
    if reduce_dtype is None:
        return None
    if not isinstance(reduce_dtype, torch.dtype) or not reduce_dtype.is_floating_point:
        raise TypeError(
            f"reduce_dtype must be a floating torch.dtype such as torch.float32, or None; "
            f"got {reduce_dtype!r}"
        )
    if hook is not None and hook is not default_hooks.allreduce_hook:
        raise ValueError(
            f"reduce_dtype replaces the reduction of DDP's default allreduce_hook; a custom "
            f"hook ({getattr(hook, '__name__', hook)!r}) keeps its own: reduce in its dtype there"
        )
    return reduce_dtype


def _check_ddp(ddp: DistributedDataParallel, zero: ZeroRedundancyOptimizer) -> None:
    if getattr(ddp, "mixed_precision", None) is not None:
        raise ValueError(
            "DistributedDataParallel(mixed_precision=...) casts parameters and gradients in "
            "its own buffers, which this package's hooks do not see: use bf16 parameters with "
            "ZeroRedundancyOptimizer(main_params_dtype=torch.float32), and reduce_dtype= on the "
            "hook to reduce gradients in float32"
        )
    sparse = _sparse_modules(ddp)
    if sparse:
        names = first_of([repr(n) for n in sparse])
        raise ValueError(
            f"the DDP module's submodule(s) {names} (nn.Embedding or nn.EmbeddingBag with "
            "sparse=True) give sparse gradients, and this package's hooks reduce DDP's buckets "
            "as dense flat buffers: step after backward without a hook (DDP all-reduces "
            "sparse gradients itself; then zero.step(), e.g. with torch.optim.SparseAdam), or "
            "build the embeddings with sparse=False"
        )
    ddp_params = {p for p in ddp.parameters() if p.requires_grad}
    missing = {p for p in ddp_params if p not in zero.param_table}
    if missing:
        raise ValueError(
            f"{len(missing)} trainable parameters of the DDP module are not in the "
            "ZeroRedundancyOptimizer: build it from ddp.parameters()"
        )
    replicas = comm.group_size(zero.replicate_group) if zero.replicate_group else 1
    if comm.group_size(_ddp_group(ddp, zero)) != zero.world_size * replicas:
        raise ValueError(
            f"the DDP module runs on {comm.group_size(_ddp_group(ddp, zero))} ranks but the "
            f"ZeroRedundancyOptimizer on {zero.world_size * replicas}: give both the same "
            "process group, or, to shard within groups of ranks and replicate across them, "
            'build the optimizer with device_mesh=init_device_mesh(..., mesh_dim_names=("'
            'replicate", "shard"))'
        )


def _sparse_modules(ddp: DistributedDataParallel) -> list[str]:
    """The names of the DDP module's submodules that give sparse gradients, by DDP's own rule
    (an embedding built with ``sparse=True``), trainable ones only."""
    return [
        name or "(the module itself)"
        for name, m in ddp.module.named_modules()
        if isinstance(m, nn.Embedding | nn.EmbeddingBag)
        and m.sparse
        and any(p.requires_grad for p in m.parameters(recurse=False))
    ]


def _ddp_group(ddp: DistributedDataParallel, zero: ZeroRedundancyOptimizer) -> comm.ProcessGroup:
    """The group DDP averages gradients over (its own, else the default group)."""
    group = getattr(ddp, "process_group", None)
    return group if group is not None else comm.default_group(None)


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
    reduce_dtype: torch.dtype | None = None,
) -> Hook:
    reduce_dtype = _check_reduce_dtype(reduce_dtype, hook)
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
        collectives = zero.collectives if default else "allreduce+broadcast"
    elif collectives not in COLLECTIVES:
        raise ValueError(f"collectives must be one of {COLLECTIVES}, got {collectives!r}")
    elif collectives != "allreduce+broadcast" and not default:
        raise ValueError(
            f"collectives={collectives!r} replaces DDP's default allreduce_hook; a custom "
            f"hook ({getattr(hook, '__name__', hook)!r}) keeps its own reduction: use "
            "'allreduce+broadcast'"
        )
    if reduce_dtype is not None and collectives == "allreduce+broadcast" and zero.world_size > 1:
        raise ValueError(
            "reduce_dtype needs the hook's own reduction onto the owners: leave collectives= "
            "to choose_collectives, or pass 'reduce+broadcast'"
        )
    if zero.world_size == 1:
        collectives = "allreduce+broadcast"
    if grad_scaler is not None and not isinstance(grad_scaler, GradScaler):
        raise TypeError(
            f"grad_scaler must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}"
        )
    overlap = OverlapState(
        zero.shard,
        zero.param_window,
        _ddp_buckets(ddp, zero, collectives, reduce_dtype, twin=interleaved),
        _ddp_group(ddp, zero),
        zero.join_device,
        shard_buckets=shard_buckets,
        interleaved=interleaved,
        grad_scaler=grad_scaler,
        find_unused=bool(getattr(ddp, "find_unused_parameters", False)),
    )
    _STATES[zero] = overlap

    def hook_with_zero_fn(state: Any, bucket: GradBucket) -> Future[Tensor]:
        assert ddp_ref() is not None, "the DDP module was garbage-collected"
        name = f"backward() (hook_with_zero_step, bucket {bucket.index()})"
        with comm.call(name, zero.process_group, timeout=zero.timeout):
            if overlap.begins(bucket):
                zero.check_trainable()  # unfreezing is an error before anything moves
                overlap.new_backward()
            substitute = overlap.start(bucket) and (state is None or state is zero.process_group)
            wide = None
            if substitute:
                fut = overlap.reduce(bucket)
            elif reduce_dtype is not None and zero.world_size > 1:
                # the buckets not known yet: all-reduce, widened (the update reads `wide`)
                fut, wide = all_reduce_widened(bucket.buffer(), reduce_dtype, overlap.ddp_group)
            else:
                fut = hook(state, bucket)
            overlap.on_bucket(bucket, fut, wide)
            if bucket.is_last():
                structure = overlap.last_bucket()
                if structure is not None:
                    adopt_buckets(zero, structure)
                overlap.finish_backward()
        return fut

    return _with_annotations(hook_with_zero_fn)


def _ddp_buckets(
    ddp: DistributedDataParallel,
    zero: ZeroRedundancyOptimizer,
    collectives: Collectives,
    reduce_dtype: torch.dtype | None,
    *,
    twin: bool = False,
) -> DDPBuckets:
    """The syncs of DDP's buckets for ``zero``: reduced over its group, averaged over DDP's;
    ``twin``: gathered on a twin group where one can be made (the interleaved hook's)."""
    group = zero.process_group
    gather = comm.twin_group(group) if twin and zero.world_size > 1 else None
    return DDPBuckets(
        comm.Wire(group, gather),
        collectives,
        zero.param_window,
        ranks=comm.group_size(_ddp_group(ddp, zero)),
        reduce_dtype=reduce_dtype,
        replicate=zero.replicate_group,
    )


def adopt_buckets(zero: ZeroRedundancyOptimizer, structure: tuple[tuple[int, ...], ...]) -> None:
    """Own DDP's buckets ``structure`` (per bucket, its parameters' global indices) in overlap
    mode and move the state to that ownership; collective (every rank calls it with the same
    structure: the hook does at the last bucket of a backward whose buckets are new; tests, to
    simulate DDP rebuilding its buckets)."""
    overlap = _STATES[zero]
    zero.reshard(zero.ownership_of(structure, shard_buckets=overlap.shard_buckets))
    overlap.structure = structure


def hook_with_zero_step(
    hook: Hook,
    ddp: DistributedDataParallel,
    zero: ZeroRedundancyOptimizer,
    shard_buckets: bool = False,
    *,
    collectives: Collectives | None = None,
    grad_scaler: GradScaler | None = None,
    reduce_dtype: torch.dtype | None = None,
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
        reduce_dtype: Reduce gradients in this dtype (``torch.float32`` for a bf16 model:
            Megatron-LM's ``grad_reduce_in_fp32``): each bucket is copied into it, averaged
            onto the owners, updated from those values (with ``main_params_dtype``, without
            rounding), and copied back into the bucket for DDP. Only for DDP's default
            ``allreduce_hook``, which it replaces.

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
        reduce_dtype=reduce_dtype,
    )


def hook_with_zero_step_interleaved(
    hook: Hook,
    ddp: DistributedDataParallel,
    zero: ZeroRedundancyOptimizer,
    shard_buckets: bool = False,
    *,
    collectives: Collectives | None = None,
    grad_scaler: GradScaler | None = None,
    reduce_dtype: torch.dtype | None = None,
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
        reduce_dtype=reduce_dtype,
    )


def reduce_scatter_hook(
    ddp: DistributedDataParallel,
    zero: ZeroRedundancyOptimizer,
    *,
    grad_scaler: GradScaler | None = None,
    reduce_dtype: torch.dtype | None = None,
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
        reduce_dtype: Sum the gradients in this dtype (``torch.float32`` for a bf16 model):
            each bucket is averaged in a copy of that dtype, then rounded back into
            ``p.grad`` once.

    Returns:
        The hook to pass to ``ddp.register_comm_hook(None, ...)``.

    Example:
        >>> # ddp.register_comm_hook(None, reduce_scatter_hook(ddp, zero))
        >>> # ddp.register_comm_hook(None, reduce_scatter_hook(ddp, zero, grad_scaler=scaler))
    """
    reduce_dtype = _check_reduce_dtype(reduce_dtype)
    if not isinstance(zero, ZeroRedundancyOptimizer) or zero.overlap_with_ddp:
        raise ValueError(
            "reduce_scatter_hook serves a ZeroRedundancyOptimizer that steps after backward; "
            "with overlap_with_ddp=True use hook_with_zero_step(allreduce_hook, ddp, zero)"
        )
    _check_ddp(ddp, zero)
    buckets = _ddp_buckets(ddp, zero, zero.collectives, reduce_dtype)
    ranks = buckets.ranks
    scaled: list[tuple[Tensor, tuple[Run, ...], comm.Pending]] = []

    def reduce_scatter_fn(state: Any, bucket: GradBucket) -> Future[Tensor]:
        flat = bucket.buffer()
        if ranks == 1:
            done: Future[Tensor] = Future()
            done.set_result(flat)
            return done
        shard = zero.shard
        indices = bucket_indices(shard.table, bucket.parameters())
        name = f"backward() (reduce_scatter_hook, bucket {bucket.index()})"
        with comm.call(name, zero.process_group, timeout=zero.timeout):
            sync = buckets.get(indices, shard.table, shard.ownership, shard.rank)
            sync.start_grad(flat)
            if sync.widened and zero.main_params_dtype is not None:  # not its rounding
                zero.hold_reduced(sync.owned_grads())
            pending = sync.grad_pending()  # rounded back once, before DDP reads the bucket
            if grad_scaler is None or not grad_scaler.is_enabled():
                # on gloo the exchange's own thread adds the sums and completes this future
                # (comm.exchange), not one of gloo's, which would hold back later buckets
                return pending.future(flat)
            if bucket.index() == 0:
                scaled.clear()
            scaled.append((flat, sync.plan.runs, pending))
            if bucket.is_last():
                common_verdict(scaled, zero.rank, zero.process_group)
                scaled.clear()
        return pending.future(flat)

    return _with_annotations(reduce_scatter_fn)
