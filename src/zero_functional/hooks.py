"""DDP communication hooks that run the sharded step inside backward (``overlap_with_ddp``).

Why torch's hooks hang on gloo (pytorch#62300): they issue broadcasts from future callbacks,
which run on whichever communication thread finishes first, so ranks issue collectives in
different orders, and gloo pairs collectives by issue order. Here every collective is issued from
the hook itself, which DDP calls on the autograd thread in bucket order on every rank; the only
waits are on futures of collectives already issued in that shared order.

Why torch's send 1.5x DDP's bytes (pytorch#69591): every rank all-reduces every gradient, then
every owner broadcasts its parameters. Here, with DDP's default hook, each owner's piece of a
bucket is reduced onto that owner only (the uneven reduce-scatter), so gradients cost half an
all-reduce and parameters the other half: DDP's bytes (see :func:`choose_collectives`).

Why torch's lose 2 to 3 iterations: they wait for DDP to rebuild its buckets before they assign
buckets to ranks. Here the bucket structure is read off the buckets as they arrive; the first
backward (and any backward after DDP rebuilt its buckets) defers the updates to the last bucket,
where the whole structure is known, recomputes the assignment, moves any optimizer state whose
owner changed, and updates. Later backwards update bucket by bucket.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch._C._distributed_c10d import GradBucket
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from zero_functional import comm
from zero_functional.buckets import BucketAssignment, ddp_bucket_assignments
from zero_functional.optimizer import ZeroRedundancyOptimizer

__all__ = [
    "Collectives",
    "choose_collectives",
    "hook_with_zero_step",
    "hook_with_zero_step_interleaved",
]

Collectives = Literal["allreduce+broadcast", "reduce+broadcast"]
Hook = Callable[[Any, GradBucket], Future[Tensor]]

_COLLECTIVES: tuple[Collectives, ...] = ("allreduce+broadcast", "reduce+broadcast")


def choose_collectives(
    backend: str, world_size: int, hook_is_allreduce: bool = True
) -> Collectives:
    """The collectives overlap mode uses for each gradient bucket (a pure policy).

    ``"reduce+broadcast"``: one sum-reduce of each owner's piece of the bucket onto its owner,
    then one broadcast of the updated parameters from each owner. That is the uneven
    reduce-scatter + all-gather (NCCL implements its uneven ones as these same grouped reduces
    and broadcasts), so it moves the bytes of one all-reduce: plain DDP's traffic.

    ``"allreduce+broadcast"``: the user's hook reduces the whole bucket on every rank, then each
    owner broadcasts: 1.5x DDP's bytes (torch's scheme, pytorch#69591), but any hook
    (compression, ...) keeps its own reduction exactly as written.

    The rule: a hook other than DDP's default all-reduce keeps its own reduction, and so does a
    single rank (nothing is sent); otherwise reduce+broadcast, on every backend. On gloo that is
    what measures fastest: gloo's even reduce-scatter and all-gather (``reduce_scatter_tensor``,
    ``all_gather_into_tensor``) are slower than its all-reduce and broadcasts on CPU (32 MB,
    2 ranks: 35 and 47 ms against 24 and 14), and its uneven all-gather is refused; per-owner
    reduces are slower than one all-reduce in isolation at 2 ranks, but whole DDP iterations
    (``benchmarks/bench_overlap.py``, 8M parameters) are as fast or faster with them at 2, 3
    and 4 ranks, and they send a third fewer bytes.

    Args:
        backend: A ``torch.distributed`` backend name.
        world_size: Ranks in the process group.
        hook_is_allreduce: Whether the wrapped hook is DDP's default all-reduce hook.

    Returns:
        The strategy name.

    Example:
        >>> choose_collectives("nccl", 8)
        'reduce+broadcast'
        >>> choose_collectives("gloo", 2)
        'reduce+broadcast'
        >>> choose_collectives("nccl", 8, hook_is_allreduce=False)
        'allreduce+broadcast'
        >>> choose_collectives("gloo", 1)
        'allreduce+broadcast'
    """
    if not backend:
        raise ValueError("backend must be a non-empty backend name such as 'gloo' or 'nccl'")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if not hook_is_allreduce or world_size == 1:
        return "allreduce+broadcast"
    return "reduce+broadcast"


@dataclass
class _Iteration:
    """What one backward has seen so far."""

    indices: list[tuple[int, ...]] = field(default_factory=list)
    futures: list[Future[Any]] = field(default_factory=list)
    # per bucket issued with reduce+broadcast: its reduce handles and the future handed to DDP
    reduces: dict[int, tuple[list[comm.Work], Future[Tensor], Tensor]] = field(default_factory=dict)
    processed: int = 0
    deferred: bool = False
    pending: list[comm.PendingBroadcast] = field(default_factory=list)


class _Overlap:
    """The state overlap mode keeps between buckets and iterations (one per ZeRO instance)."""

    def __init__(
        self,
        zero: ZeroRedundancyOptimizer,
        shard_buckets: bool,
        interleaved: bool,
        collectives: Collectives,
    ) -> None:
        self.zero = zero
        self.shard_buckets = shard_buckets
        self.interleaved = interleaved
        self.collectives = collectives
        self.params = zero._all_params()
        self.index = {p: i for i, p in enumerate(self.params)}
        self.group_of = [g for g, group in enumerate(zero.param_groups) for _ in group["params"]]
        self.structure: tuple[tuple[int, ...], ...] | None = None
        self.by_bucket: list[list[BucketAssignment]] = []
        self.it: _Iteration | None = None
        # what happened, for tests and benchmarks
        self.adoptions = 0
        self.restructures = 0  # backwards whose buckets differed from the adopted structure
        self.reduced_buckets = 0

    # -------------------------------------------------------------- per bucket

    def start(self, bucket: GradBucket) -> bool:
        """Register ``bucket``; whether to reduce it onto its owners (else the user's hook runs).

        Every input of this decision (bucket indices, the structure adopted so far) is the same
        on every rank, so all ranks issue the same collectives in the same order.
        """
        i = bucket.index()
        if i == 0 or self.it is None:
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
            # their owners under it: finish them with that assignment before _adopt moves state.
            while it.processed < i:
                self._process(it.processed)
        return (
            not it.deferred and self.collectives == "reduce+broadcast" and self.zero.world_size > 1
        )

    def reduce(self, bucket: GradBucket) -> Future[Tensor]:
        """Average ``bucket`` onto the owners of its pieces; the future DDP waits on."""
        it = self.it
        assert it is not None
        i = bucket.index()
        zero = self.zero
        flat = bucket.buffer()
        flat.div_(zero.world_size)  # as DDP's allreduce_hook: divide, then sum
        starts = self._starts(it.indices[i])
        pieces = [flat[starts[a.offset] : starts[a.offset + a.length]] for a in self.by_bucket[i]]
        works = comm.reduce_shards(pieces, [a.rank for a in self.by_bucket[i]], zero.process_group)
        fut: Future[Tensor] = Future(devices=[flat.device] if flat.device.type == "cuda" else None)
        it.reduces[i] = (works, fut, flat)
        self.reduced_buckets += 1
        return fut

    def on_bucket(self, bucket: GradBucket, fut: Future[Any]) -> None:
        it = self.it
        assert it is not None
        i = bucket.index()
        it.futures.append(fut)
        if self.interleaved and not it.deferred:
            while it.processed < i:  # one bucket behind: its reduction has had time to finish
                self._process(it.processed)
        if bucket.is_last():
            if it.deferred:
                self._adopt(tuple(it.indices))
            while it.processed < len(it.indices):
                self._process(it.processed)
            self._finish()

    def _starts(self, indices: tuple[int, ...]) -> list[int]:
        starts = [0]
        for k in indices:
            starts.append(starts[-1] + self.params[k].numel())
        return starts

    def _adopt(self, structure: tuple[tuple[int, ...], ...]) -> None:
        """Assign the buckets of ``structure`` to ranks; move state whose owner changed."""
        zero = self.zero
        numels = [[self.params[k].numel() for k in b] for b in structure]
        try:
            per_rank = ddp_bucket_assignments(
                numels, zero.world_size, shard_buckets=self.shard_buckets
            )
        except ValueError:
            # torch's shard_buckets rule cannot cut some bucket into at most world_size pieces
            # (DDP's first-iteration buckets are often one big bucket); whole buckets are always
            # placeable, and correctness does not depend on the balance.
            per_rank = ddp_bucket_assignments(numels, zero.world_size, shard_buckets=False)
        old = zero._owners()
        new = list(old)
        self.by_bucket = [[] for _ in structure]
        for assignments in per_rank:
            for a in assignments:
                self.by_bucket[a.bucket].append(a)
                for k in structure[a.bucket][a.offset : a.offset + a.length]:
                    new[k] = a.rank
        for b in self.by_bucket:
            b.sort(key=lambda a: a.rank)
        moving = [k for k in range(len(new)) if new[k] != old[k]]
        if moving and zero.world_size > 1:
            pairs = sorted({(old[k], new[k]) for k in moving})
            outgoing: dict[int, dict[int, dict[str, Any]]] = {}
            for k in moving:
                if old[k] == zero.rank and zero.state.get(self.params[k]):
                    outgoing.setdefault(new[k], {})[k] = dict(zero.state.pop(self.params[k]))
            received = comm.exchange_objects(
                outgoing, pairs, zero.process_group, zero._collective_device()
            )
            for payload in received.values():
                assert isinstance(payload, dict)
                for k, value in payload.items():
                    p = self.params[k]
                    zero.state[p] = {
                        key: zero._to_param_policy(key, v, p) for key, v in value.items()
                    }
        zero._owner_of = new
        zero._overlap_ready = True
        self.structure = structure
        self.adoptions += 1

    def _process(self, j: int) -> None:
        """Update this rank's part of bucket ``j`` and start the broadcasts of every part.

        Piece by piece, in assignment order (the same on every rank): with reduce+broadcast, a
        piece's broadcast starts as soon as its own reduce is done and its owner updated it,
        while the next piece's reduce is still in flight.
        """
        it = self.it
        assert it is not None
        zero = self.zero
        it.processed = j + 1
        indices = it.indices[j]
        pieces = self.by_bucket[j]
        fut: Future[Tensor] | None = None
        if j in it.reduces:
            works, fut, flat = it.reduces.pop(j)
            waits: list[comm.Work | None] = list(works)
        else:
            value = it.futures[j].wait()
            flat = value if isinstance(value, Tensor) else value[0]
            waits = [None] * len(pieces)
        starts = self._starts(indices)
        for a, work in zip(pieces, waits, strict=True):
            if work is not None:
                work.wait()
            span = indices[a.offset : a.offset + a.length]
            if a.rank == zero.rank:
                by_group: dict[int, tuple[list[Tensor], list[Tensor]]] = {}
                for pos in range(a.offset, a.offset + a.length):
                    p = self.params[indices[pos]]
                    ps, gs = by_group.setdefault(self.group_of[indices[pos]], ([], []))
                    ps.append(p)
                    gs.append(flat[starts[pos] : starts[pos + 1]].view_as(p))
                for g, (ps, gs) in by_group.items():
                    zero._update(g, ps, gs)
            if zero.world_size > 1:
                # in place where large: these parameters' grads are final, so backward no
                # longer reads them; the owner's values are on every rank by _finish
                it.pending.append(
                    comm.start_sync_params(
                        [self.params[k] for k in span], [a.rank] * a.length, zero.process_group
                    )
                )
        if fut is not None:
            # on each rank only the pieces it owns hold the averaged gradient
            fut.set_result(flat)

    def _finish(self) -> None:
        it = self.it
        assert it is not None
        for pending in it.pending:
            pending.wait()
        self.it = None


def _make_hook(
    hook: Hook,
    ddp: DistributedDataParallel,
    zero: ZeroRedundancyOptimizer,
    shard_buckets: bool,
    interleaved: bool,
    collectives: Collectives | None,
) -> Hook:
    if not isinstance(zero, ZeroRedundancyOptimizer) or not zero._overlap_with_ddp:
        raise ValueError(
            "ZeroRedundancyOptimizer must be constructed with `overlap_with_ddp=True` to use "
            "this hook properly"
        )
    if getattr(zero, "_overlap", None) is not None:
        raise RuntimeError("this ZeroRedundancyOptimizer already has an overlap hook registered")
    ddp_ref = weakref.ref(ddp)
    ddp_params = {p for p in ddp.parameters() if p.requires_grad}
    missing = ddp_params - set(zero._all_params())
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
    default = hook is default_hooks.allreduce_hook
    if collectives is None:
        collectives = choose_collectives(
            str(dist.get_backend(zero.process_group)), zero.world_size, hook_is_allreduce=default
        )
    elif collectives not in _COLLECTIVES:
        raise ValueError(f"collectives must be one of {_COLLECTIVES}, got {collectives!r}")
    elif collectives == "reduce+broadcast" and not default:
        raise ValueError(
            "collectives='reduce+broadcast' replaces DDP's default allreduce_hook; a custom "
            f"hook ({getattr(hook, '__name__', hook)!r}) keeps its own reduction: use "
            "'allreduce+broadcast'"
        )
    overlap = _Overlap(zero, shard_buckets, interleaved, collectives)
    zero._overlap = overlap

    def hook_with_zero_fn(state: Any, bucket: GradBucket) -> Future[Tensor]:
        assert ddp_ref() is not None, "the DDP module was garbage-collected"
        substitute = overlap.start(bucket) and (state is None or state is zero.process_group)
        fut = overlap.reduce(bucket) if substitute else hook(state, bucket)
        overlap.on_bucket(bucket, fut)
        return fut

    # DDP checks the annotations themselves, which `from __future__ import annotations` turns
    # into strings: give it the real objects.
    hook_with_zero_fn.__annotations__ = {
        "state": Any,
        "bucket": GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }
    return hook_with_zero_fn


def hook_with_zero_step(
    hook: Hook,
    ddp: DistributedDataParallel,
    zero: ZeroRedundancyOptimizer,
    shard_buckets: bool = False,
    *,
    collectives: Collectives | None = None,
) -> Hook:
    """Wrap a DDP comm hook so that the ZeRO step runs at the end of backward.

    Each gradient bucket is reduced (by ``hook``, or, for DDP's default ``allreduce_hook``
    where :func:`choose_collectives` says so, by one reduce per owner onto its owner: plain
    DDP's bytes); when the last bucket arrives, the ranks that own each bucket update its
    parameters with the averaged gradients and broadcast them, bucket by bucket. Works on every
    backend, gloo included, and updates from the first iteration.

    After backward, ``p.grad`` holds the averaged gradient on every rank with
    ``"allreduce+broadcast"``; with ``"reduce+broadcast"`` only on the rank that owns ``p``
    (elsewhere it is a partial sum), as in any reduce-scatter ZeRO.

    Args:
        hook: A DDP communication hook, e.g. ``default_hooks.allreduce_hook``.
        ddp: The ``DistributedDataParallel`` module.
        zero: A ``ZeroRedundancyOptimizer`` built with ``overlap_with_ddp=True`` from
            ``ddp.parameters()``.
        shard_buckets: Split each bucket across ranks to balance the update (torch's rule).
        collectives: Override :func:`choose_collectives` (``"reduce+broadcast"`` needs the
            default ``allreduce_hook``, which it replaces by reduces onto the owners).

    Returns:
        The hook to pass to ``ddp.register_comm_hook(None, ...)``.

    Example:
        >>> # ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
    """
    return _make_hook(hook, ddp, zero, shard_buckets, interleaved=False, collectives=collectives)


def hook_with_zero_step_interleaved(
    hook: Hook,
    ddp: DistributedDataParallel,
    zero: ZeroRedundancyOptimizer,
    shard_buckets: bool = False,
    *,
    collectives: Collectives | None = None,
) -> Hook:
    """Like :func:`hook_with_zero_step`, but each bucket is updated while backward goes on.

    When bucket ``i`` arrives, bucket ``i - 1`` (whose reduction has had the time of one
    bucket's backward to finish) is updated and its broadcasts started, so the step overlaps
    the backward computation too. Never hangs on gloo, however many buckets.

    Example:
        >>> # ddp.register_comm_hook(None, hook_with_zero_step_interleaved(allreduce_hook, ddp, zero))
    """
    return _make_hook(hook, ddp, zero, shard_buckets, interleaved=True, collectives=collectives)
