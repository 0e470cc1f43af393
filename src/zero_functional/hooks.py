"""DDP communication hooks: the ZeRO step inside backward, and DDP's bytes after it.

torch's overlap hooks hang on gloo (pytorch#62300): they issue broadcasts from future callbacks,
on whichever thread finishes first; here every collective goes out from the hook, in bucket
order (:mod:`zero_functional.comm`'s first rule). And where torch's wait 2 to 3 iterations for
DDP's buckets, the first backward here reads them as they arrive, then reshards at the last
one (:func:`adopt_buckets`) and updates; later backwards update bucket by bucket.
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
    """The overlap state of the hook registered for ``zero``, or ``None`` (for inspection).

    Example:
        >>> zero = ZeroRedundancyOptimizer([torch.ones(1, requires_grad=True)], torch.optim.SGD)
        >>> overlap_state(zero) is None  # no hook registered
        True
    """
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


def _check_wire_dtype(wire_dtype: object, hook: Hook | None = None) -> comm.Codec | None:
    codec = comm.check_wire_dtype(wire_dtype)
    if codec is not None and hook is not None and hook is not default_hooks.allreduce_hook:
        raise ValueError(
            f"wire_dtype replaces the reduction of DDP's default allreduce_hook; a custom "
            f"hook ({getattr(hook, '__name__', hook)!r}) keeps its own: compress there"
        )
    return codec


def _check_ddp(ddp: DistributedDataParallel, zero: ZeroRedundancyOptimizer) -> None:
    if getattr(ddp, "mixed_precision", None) is not None:
        raise ValueError(
            "DistributedDataParallel(mixed_precision=...) casts parameters and gradients in "
            "its own buffers, which this package's hooks do not see: use bf16 parameters with "
            "ZeroRedundancyOptimizer(main_params_dtype=torch.float32), and reduce_dtype= on the "
            "hook to reduce gradients in float32"
        )
    sparse = [
        name or "(the module itself)"
        for name, m in ddp.module.named_modules()
        if isinstance(m, nn.Embedding | nn.EmbeddingBag)
        and m.sparse
        and any(p.requires_grad for p in m.parameters(recurse=False))
    ]
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
    if (ranks := comm.group_size(_ddp_group(ddp))) != zero.world_size * replicas:
        raise ValueError(
            f"the DDP module runs on {ranks} ranks but the ZeroRedundancyOptimizer on "
            f"{zero.world_size * replicas}: give both the same process group, or, to shard within "
            "groups of ranks and replicate across them, build the optimizer with "
            'device_mesh=init_device_mesh(..., mesh_dim_names=("replicate", "shard"))'
        )


def _ddp_group(ddp: DistributedDataParallel) -> comm.ProcessGroup:
    """The group DDP averages gradients over (its own, else the default group)."""
    group = getattr(ddp, "process_group", None)
    return group if group is not None else comm.default_group(None)


def _with_annotations(fn: Hook) -> Hook:
    # DDP checks the annotations, which `from __future__ import annotations` made strings
    fn.__annotations__ = {"state": Any, "bucket": GradBucket, "return": Future[Tensor]}
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
    wire_dtype: torch.dtype | None = None,
) -> Hook:
    reduce_dtype = _check_reduce_dtype(reduce_dtype, hook)
    codec = _check_wire_dtype(wire_dtype, hook)
    if not isinstance(zero, ZeroRedundancyOptimizer) or not zero.overlap_with_ddp:
        raise ValueError(
            "ZeroRedundancyOptimizer must be constructed with `overlap_with_ddp=True` to use "
            "this hook properly"
        )
    if zero in _STATES:
        raise RuntimeError("this ZeroRedundancyOptimizer already has an overlap hook registered")
    _check_ddp(ddp, zero)
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
    if codec is not None and collectives == "allreduce+broadcast" and zero.world_size > 1:
        raise ValueError(
            "wire_dtype needs the hook's own reduction onto the owners: leave collectives= "
            "to choose_collectives, or pass 'reduce+broadcast'"
        )
    if codec is not None and reduce_dtype is None:
        reduce_dtype = torch.float32  # summed in fp32: the update reads that sum
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
        _ddp_buckets(ddp, zero, collectives, reduce_dtype, codec, twin=interleaved),
        _ddp_group(ddp),
        zero.join_device,
        shard_buckets=shard_buckets,
        interleaved=interleaved,
        grad_scaler=grad_scaler,
        find_unused=bool(getattr(ddp, "find_unused_parameters", False)),
    )
    _STATES[zero] = overlap

    def hook_with_zero_fn(state: Any, bucket: GradBucket) -> Future[Tensor]:
        name = f"backward() (hook_with_zero_step, bucket {bucket.index()})"
        with comm.call(name, zero.process_group, timeout=zero.timeout):
            if zero.shard.refusal is not None:  # inside ShardedEMA.swapped_into: no step
                # DDP's own reduction, nothing updated; the refusal is raised once DDP has
                # finished the backward (raised in a hook, or before DDP's own end-of-backward
                # callback, which is queued after the last hook, it leaves DDP's reducer broken)
                if bucket.is_last():
                    engine = torch.autograd.Variable._execution_engine
                    refuse = zero.shard.check_updates
                    engine.queue_callback(lambda: engine.queue_callback(refuse))
                return hook(state, bucket)
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
    codec: comm.Codec | None,
    *,
    twin: bool = False,
) -> DDPBuckets:
    """The syncs of DDP's buckets for ``zero`` (``twin``: gathered on a twin group if possible)."""
    group = zero.process_group
    gather = comm.twin_group(group) if twin and zero.world_size > 1 else None
    wire = comm.Wire(group, gather, codec=codec, gather_codec=zero.gather_codec)
    ranks, window = comm.group_size(_ddp_group(ddp)), zero.param_window
    return DDPBuckets(
        wire, collectives, window, ranks, reduce_dtype, zero.replicate_group, zero.changes()
    )


def adopt_buckets(zero: ZeroRedundancyOptimizer, structure: tuple[tuple[int, ...], ...]) -> None:
    """Own DDP's buckets ``structure`` (per bucket, its parameters' global indices) in overlap
    mode, moving the state there; collective (the hook calls it at the last bucket of a backward
    whose buckets are new; tests, to simulate DDP rebuilding its buckets)."""
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
    wire_dtype: torch.dtype | None = None,
) -> Hook:
    """Wrap a DDP comm hook so that the ZeRO step runs at the end of backward.

    Each bucket is reduced (by ``hook``, or onto its owners only where it replaces DDP's default
    ``allreduce_hook``); at the last bucket each rank updates its pieces and the owners' values
    are gathered everywhere. ``p.grad`` then holds the average only in the pieces this rank owns.

    Args:
        zero: Built with ``overlap_with_ddp=True`` from ``ddp.parameters()``.
        shard_buckets: Under ``"sorted_greedy"``, split each bucket across ranks (torch's rule).
        collectives: Override :func:`choose_collectives`.
        grad_scaler: The ``GradScaler`` that scaled the loss (call no ``scaler.step(zero)``): a
            non-finite gradient on any rank skips the update everywhere and lowers the scale.
        reduce_dtype: Reduce in this dtype (Megatron-LM's ``grad_reduce_in_fp32``) and update from
            those values.
        wire_dtype: Each rank's contribution to an owner travels in this format
            (``torch.bfloat16``, ``torch.float16``, ``torch.int8``, ``torch.float8_e4m3fn``:
            :mod:`~zero_functional.comm.codec`), rounded once; the owner sums in fp32.

    Example:
        >>> # ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
    """
    args = (collectives, grad_scaler, reduce_dtype, wire_dtype)
    return _make_hook(hook, ddp, zero, shard_buckets, False, *args)


def hook_with_zero_step_interleaved(
    hook: Hook,
    ddp: DistributedDataParallel,
    zero: ZeroRedundancyOptimizer,
    shard_buckets: bool = False,
    *,
    collectives: Collectives | None = None,
    grad_scaler: GradScaler | None = None,
    reduce_dtype: torch.dtype | None = None,
    wire_dtype: torch.dtype | None = None,
) -> Hook:
    """Like :func:`hook_with_zero_step`, but each bucket is updated while backward goes on: when a
    bucket arrives, each earlier one whose reduction is done is updated and its all-gather started,
    on a twin process group made with the hook (without one, the bucket before is updated then).

    Example:
        >>> # hook = hook_with_zero_step_interleaved(allreduce_hook, ddp, zero)
    """
    args = (collectives, grad_scaler, reduce_dtype, wire_dtype)
    return _make_hook(hook, ddp, zero, shard_buckets, True, *args)


def reduce_scatter_hook(
    ddp: DistributedDataParallel,
    zero: ZeroRedundancyOptimizer,
    *,
    grad_scaler: GradScaler | None = None,
    reduce_dtype: torch.dtype | None = None,
    wire_dtype: torch.dtype | None = None,
) -> Hook:
    """DDP's gradient averaging, but each piece summed onto its owner only (step after backward).

    ``backward()`` then sends half an all-reduce and ``step()``'s all-gather the other half: plain
    DDP's bytes. ``p.grad`` holds the average only in the pieces this rank owns: clip with
    ``zero.clip_grad_norm_``.

    Args:
        grad_scaler: The ``GradScaler`` whose ``step(zero)`` follows; the hook makes its verdict
            common (:func:`~zero_functional.shell.amp.common_verdict`).
        reduce_dtype: Average each bucket in a copy of this dtype, rounded back once.
        wire_dtype: As :func:`hook_with_zero_step`'s: contributions cross in 8 or 16 bits.

    Example:
        >>> # ddp.register_comm_hook(None, reduce_scatter_hook(ddp, zero))
    """
    reduce_dtype = _check_reduce_dtype(reduce_dtype)
    codec = _check_wire_dtype(wire_dtype)
    if codec is not None and reduce_dtype is None:
        reduce_dtype = torch.float32  # summed in fp32: the update reads that sum
    if not isinstance(zero, ZeroRedundancyOptimizer) or zero.overlap_with_ddp:
        raise ValueError(
            "reduce_scatter_hook serves a ZeroRedundancyOptimizer that steps after backward; "
            "with overlap_with_ddp=True use hook_with_zero_step(allreduce_hook, ddp, zero)"
        )
    _check_ddp(ddp, zero)
    buckets = _ddp_buckets(ddp, zero, zero.collectives, reduce_dtype, codec)
    ranks = buckets.ranks
    scaled: list[tuple[Tensor, tuple[Run, ...], comm.Pending]] = []

    def reduce_scatter_fn(state: Any, bucket: GradBucket) -> Future[Tensor]:
        flat = bucket.buffer()
        if ranks == 1:
            return comm.Pending([]).future(flat)  # done: nothing to reduce
        shard = zero.shard
        indices = bucket_indices(shard.table, bucket.parameters())
        name = f"backward() (reduce_scatter_hook, bucket {bucket.index()})"
        with comm.call(name, zero.process_group, timeout=zero.timeout):
            sync = buckets.get(indices, shard.table, shard.ownership, shard.rank)
            sync.start_grad(flat)
            if sync.widened and zero.main_params_dtype is not None:  # not its rounding
                zero.shard.hold_reduced(sync.owned_grads())
            pending = sync.grad_pending()  # rounded back once, before DDP reads the bucket
            if grad_scaler is None or not grad_scaler.is_enabled():
                # on gloo the exchange's thread completes this future, not one of gloo's
                return pending.future(flat)
            if bucket.index() == 0:
                scaled.clear()
            scaled.append((flat, sync.plan.runs, pending))
            if bucket.is_last():
                common_verdict(scaled, zero.rank, zero.process_group)
                scaled.clear()
        return pending.future(flat)

    return _with_annotations(reduce_scatter_fn)
