"""Block-wise quantized tensors cut and joined bitwise through their codes and scales (pure).

torchao's low-bit state (``OptimState8bit``, ``4bit``, ``Fp8``) is a wrapper tensor subclass of
``codes`` (per element) and one ``scale`` per block from the tensor's start; it has no ``cat``,
but a piece of whole blocks is a slice of both. Nothing here imports torchao."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, cast

import torch
from torch import Tensor

Range = tuple[int, int]


def is_blockwise(value: object) -> bool:
    """Whether ``value`` is a wrapper tensor subclass with inner ``codes`` and ``scale``.

    Example:
        >>> is_blockwise(torch.zeros(2))
        False
    """
    if not isinstance(value, Tensor) or getattr(type(value), "__tensor_flatten__", None) is None:
        return False
    names = value.__tensor_flatten__()[0]  # type: ignore[attr-defined]
    return "codes" in names and "scale" in names


def _inner(value: Tensor) -> tuple[dict[str, Tensor], Any]:
    names, ctx = value.__tensor_flatten__()  # type: ignore[attr-defined]
    return {n: getattr(value, n) for n in names}, ctx


class BlockParts(NamedTuple):
    """A block-wise tensor taken apart: its class, flat ``codes`` (``code_bytes`` per block) and
    ``scale`` (one per ``block`` elements), ``constants``, and its ``context`` for ``shape``."""

    cls: type
    codes: Tensor
    scale: Tensor
    constants: dict[str, Tensor]
    context: list[Any]
    shape: tuple[int, ...]
    block: int
    code_bytes: int


def block_parts(value: Tensor, shape: tuple[int, ...] | None = None) -> BlockParts:
    """The parts of the block-wise ``value`` (no copies), its context as for ``shape``.

    Example:
        >>> from torchao.optim.subclass_8bit import OptimState8bit
        >>> parts = block_parts(OptimState8bit.zeros((512,), signed=True, block_size=256))
        >>> parts.block, parts.code_bytes, parts.scale.shape
        (256, 256, torch.Size([2]))
    """
    if not is_blockwise(value):
        raise TypeError("the value is not a block-wise quantized tensor")
    inner, ctx = _inner(value)
    own, outer = tuple(value.shape), tuple(value.shape) if shape is None else tuple(shape)
    codes, scale = inner.pop("codes").reshape(-1), inner.pop("scale").reshape(-1)
    blocks = max(scale.numel(), 1)
    return BlockParts(
        type(value),
        codes,
        scale,
        inner,
        [outer if isinstance(c, tuple) and tuple(c) == own else c for c in ctx],
        outer,
        value.numel() // blocks,
        codes.numel() // blocks,
    )


def from_block_parts(parts: BlockParts, shape: tuple[int, ...]) -> Tensor:
    """A tensor of ``parts.cls`` and ``shape`` from ``parts``.

    Example:
        >>> from torchao.optim.subclass_8bit import OptimState8bit
        >>> v = OptimState8bit.zeros((512,), signed=True, block_size=256)
        >>> w = from_block_parts(block_parts(v, (2, 256)), (2, 256))
        >>> type(w).__name__, torch.equal(w.dequantize(), v.dequantize().view(2, 256))
        ('OptimState8bit', True)
    """
    numel = math.prod(shape)
    ctx = [shape if isinstance(c, tuple) and tuple(c) == parts.shape else c for c in parts.context]
    codes = parts.codes
    tensors = {
        **parts.constants,
        "codes": codes.reshape(shape) if codes.numel() == numel else codes.reshape(-1),
        "scale": parts.scale.reshape(-1),
    }
    stride = torch.empty(shape, device="meta").stride()
    return cast(Tensor, parts.cls.__tensor_unflatten__(tensors, ctx, shape, stride))  # type: ignore[attr-defined]


def _rebuilt(like: Tensor, inner: Mapping[str, Tensor], shape: tuple[int, ...]) -> Tensor:
    """A tensor of ``like``'s class from ``inner`` tensors, ``shape`` on the outside."""
    parts = block_parts(like)
    constants = {n: t for n, t in inner.items() if n not in ("codes", "scale")}
    return from_block_parts(
        parts._replace(codes=inner["codes"], scale=inner["scale"], constants=constants), shape
    )


def _block(value: Tensor) -> int:
    """Elements per scale of a block-wise tensor."""
    return value.numel() // max(_inner(value)[0]["scale"].numel(), 1)


def sliced_blocks(key: str, value: Tensor, held: Range, want: Range) -> Tensor:
    """A copy of elements ``want`` of the block-wise ``value`` of piece ``held`` (on its blocks).

    Example:
        >>> from torchao.optim.subclass_8bit import OptimState8bit
        >>> v = OptimState8bit.zeros((512,), block_size=256)
        >>> sliced_blocks("v", v, (0, 512), (256, 512)).shape
        torch.Size([256])
    """
    if not is_blockwise(value):
        raise TypeError(f"{key!r} is not a block-wise quantized tensor")
    (a, b), (lo, hi) = held, want
    block, n = _block(value), b - a
    if (lo - a) % block or (hi - a) % block:
        raise ValueError(
            f"elements [{lo}, {hi}) of the quantized state {key!r} of the piece [{a}, {b}) do "
            f"not start and stop on its blocks of {block} (one scale per block, counted from "
            "the piece's start): a low-bit state moves in whole blocks only; use "
            'partition="flat", which cuts on them, or the optimizer\'s block_size'
        )
    inner, _ = _inner(value)
    codes = inner["codes"].reshape(-1)
    per = codes.numel() * block // n  # code bytes per block (4-bit: two codes a byte)
    moved = {name: t.clone() for name, t in inner.items()}
    moved["codes"] = codes[(lo - a) // block * per : (hi - a) // block * per].clone()
    moved["scale"] = inner["scale"].reshape(-1)[(lo - a) // block : (hi - a) // block].clone()
    return _rebuilt(value, moved, (hi - lo,))


def joined_blocks(key: str, values: Sequence[Tensor], shape: tuple[int, ...]) -> Tensor:
    """One block-wise tensor of ``shape`` from block-wise ``values`` in element order.

    Example:
        >>> from torchao.optim.subclass_8bit import OptimState8bit
        >>> v = OptimState8bit.zeros((256,), block_size=256)
        >>> joined_blocks("v", [v, v], (2, 256)).shape
        torch.Size([2, 256])
    """
    if not all(is_blockwise(v) for v in values):
        raise TypeError(f"{key!r} is not a block-wise quantized tensor")
    first = values[0]
    ctx = first.__tensor_flatten__()[1]  # type: ignore[attr-defined]
    for v in values[1:]:
        if (
            type(v) is not type(first)
            or _block(v) != _block(first)
            or (
                [c for c in v.__tensor_flatten__()[1] if not isinstance(c, tuple)]  # type: ignore[attr-defined]
                != [c for c in ctx if not isinstance(c, tuple)]
            )
        ):
            raise ValueError(
                f"the pieces of the quantized state {key!r} differ in class, block or kind "
                f"({type(first).__name__} in blocks of {_block(first)}, "
                f"{type(v).__name__} in blocks of {_block(v)}): they were not made by one "
                "optimizer"
            )
    inner = [_inner(v)[0] for v in values]
    joined = dict(inner[0])
    for name in ("codes", "scale"):
        joined[name] = torch.cat([i[name].detach().reshape(-1) for i in inner])
    return _rebuilt(first, joined, shape)
