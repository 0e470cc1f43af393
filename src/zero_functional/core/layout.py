"""Flat-buffer layouts and the assignment of DDP gradient buckets to ranks (pure).

A :class:`BucketLayout` says where each tensor sits in one contiguous buffer; :func:`flatten`
builds such a buffer and :func:`views` makes tensors that alias it (what
``parameters_as_bucket_view`` does to parameters). :func:`ddp_bucket_assignments` is torch's rule
for which ranks update which part of each DDP gradient bucket in overlap mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from zero_functional.core._validate import (
    check_align,
    check_numels,
    check_world_size,
    first_of,
    round_up,
)

__all__ = [
    "BucketAssignment",
    "BucketLayout",
    "bucket_layout",
    "ddp_bucket_assignments",
    "flatten",
    "views",
]


@dataclass(frozen=True, slots=True)
class BucketLayout:
    """Offsets of tensors in one 1-D buffer of ``size`` elements; offsets multiples of ``align``."""

    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    size: int
    align: int

    def __post_init__(self) -> None:
        check_align(self.align)
        if len(self.numels) != len(self.offsets):
            raise ValueError("a BucketLayout needs one offset per tensor")
        edge = 0
        for n, off in zip(self.numels, self.offsets):
            if n < 0 or off < edge or off % self.align:
                raise ValueError(
                    f"offset {off} (numel {n}) overlaps, goes back or breaks align {self.align}"
                )
            edge = off + n
        if self.size < edge or self.size % self.align:
            raise ValueError(
                f"size {self.size} is too small or not a multiple of align {self.align}"
            )


def bucket_layout(numels: Sequence[int], *, align: int = 1) -> BucketLayout:
    """Lay tensors of ``numels`` elements end to end, each start rounded up to ``align``.

    Args:
        numels: Number of elements of each tensor, in buffer order.
        align: Every offset, and the total size, is a multiple of this many elements.

    Returns:
        The offsets and the padded size of the buffer.

    Raises:
        ValueError: ``align < 1`` or a negative size.

    Example:
        >>> bucket_layout([3, 5, 2], align=4)
        BucketLayout(numels=(3, 5, 2), offsets=(0, 4, 12), size=16, align=4)
    """
    check_align(align)
    check_numels(numels)
    offsets = []
    edge = 0
    for n in numels:
        edge = round_up(edge, align)
        offsets.append(edge)
        edge += n
    return BucketLayout(tuple(numels), tuple(offsets), round_up(edge, align), align)


def flatten(tensors: Sequence[Tensor], layout: BucketLayout | None = None) -> Tensor:
    """A new 1-D buffer holding ``tensors`` at the layout's offsets (padding zero); pure.

    Args:
        tensors: Tensors of one dtype on one device, any shapes.
        layout: Where each tensor goes; by default end to end (``bucket_layout`` of the sizes).

    Returns:
        A new buffer of ``layout.size`` elements; the inputs are not touched.

    Raises:
        ValueError: No tensors, mixed dtypes or devices, or sizes that differ from the layout.

    Example:
        >>> flatten([torch.ones(2, 2), torch.zeros(1)]).tolist()
        [1.0, 1.0, 1.0, 1.0, 0.0]
    """
    if not tensors:
        raise ValueError("flatten needs at least one tensor")
    if layout is None:
        layout = bucket_layout([t.numel() for t in tensors])
    kinds = {(t.dtype, t.device) for t in tensors}
    if len(kinds) > 1:
        found = ", ".join(sorted(f"{d} on {v}" for d, v in kinds))
        raise ValueError(
            f"tensors have {found}; one buffer holds one dtype on one device: flatten each (device, dtype) group on its own"
        )
    if tuple(t.numel() for t in tensors) != layout.numels:
        raise ValueError(
            f"tensor sizes {first_of([t.numel() for t in tensors])} do not match the layout's "
            f"{first_of(layout.numels)}"
        )
    buffer = torch.zeros(layout.size, dtype=tensors[0].dtype, device=tensors[0].device)
    for t, off in zip(tensors, layout.offsets):
        buffer[off : off + t.numel()].copy_(t.detach().reshape(-1))
    return buffer


def views(buffer: Tensor, layout: BucketLayout, shapes: Sequence[Sequence[int]]) -> list[Tensor]:
    """Tensors of ``shapes`` that alias ``buffer`` at the layout's offsets.

    Writing to a view writes to the buffer, and back: ``views(flatten(ts, l), l, shapes)``
    equals ``ts``.

    Args:
        buffer: A contiguous 1-D tensor of at least ``layout.size`` elements.
        layout: Where each tensor sits in ``buffer``.
        shapes: The shape of each tensor; ``shapes[i]`` must hold ``layout.numels[i]`` elements.

    Returns:
        One view per tensor, sharing storage with ``buffer``.

    Raises:
        ValueError: A buffer too small, not 1-D or not contiguous, or shapes that do not fit.

    Example:
        >>> buf = torch.arange(6.0)
        >>> [v.tolist() for v in views(buf, bucket_layout([4, 2]), [(2, 2), (2,)])]
        [[[0.0, 1.0], [2.0, 3.0]], [4.0, 5.0]]
    """
    if buffer.dim() != 1 or buffer.numel() < layout.size or not buffer.is_contiguous():
        raise ValueError(
            f"buffer has shape {tuple(buffer.shape)}; views need a contiguous 1-D buffer of at "
            f"least {layout.size} elements: pass flatten(tensors, layout)"
        )
    if len(shapes) != len(layout.numels):
        raise ValueError(f"got {len(shapes)} shapes for {len(layout.numels)} tensors")
    out = []
    for shape, n, off in zip(shapes, layout.numels, layout.offsets):
        if torch.Size(shape).numel() != n:
            raise ValueError(f"shape {tuple(shape)} does not hold {n} elements")
        out.append(buffer[off : off + n].view(tuple(shape)))
    return out


@dataclass(frozen=True, slots=True)
class BucketAssignment:
    """Parameters ``[offset, offset + length)`` of DDP bucket ``bucket`` are updated by ``rank``."""

    bucket: int
    rank: int
    offset: int
    length: int

    def __post_init__(self) -> None:
        if self.length < 1 or self.offset < 0 or self.rank < 0 or self.bucket < 0:
            raise ValueError(
                f"{self} needs length >= 1 and bucket, rank, offset >= 0: "
                "build it with ddp_bucket_assignments()"
            )


def _least_loaded(loads: Sequence[int], excluded: set[int], bucket: int) -> int:
    # compat: torch's `_get_min_index`: the first rank of minimal load not yet in this bucket.
    best = -1
    for r, load in enumerate(loads):
        if r not in excluded and (best < 0 or load < loads[best]):
            best = r
    if best < 0:
        # compat: torch fails here too (AssertionError "All indices are disallowed").
        raise ValueError(
            f"torch's shard_buckets rule cuts DDP bucket {bucket} into more than "
            f"{len(loads)} pieces, one per rank at most (many parameters each near "
            "total / world_size): pass shard_buckets=False, or a larger bucket_cap_mb to DDP"
        )
    return best


def ddp_bucket_assignments(
    bucket_numels: Sequence[Sequence[int]], world_size: int, *, shard_buckets: bool = False
) -> tuple[tuple[BucketAssignment, ...], ...]:
    """torch's assignment of DDP gradient buckets to ranks, per rank in creation order.

    Without ``shard_buckets``, bucket ``i`` goes whole to rank ``i % world_size``. With it,
    buckets are taken smallest first (stable); each is cut into runs of consecutive parameters
    that stay under ``total / world_size`` elements, each run to the least-loaded rank that holds
    no part of that bucket yet.

    Args:
        bucket_numels: For each DDP bucket (in DDP's bucket index order), the number of
            elements of each of its parameters, in bucket order.
        world_size: Number of ranks.
        shard_buckets: Whether a bucket may be split among several ranks (the
            ``shard_buckets`` argument of torch's ``hook_with_zero_step``).

    Returns:
        For each rank, its assignments in the order torch creates them.

    Raises:
        ValueError: ``world_size < 1``, an empty bucket, a negative size, or (as torch) a
            bucket that the sharding rule would cut into more pieces than there are ranks.

    Example:
        >>> ddp_bucket_assignments([[4, 4], [2]], 2)
        ((BucketAssignment(bucket=0, rank=0, offset=0, length=2),), (BucketAssignment(bucket=1, rank=1, offset=0, length=1),))
        >>> [len(r) for r in ddp_bucket_assignments([[4, 4], [2]], 2, shard_buckets=True)]
        [2, 1]
    """
    check_world_size(world_size)
    for b, numels in enumerate(bucket_numels):
        if len(numels) == 0:
            raise ValueError(
                f"DDP bucket {b} is empty; every bucket holds at least one parameter: "
                "pass bucket.parameters() sizes for each bucket"
            )
        if any(n < 0 for n in numels):
            raise ValueError(
                f"DDP bucket {b} has a negative size among {first_of(numels)}: pass p.numel()"
            )
    per_rank: list[list[BucketAssignment]] = [[] for _ in range(world_size)]
    if not shard_buckets:
        for b, numels in enumerate(bucket_numels):
            per_rank[b % world_size].append(BucketAssignment(b, b % world_size, 0, len(numels)))
        return tuple(tuple(r) for r in per_rank)
    threshold = sum(sum(b) for b in bucket_numels) / world_size
    loads = [0] * world_size
    # compat: torch visits buckets smallest first with a stable sort (ties keep bucket order).
    for b in sorted(range(len(bucket_numels)), key=lambda i: sum(bucket_numels[i])):
        numels = bucket_numels[b]
        taken: set[int] = set()
        start, size = 0, 0
        for i, n in enumerate(numels):
            # compat: torch closes a piece when adding the next parameter would reach (>=,
            # not >) the threshold, so pieces can be much smaller than total / world_size.
            if size + n >= threshold and i > start:
                r = _least_loaded(loads, taken, b)
                per_rank[r].append(BucketAssignment(b, r, start, i - start))
                taken.add(r)
                loads[r] += size
                start, size = i, 0
            size += n
        r = _least_loaded(loads, taken, b)
        per_rank[r].append(BucketAssignment(b, r, start, len(numels) - start))
        taken.add(r)
        loads[r] += size
    return tuple(tuple(r) for r in per_rank)
