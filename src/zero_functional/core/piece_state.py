"""A piece's optimizer state cut to a sub-range and joined back (pure).

A rank owning a piece keeps its parameter's state for the piece only: *elementwise* tensors
(``exp_avg``, ...) hold the piece's elements (1-D, or in the parameter's shape when whole), and
*per-parameter* values (a 0-d ``step``, a number) are the same on every rank holding a piece."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

import torch
from torch import Tensor

from zero_functional.core._validate import first_of
from zero_functional.core.blockwise import Range, is_blockwise, joined_blocks, sliced_blocks


def is_elementwise(value: object, numel: int) -> bool:
    """Whether a state value holds one entry per element of a piece of ``numel`` (elementwise).

    Example:
        >>> is_elementwise(torch.zeros(2, 3), 6), is_elementwise(torch.tensor(1.0), 1)
        (True, False)
    """
    return isinstance(value, Tensor) and value.dim() >= 1 and value.numel() == numel


def slice_state(state: Mapping[str, object], held: Range, want: Range) -> dict[str, object]:
    """A copy of the state of elements ``want`` from that of the piece ``held``.

    Example:
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
        elif want == held or not is_elementwise(value, b - a):
            out[key] = copied(value.detach())
        elif is_blockwise(value):
            out[key] = sliced_blocks(key, value, held, want)
        else:
            out[key] = copied(value.detach().reshape(-1)[lo - a : hi - a])
    return out


def copied(value: Tensor) -> Tensor:
    """A copy of ``value`` (a wrapper tensor subclass: each inner tensor cloned).

    Example:
        >>> copied(torch.ones(2))
        tensor([1., 1.])
    """
    if getattr(type(value), "__tensor_flatten__", None) is None:
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
    """One state from those of adjacent ranges in order: elementwise tensors joined, the rest kept.

    Example:
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
    sizes = [hi - lo for (lo, hi), _ in parts]
    whole = tuple(shape) if shape is not None else (sum(sizes),)
    out: dict[str, object] = {}
    for key, first in parts[0][1].items():
        values = [s[key] for _, s in parts]
        blockwise = [is_blockwise(v) for v in values]
        if not all(is_elementwise(v, n) for v, n in zip(values, sizes)):
            out[key] = first
        elif all(blockwise):
            out[key] = joined_blocks(key, cast(list[Tensor], values), whole)
        elif any(blockwise):
            raise ValueError(
                f"the pieces of {key!r} are quantized for some ranges and not for others "
                f"({first_of([r for r, _ in parts])}): a parameter's state is quantized "
                "whole or not"
            )
        else:
            out[key] = torch.cat([cast(Tensor, v).detach().reshape(-1) for v in values]).view(whole)
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
    """A loaded or moved state value where torch puts it: on ``param``'s device, in its dtype (or
    ``dtype``), ``step`` float32 where ``fp32_step`` (as fused kernels read it; pytorch#124133).

    Example:
        >>> placed("step", torch.tensor(3), torch.zeros(2), fp32_step=True, copy=True).dtype
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
