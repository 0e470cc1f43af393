"""DDP communication hooks that run the sharded step inside backward (``overlap_with_ddp``).

Why torch's hooks hang on gloo (pytorch#62300): they issue broadcasts from future callbacks,
which run on whichever communication thread finishes first, so ranks issue collectives in
different orders, and gloo pairs collectives by issue order. Here every collective is issued from
the hook itself, which DDP calls on the autograd thread in bucket order on every rank; the only
waits are on futures of collectives already issued in that shared order.

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

Collectives = Literal["allreduce+broadcast", "reduce_scatter+all_gather"]
Hook = Callable[[Any, GradBucket], Future[Tensor]]


def choose_collectives(backend: str) -> Collectives:
    """The collectives overlap mode uses on ``backend``.

    All-reduce of the gradient bucket, then one broadcast per owner rank of its updated
    parameters. On gloo this measures fastest (its reduce-scatter and all-gather are slower
    than all-reduce and broadcast on CPU). Reduce-scatter + all-gather would move the bytes of
    one all-reduce on NCCL; it needs a per-element partition of each bucket and is not built
    yet, so every backend gets all-reduce + broadcast for now.

    Args:
        backend: A ``torch.distributed`` backend name.

    Returns:
        The strategy name.

    Example:
        >>> choose_collectives("gloo")
        'allreduce+broadcast'
    """
    name = backend.lower()
    if not name:
        raise ValueError("backend must be a non-empty backend name such as 'gloo' or 'nccl'")
    return "allreduce+broadcast"


@dataclass
class _Iteration:
    """What one backward has seen so far."""

    indices: list[tuple[int, ...]] = field(default_factory=list)
    futures: list[Future[Any]] = field(default_factory=list)
    processed: int = 0
    deferred: bool = False
    works: list[comm.Work] = field(default_factory=list)
    receivers: list[tuple[Tensor, list[Tensor]]] = field(default_factory=list)


class _Overlap:
    """The state overlap mode keeps between buckets and iterations (one per ZeRO instance)."""

    def __init__(
        self, zero: ZeroRedundancyOptimizer, shard_buckets: bool, interleaved: bool
    ) -> None:
        self.zero = zero
        self.shard_buckets = shard_buckets
        self.interleaved = interleaved
        self.params = zero._all_params()
        self.index = {p: i for i, p in enumerate(self.params)}
        self.group_of = [g for g, group in enumerate(zero.param_groups) for _ in group["params"]]
        self.structure: tuple[tuple[int, ...], ...] | None = None
        self.by_bucket: list[list[BucketAssignment]] = []
        self.it: _Iteration | None = None

    # -------------------------------------------------------------- per bucket

    def on_bucket(self, bucket: GradBucket, fut: Future[Any]) -> None:
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
        it.futures.append(fut)
        s = self.structure
        if s is None or i >= len(s) or s[i] != indices or (bucket.is_last() and len(s) != i + 1):
            it.deferred = True
        if self.interleaved and not it.deferred:
            while it.processed < i:  # one bucket behind: its all-reduce has had time to finish
                self._process(it.processed)
        if bucket.is_last():
            if it.deferred:
                self._adopt(tuple(it.indices))
            while it.processed < len(it.indices):
                self._process(it.processed)
            self._finish()

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

    def _process(self, j: int) -> None:
        """Update this rank's part of bucket ``j`` and start the broadcasts of every part."""
        it = self.it
        assert it is not None
        zero = self.zero
        it.processed = j + 1
        indices = it.indices[j]
        value = it.futures[j].wait()
        flat = value if isinstance(value, Tensor) else value[0]
        starts = [0]
        for k in indices:
            starts.append(starts[-1] + self.params[k].numel())
        for a in self.by_bucket[j]:
            if a.rank != zero.rank:
                continue
            span = range(a.offset, a.offset + a.length)
            by_group: dict[int, tuple[list[Tensor], list[Tensor]]] = {}
            for pos in span:
                p = self.params[indices[pos]]
                ps, gs = by_group.setdefault(self.group_of[indices[pos]], ([], []))
                ps.append(p)
                gs.append(flat[starts[pos] : starts[pos + 1]].view_as(p))
            for g, (ps, gs) in by_group.items():
                zero._update(g, ps, gs)
        if zero.world_size == 1:
            return
        for a in self.by_bucket[j]:
            ps = [self.params[k] for k in indices[a.offset : a.offset + a.length]]
            if a.rank == zero.rank:
                buffer = torch.cat([p.detach().reshape(-1) for p in ps])
            else:
                buffer = torch.empty(
                    sum(p.numel() for p in ps), dtype=ps[0].dtype, device=ps[0].device
                )
                it.receivers.append((buffer, ps))
            it.works.extend(comm.broadcast_shards([buffer], [a.rank], zero.process_group))

    def _finish(self) -> None:
        it = self.it
        assert it is not None
        for work in it.works:
            work.wait()
        with torch.no_grad():
            for buffer, ps in it.receivers:
                comm.unflatten_into(buffer, ps)
        self.it = None


def _make_hook(
    hook: Hook,
    ddp: DistributedDataParallel,
    zero: ZeroRedundancyOptimizer,
    shard_buckets: bool,
    interleaved: bool,
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
    choose_collectives(str(dist.get_backend(ddp.process_group)))
    overlap = _Overlap(zero, shard_buckets, interleaved)
    zero._overlap = overlap

    def hook_with_zero_fn(state: Any, bucket: GradBucket) -> Future[Tensor]:
        assert ddp_ref() is not None, "the DDP module was garbage-collected"
        fut = hook(state, bucket)
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
) -> Hook:
    """Wrap a DDP comm hook so that the ZeRO step runs at the end of backward.

    Each gradient bucket is reduced by ``hook``; when the last bucket arrives, the ranks that
    own each bucket update its parameters with the reduced gradients and broadcast them, bucket
    by bucket. Works on every backend, gloo included, and updates from the first iteration.

    Args:
        hook: A DDP communication hook, e.g. ``default_hooks.allreduce_hook``.
        ddp: The ``DistributedDataParallel`` module.
        zero: A ``ZeroRedundancyOptimizer`` built with ``overlap_with_ddp=True`` from
            ``ddp.parameters()``.
        shard_buckets: Split each bucket across ranks to balance the update (torch's rule).

    Returns:
        The hook to pass to ``ddp.register_comm_hook(None, ...)``.

    Example:
        >>> # ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, zero))
    """
    return _make_hook(hook, ddp, zero, shard_buckets, interleaved=False)


def hook_with_zero_step_interleaved(
    hook: Hook,
    ddp: DistributedDataParallel,
    zero: ZeroRedundancyOptimizer,
    shard_buckets: bool = False,
) -> Hook:
    """Like :func:`hook_with_zero_step`, but each bucket is updated while backward goes on.

    When bucket ``i`` arrives, bucket ``i - 1`` (whose reduction has had the time of one
    bucket's backward to finish) is updated and its broadcasts started, so the step overlaps
    the backward computation too. Never hangs on gloo, however many buckets.

    Example:
        >>> # ddp.register_comm_hook(None, hook_with_zero_step_interleaved(allreduce_hook, ddp, zero))
    """
    return _make_hook(hook, ddp, zero, shard_buckets, interleaved=True)
