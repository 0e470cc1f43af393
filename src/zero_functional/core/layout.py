"""Where elements sit (pure): tensors in flat buffers, pieces as views, flat ranges as boxes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from zero_functional.core._validate import check_align, check_numels, first_of, round_up
from zero_functional.core.ownership import Ownership
from zero_functional.core.partition import Piece

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in an N-d tensor


@dataclass(frozen=True, slots=True)
class BucketLayout:
    """Offsets of tensors in one 1-D buffer of ``size`` elements, on multiples of ``align``."""

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
    """Tensors of ``numels`` elements end to end, offsets and size on multiples of ``align``.

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
    """A new 1-D buffer of ``tensors`` (one dtype and device) at ``layout``'s offsets, padding 0.

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
    """Tensors of ``shapes`` aliasing ``buffer`` at the layout's offsets (bucket views).

    Example:
        >>> [v.shape for v in views(torch.arange(6.0), bucket_layout([4, 2]), [(2, 2), (2,)])]
        [torch.Size([2, 2]), torch.Size([2])]
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


def check_splittable(tensors: Sequence[Tensor]) -> None:
    """A ValueError naming the fix unless every tensor is contiguous (a piece is a view of it).

    Example:
        >>> check_splittable([torch.zeros(2, 3)])
    """
    for i, t in enumerate(tensors):
        if not t.is_contiguous():
            raise ValueError(
                f"parameter {i} (shape {tuple(t.shape)}, strides {t.stride()}) is not "
                "contiguous, so a piece of it has no view: call .contiguous() on it (e.g. "
                "model.to(memory_format=torch.contiguous_format)) or use "
                "partition='sorted_greedy'"
            )


def piece_view(tensor: Tensor, piece: Piece) -> Tensor:
    """``piece``'s elements in ``tensor``, aliasing it: itself when whole, else a 1-D view.

    Example:
        >>> piece_view(torch.arange(6.0).view(2, 3), Piece(0, 2, 5, 6)).tolist()
        [2.0, 3.0, 4.0]
    """
    n = tensor.numel()
    if piece.param_numel != n:
        raise ValueError(
            f"{piece} is a piece of a parameter of {piece.param_numel} elements, not of this "
            f"tensor of {n} (it may lie outside it): pass the piece's own parameter"
        )
    if piece.is_whole:
        return tensor
    check_splittable([tensor])
    with torch.no_grad():
        return tensor.detach().view(-1)[piece.start : piece.stop]


def flat_range_boxes(
    shape: Sequence[int], start: int, stop: int, *, max_numel: int | None = None
) -> list[tuple[Box, int]]:
    """The contiguous N-d boxes ``(offsets, sizes)`` a row-major flat range covers, each with its
    first flat index, in order (at most ``2 * ndim - 1``; cut at multiples of ``max_numel``).

    Example:
        >>> flat_range_boxes((6, 5), 7, 23)
        [(((1, 2), (1, 3)), 7), (((2, 0), (2, 5)), 10), (((4, 0), (1, 3)), 20)]
    """
    shape = tuple(int(d) for d in shape)
    numel = math.prod(shape)
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"range [{start}, {stop}) is outside a tensor of shape {shape}")
    cuts = [start]
    if max_numel is not None:
        if max_numel < 1:
            raise ValueError(f"max_numel must be >= 1, got {max_numel}")
        cuts += range((start // max_numel + 1) * max_numel, stop, max_numel)
    out: list[tuple[Box, int]] = []
    for a, b in zip(cuts, [*cuts[1:], stop]):
        for box in _boxes(shape, a, b):  # in flat order, each contiguous: box starts at a
            out.append((box, a))
            a += math.prod(box[1])
    return out


def _boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    if start == stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))] if shape else [((), ())]
    inner_shape = shape[1:]
    inner = math.prod(inner_shape)
    (i0, r0), (i1, r1) = divmod(start, inner), divmod(stop, inner)
    if i0 == i1:
        return [((i0, *o), (1, *s)) for o, s in _boxes(inner_shape, r0, r1)]
    out: list[Box] = []
    if r0:
        out += [((i0, *o), (1, *s)) for o, s in _boxes(inner_shape, r0, inner)]
        i0 += 1
    if i1 > i0:
        out.append(((i0, *(0,) * len(inner_shape)), (i1 - i0, *inner_shape)))
    if r1:
        out += [((i1, *o), (1, *s)) for o, s in _boxes(inner_shape, 0, r1)]
    return out


def piece_views(tensors: Sequence[Tensor], ownership: Ownership) -> tuple[list[Tensor], list[int]]:
    """Every piece of every tensor, and the rank owning it: what ``comm.sync_params`` takes.

    Example:
        >>> from zero_functional.core.ownership import flat_ownership
        >>> piece_views([torch.arange(4.0)], flat_ownership([4], 2))
        ([tensor([0., 1.]), tensor([2., 3.])], [0, 1])
    """
    if len(tensors) != len(ownership.numels):
        raise ValueError(
            f"got {len(tensors)} tensors for an ownership of {len(ownership.numels)} "
            "parameters: pass one tensor per parameter, in the ownership's order"
        )
    held = [(t, rank, piece) for k, t in enumerate(tensors) for rank, piece in ownership.holders(k)]
    return [piece_view(t, piece) for t, _, piece in held], [rank for _, rank, _ in held]
