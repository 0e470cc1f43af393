"""Block-wise quantized tensors cut and joined bitwise through their codes and scales (pure).

torchao's low-bit state (``OptimState8bit``, ``4bit``, ``Fp8``) is a wrapper tensor subclass of
``codes`` (per element) and one ``scale`` per block from the tensor's start; it has no ``cat``,
but a piece of whole blocks is a slice of both. Nothing here imports torchao."""

from __future__ import annotations

import math
from collections.abc import Sequence
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
        >>> block_parts(OptimState8bit.zeros((512,), block_size=256)).block
        256
    """
    if not is_blockwise(value):
        raise TypeError("the value is not a block-wise quantized tensor")
    names, ctx = value.__tensor_flatten__()  # type: ignore[attr-defined]
    inner = {n: getattr(value, n) for n in names}
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
        >>> from_block_parts(block_parts(v, (2, 256)), (2, 256)).dequantize().shape
        torch.Size([2, 256])
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


def sliced_blocks(key: str, value: Tensor, held: Range, want: Range) -> Tensor:
    """A copy of elements ``want`` of the block-wise ``value`` of piece ``held`` (on its blocks).

    Example:
        >>> from torchao.optim.subclass_8bit import OptimState8bit
        >>> v = OptimState8bit.zeros((512,), block_size=256)
        >>> sliced_blocks("v", v, (0, 512), (256, 512)).shape
        torch.Size([256])
    """
    parts = block_parts(value)
    (a, b), (lo, hi) = held, want
    block, per = parts.block, parts.code_bytes  # 4-bit: two codes a byte
    if (lo - a) % block or (hi - a) % block:
        raise ValueError(
            f"elements [{lo}, {hi}) of the quantized state {key!r} of the piece [{a}, {b}) do "
            f"not start and stop on its blocks of {block} (one scale per block, counted from "
            "the piece's start): a low-bit state moves in whole blocks only; use "
            'partition="flat", which cuts on them, or the optimizer\'s block_size'
        )
    first, last = (lo - a) // block, (hi - a) // block
    return from_block_parts(
        parts._replace(
            codes=parts.codes[first * per : last * per].clone(),
            scale=parts.scale[first:last].clone(),
            constants={name: t.clone() for name, t in parts.constants.items()},
        ),
        (hi - lo,),
    )


def joined_blocks(key: str, values: Sequence[Tensor], shape: tuple[int, ...]) -> Tensor:
    """One block-wise tensor of ``shape`` from block-wise ``values`` in element order.

    Example:
        >>> from torchao.optim.subclass_8bit import OptimState8bit
        >>> v = OptimState8bit.zeros((256,), block_size=256)
        >>> joined_blocks("v", [v, v], (2, 256)).shape
        torch.Size([2, 256])
    """
    parts = [block_parts(v) for v in values]

    def kind(p: BlockParts) -> tuple[object, ...]:
        return p.cls, p.block, [c for c in p.context if not isinstance(c, tuple)]

    first = parts[0]
    for other in parts[1:]:
        if kind(other) != kind(first):
            raise ValueError(
                f"the pieces of the quantized state {key!r} differ in class, block or kind "
                f"({first.cls.__name__} in blocks of {first.block}, "
                f"{other.cls.__name__} in blocks of {other.block}): they were not made by one "
                "optimizer"
            )
    codes = torch.cat([p.codes.detach() for p in parts])
    scale = torch.cat([p.scale.detach() for p in parts])
    return from_block_parts(first._replace(codes=codes, scale=scale), shape)
