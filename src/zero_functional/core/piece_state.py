"""Per-piece optimizer state <-> torch's per-parameter format (pure).

A rank that owns a piece ``[start, stop)`` of a parameter keeps that parameter's state for the
piece only: each *elementwise* state tensor (``exp_avg``, ``momentum_buffer``, ...) holds the
piece's elements, 1-D (or in the parameter's shape when the piece is the whole parameter), and
each *per-parameter* value (Adam's 0-d ``step``, a Python number) is the same on every rank that
holds a piece. :func:`slice_state` cuts the state of a piece down to a sub-range,
:func:`join_states` glues the states of adjacent ranges back together; with them one rank's
state moves to another ownership and every rank's pieces become torch's format.

Example:
    >>> import torch
    >>> whole = {"step": torch.tensor(3.0), "exp_avg": torch.arange(6.0).view(2, 3)}
    >>> a = slice_state(whole, (0, 6), (0, 4))
    >>> b = slice_state(whole, (0, 6), (4, 6))
    >>> a["exp_avg"].tolist(), b["exp_avg"].tolist()
    ([0.0, 1.0, 2.0, 3.0], [4.0, 5.0])
    >>> back = join_states([((0, 4), a), ((4, 6), b)], (2, 3))
    >>> back["exp_avg"].tolist(), back["step"].item()
    ([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], 3.0)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

import torch
from torch import Tensor

from zero_functional.core._validate import first_of
from zero_functional.core.blockwise import is_blockwise, joined_blocks, sliced_blocks

__all__ = ["is_elementwise", "join_states", "placed", "slice_state"]

Range = tuple[int, int]


def is_elementwise(value: object, numel: int) -> bool:
    """Whether a state value holds one entry per element of a piece of ``numel`` elements.

    A tensor of at least one dimension and ``numel`` elements is elementwise; 0-d tensors
    (``step``), numbers and other objects are per-parameter values.

    Example:
        >>> import torch
        >>> is_elementwise(torch.zeros(2, 3), 6), is_elementwise(torch.tensor(1.0), 1)
        (True, False)
    """
    return isinstance(value, Tensor) and value.dim() >= 1 and value.numel() == numel


def slice_state(state: Mapping[str, object], held: Range, want: Range) -> dict[str, object]:
    """The state of elements ``want`` of a parameter, from the state of the piece ``held``.

    Pure: elementwise tensors come back as new 1-D tensors (copies), per-parameter values as
    they are (tensors cloned). ``want`` equal to ``held`` returns the state unchanged in shape.

    Args:
        state: The state of the piece ``held`` (``held``'s elements, any shape).
        held: ``(start, stop)`` of the piece the state belongs to, in parameter elements.
        want: ``(start, stop)`` inside ``held``.

    Returns:
        The state of ``want``.

    Raises:
        ValueError: ``want`` is not inside ``held``.

    Example:
        >>> import torch
        >>> slice_state({"momentum_buffer": torch.arange(4.0)}, (2, 6), (3, 5))
        {'momentum_buffer': tensor([1., 2.])}
    """
    (a, b), (lo, hi) = held, want
    if not a <= lo <= hi <= b:
        raise ValueError(f"elements [{lo}, {hi}) are not inside the piece [{a}, {b})")
    out: dict[str, object] = {}
    for key, value in state.items():
        if not isinstance(value, Tensor):
            out[key] = value
        elif want == held:
            out[key] = copied(value.detach())
        elif is_elementwise(value, b - a) and is_blockwise(value):
            out[key] = sliced_blocks(key, value, (a, b), (lo, hi))
        elif is_elementwise(value, b - a):
            out[key] = copied(value.detach().reshape(-1)[lo - a : hi - a])
        else:
            out[key] = copied(value.detach())
    return out


def copied(value: Tensor) -> Tensor:
    """A copy of ``value``: ``clone()``, or for a wrapper tensor subclass without one (torchao's
    quantized optimizer state: codes, scales and a code table) each of its inner tensors cloned.

    Example:
        >>> import torch
        >>> copied(torch.ones(2))
        tensor([1., 1.])
    """
    flatten = getattr(type(value), "__tensor_flatten__", None)
    if flatten is None:
        return value.clone()
    names, ctx = value.__tensor_flatten__()  # type: ignore[attr-defined]
    inner = {n: getattr(value, n).clone() for n in names}
    return cast(
        Tensor,
        type(value).__tensor_unflatten__(inner, ctx, value.shape, value.stride()),  # type: ignore[attr-defined]
    )


def join_states(
    parts: Sequence[tuple[Range, Mapping[str, object]]], shape: Sequence[int] | None = None
) -> dict[str, object]:
    """One state from the states of adjacent ranges, in element order; pure.

    Elementwise tensors are concatenated (and viewed as ``shape`` when given, for a piece that
    is the whole parameter); per-parameter values are taken from the first part.

    Args:
        parts: ``((start, stop), state)`` per range, contiguous and in order.
        shape: The parameter's shape when the ranges cover it all; else ``None`` (1-D).

    Returns:
        The state of the union of the ranges.

    Raises:
        ValueError: No parts, ranges that are not contiguous, or parts with different keys.

    Example:
        >>> import torch
        >>> join_states([((0, 1), {"v": torch.ones(1)}), ((1, 3), {"v": torch.zeros(2)})])
        {'v': tensor([1., 0., 0.])}
    """
    if not parts:
        raise ValueError("join_states needs at least one part")
    for (before, _), (after, _) in zip(parts, parts[1:]):
        if before[1] != after[0]:
            raise ValueError(
                f"ranges {before} and {after} (of {len(parts)}) are not contiguous and in order"
            )
    keys = set(parts[0][1])
    for r, s in parts[1:]:
        if set(s) != keys:
            raise ValueError(
                f"the state of elements {r} has keys {sorted(s)} but that of "
                f"{parts[0][0]} has {sorted(keys)}: the pieces were stepped differently"
            )
    if len(parts) == 1 and shape is None:
        return dict(parts[0][1])
    out: dict[str, object] = {}
    for key, first in parts[0][1].items():
        sizes = [hi - lo for (lo, hi), _ in parts]
        values = [s[key] for _, s in parts]
        elementwise = all(is_elementwise(v, n) for v, n in zip(values, sizes))
        blockwise = [is_blockwise(v) for v in values]
        if elementwise and any(blockwise):
            if not all(blockwise):
                raise ValueError(
                    f"the pieces of {key!r} are quantized for some ranges and not for others "
                    f"({first_of([r for r, _ in parts])}): a parameter's state is quantized "
                    "whole or not"
                )
            whole = tuple(shape) if shape is not None else (sum(sizes),)
            out[key] = joined_blocks(key, cast(list[Tensor], values), whole)
        elif elementwise:
            joined = torch.cat([cast(Tensor, s[key]).detach().reshape(-1) for _, s in parts])
            out[key] = joined.view(tuple(shape)) if shape is not None else joined
        else:
            out[key] = first
    return out


def placed(
    key: str,
    value: object,
    param: Tensor,
    *,
    fp32_step: bool,
    copy: bool,
    dtype: torch.dtype | None = None,
) -> object:
    """Where a loaded or moved state value lives: torch's rule (floating values in the
    parameter's dtype, everything on its device), except that ``step`` is float32 on the
    parameter's device where ``fp32_step`` (the functional core, fused or capturable groups:
    the fused kernels need it there; torch's CPU step: pytorch#124133), and floating values are
    in ``dtype`` where given (a parameter updated through a main copy of that dtype);
    ``copy=False`` keeps a tensor that is already in place.

    Example:
        >>> import torch
        >>> p = torch.zeros(2, dtype=torch.float64)
        >>> placed("exp_avg", torch.ones(2), p, fp32_step=True, copy=True).dtype
        torch.float64
        >>> placed("step", torch.tensor(3), p, fp32_step=True, copy=True).dtype
        torch.float32
    """
    if not isinstance(value, Tensor):
        return value
    if key == "step":
        if fp32_step:
            return value.detach().to(device=param.device, dtype=torch.float32, copy=copy)
        return value.detach().clone() if copy else value.detach()
    if value.is_floating_point():
        return value.detach().to(device=param.device, dtype=dtype or param.dtype, copy=copy)
    return value.detach().to(device=param.device, copy=copy)
