"""Block-wise quantized optimizer state in a checkpoint: flat codes and scales, and one object.

A quantized value (torchao's ``OptimState8bit``, ``4bit``, ``Fp8``) has no slice off a block,
so row boxes cannot carry it. The state ``key`` of the parameter ``name``, N elements in blocks
of B with c code entries each (4-bit: B/2), is ``quantized.<name>.<key>.codes`` (N/B x c; a
piece ``[lo, hi)`` writes ``[lo/B x c, hi/B x c)``), ``.scale`` (N/B fp32) and the object
``quantized.<name>.<key>`` (class path, constant tensors, flatten context, shape). A piece on
the saved blocks loads bitwise (:func:`rebuilt`); one off them, as dequantized fp32 state.

Example:
    >>> quantized_key("0.weight", "exp_avg"), codes_key("w", "m"), scale_key("w", "m")
    ('quantized.0.weight.exp_avg', 'quantized.w.m.codes', 'quantized.w.m.scale')
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from zero_functional.checkpoint.storage import CheckpointError, Saved, Wanted
from zero_functional.core.blockwise import BlockParts, block_parts, from_block_parts
from zero_functional.core.partition import Piece
from zero_functional.functional.registry import import_torchao

PREFIX = "quantized."
_TRUSTED = "torchao."  # saved classes import only from here: a checkpoint names no arbitrary code

Items = dict[str, tuple[tuple[int, ...], torch.dtype, list[tuple[int, int, Tensor]]]]


def quantized_key(name: str, key: str) -> str:
    """The object key of the quantized state ``key`` (no dot) of the parameter ``name``."""
    return f"{PREFIX}{name}.{key}"


def codes_key(name: str, key: str) -> str:
    """The key of its codes."""
    return quantized_key(name, key) + ".codes"


def scale_key(name: str, key: str) -> str:
    """The key of its scales."""
    return quantized_key(name, key) + ".scale"


def items(
    name: str, shape: tuple[int, ...], piece: Piece, key: str, value: Tensor
) -> tuple[Items, dict[str, object]]:
    """The tensor items (flat codes and scales) and the object of the quantized state ``key`` of
    the parameter ``name`` over ``piece``, which must start and stop on the value's blocks.

    Example:
        >>> from torchao.optim.subclass_4bit import OptimState4bit
        >>> v = OptimState4bit.zeros((256,), signed=True, block_size=128)
        >>> pieces, _ = items("w", (2, 256), Piece(0, 256, 512, 512), "exp_avg", v)
        >>> [(k, s, r[0][:2]) for k, (s, _, r) in pieces.items()]
        [('quantized.w.exp_avg.codes', (256,), (128, 256)), ('quantized.w.exp_avg.scale', (4,), (2, 4))]
    """
    parts = block_parts(value.detach(), shape)
    numel, block, c = math.prod(shape), parts.block, parts.code_bytes
    if numel % block or piece.start % block or (piece.stop % block and piece.stop != numel):
        raise CheckpointError(
            f"the quantized state {key!r} of {name} (elements [{piece.start}, {piece.stop}) of "
            f"{numel}) is not cut on its blocks of {block}: a checkpoint stores it in whole "
            'blocks; use partition="flat", which cuts on them, or "sorted_greedy"'
        )
    blocks, first, end = numel // block, piece.start // block, math.ceil(piece.stop / block)
    codes, scale = parts.codes, parts.scale
    pieces: Items = {
        codes_key(name, key): ((blocks * c,), codes.dtype, [(first * c, end * c, codes)]),
        scale_key(name, key): ((blocks,), scale.dtype, [(first, end, scale)]),
    }
    meta = {
        "class": f"{parts.cls.__module__}.{parts.cls.__qualname__}",
        "constants": parts.constants,
        "context": parts.context,
        "shape": tuple(shape),
    }
    return pieces, {quantized_key(name, key): meta}


@dataclass(frozen=True)
class QuantizedRead:
    """How one rank reads one quantized state value: its state key, the whole blocks
    ``[start, stop)`` (elements) enclosing the piece, and the codes per block."""

    key: str
    start: int
    stop: int
    code_bytes: int


def reads(
    saved: Saved, name: str, shape: tuple[int, ...], piece: Piece
) -> tuple[list[QuantizedRead], Wanted]:
    """What a rank reads of the parameter ``name``'s quantized state for ``piece``: one
    :class:`QuantizedRead` per value, and the ranges of whole blocks to ask storage for.

    Example:
        >>> saved = {"quantized.w.m": None, "quantized.w.m.codes": ((1024,), torch.uint8),
        ...          "quantized.w.m.scale": ((4,), torch.float32)}
        >>> plan, wanted = reads(saved, "w", (4, 256), Piece(0, 300, 700, 1024))
        >>> plan, sorted((k, r) for k, (_, _, r) in wanted.items())
        ([QuantizedRead(key='m', start=256, stop=768, code_bytes=256)], [('quantized.w.m.codes', [(256, 768)]), ('quantized.w.m.scale', [(1, 3)])])
    """
    numel = math.prod(shape)
    plan: list[QuantizedRead] = []
    wanted: dict[str, tuple[tuple[int, ...], torch.dtype, list[tuple[int, int]]]] = {}
    head = quantized_key(name, "")
    for obj, meta in saved.items():
        key = obj[len(head) :]
        if meta is not None or not obj.startswith(head) or "." in key:
            continue
        codes, scale = saved.get(codes_key(name, key)), saved.get(scale_key(name, key))
        if codes is None or scale is None or not scale[0] or numel % scale[0][0]:
            raise CheckpointError(
                f"the quantized state {key!r} of {name} does not fit its {numel} elements "
                f"(scales {None if scale is None else scale[0]}): another model's checkpoint"
            )
        blocks = scale[0][0]
        block, c = numel // blocks, codes[0][0] // blocks
        first, end = piece.start // block, math.ceil(piece.stop / block)
        plan.append(QuantizedRead(key, first * block, end * block, c))
        wanted[codes_key(name, key)] = (codes[0], codes[1], [(first * c, end * c)])
        wanted[scale_key(name, key)] = (scale[0], scale[1], [(first, end)])
    return plan, wanted


def _class(path: str) -> type:
    module, _, qualname = path.rpartition(".")
    cls = None
    if module.startswith(_TRUSTED):
        cls = getattr(import_torchao(module), qualname, None)
    if not isinstance(cls, type) or not issubclass(cls, Tensor):
        raise CheckpointError(
            f"the checkpoint's quantized state is of {path!r}, not a block-wise tensor class of "
            f"{_TRUSTED[:-1]} (install torchao to load it)"
        )
    return cls


def rebuilt(
    name: str,
    plan: Sequence[QuantizedRead],
    tensors: Mapping[str, Sequence[Tensor]],
    objects: Mapping[str, object],
    piece: Piece,
    shape: tuple[int, ...],
) -> dict[str, Tensor]:
    """The quantized state of ``piece`` of the parameter ``name`` from what ``plan`` read: in its
    saved class (which must import) where the piece is on the saved blocks, else dequantized.

    Example:
        >>> # rebuilt("w", plan, tensors, objects, Piece(0, 0, 1024, 1024), (4, 256))["m"]
    """
    out: dict[str, Tensor] = {}
    for read in plan:
        meta = objects[quantized_key(name, read.key)]
        assert isinstance(meta, dict)
        codes = tensors[codes_key(name, read.key)][0]
        scale = tensors[scale_key(name, read.key)][0]
        parts = BlockParts(
            _class(str(meta["class"])),
            codes,
            scale,
            dict(meta["constants"]),
            list(meta["context"]),
            tuple(meta["shape"]),
            (read.stop - read.start) // max(scale.numel(), 1),
            read.code_bytes,
        )
        if (read.start, read.stop) == (piece.start, piece.stop):
            out[read.key] = from_block_parts(parts, shape)
        else:  # off the saved blocks: the elements' values
            whole = from_block_parts(parts, (read.stop - read.start,))
            values: Any = whole.dequantize()
            a = piece.start - read.start
            out[read.key] = values.reshape(-1)[a : a + piece.stop - piece.start].reshape(shape)
    return out
