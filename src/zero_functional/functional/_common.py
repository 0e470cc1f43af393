"""Shared checks and grouping for the functional optimizers (private)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

__all__: list[str] = []

FUSED_ADAM_DEVICE_TYPES: tuple[str, ...] = ("cpu", "cuda")
FUSED_ADAM_DTYPES: tuple[torch.dtype, ...] = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
)


def check_lists(
    fn: str,
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    states: Mapping[str, Sequence[Tensor | None]],
) -> None:
    """Raise a ValueError naming the fix when the lists do not line up with ``params``."""
    n = len(params)
    if len(grads) != n:
        raise ValueError(
            f"{fn}: got {n} params but {len(grads)} grads; pass exactly one grad per param "
            "(a param without a grad must be left out of params, as torch.optim skips it)"
        )
    for name, values in states.items():
        if len(values) != n:
            raise ValueError(
                f"{fn}: got {n} params but state.{name} has {len(values)} entries; the state "
                f"must come from init() on the same params (or state_from_dicts) in the same order"
            )
    for i, (p, g) in enumerate(zip(params, grads)):
        if not isinstance(p, Tensor) or not isinstance(g, Tensor):
            raise TypeError(
                f"{fn}: params[{i}] and grads[{i}] must be Tensors, got "
                f"{type(p).__name__} and {type(g).__name__}; a missing grad (None) means the "
                "param must be left out of this update"
            )
        if g.shape != p.shape:
            raise ValueError(
                f"{fn}: grads[{i}] has shape {tuple(g.shape)} but params[{i}] has shape "
                f"{tuple(p.shape)}; grads must be passed in the same order as params"
            )
        if g.dtype != p.dtype or g.device != p.device:
            raise ValueError(
                f"{fn}: grads[{i}] is {g.dtype} on {g.device} but params[{i}] is {p.dtype} on "
                f"{p.device}; cast the grad with grad.to(param) before the update"
            )
        if g.is_sparse:
            raise ValueError(f"{fn}: grads[{i}] is sparse; only dense grads are supported")
    for name, values in states.items():
        for i, (p, s) in enumerate(zip(params, values)):
            if s is not None and s.dim() != 0 and s.shape != p.shape:
                raise ValueError(
                    f"{fn}: state.{name}[{i}] has shape {tuple(s.shape)} but params[{i}] has "
                    f"shape {tuple(p.shape)}; the state belongs to other params or another order"
                )


def group_indices(params: Sequence[Tensor]) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    """Indices of ``params`` grouped by (device, dtype), groups and members in first-seen order.

    The grouping every foreach or fused kernel needs (each call takes one device and dtype).

    Example:
        >>> import torch
        >>> ts = [torch.zeros(1), torch.zeros(1, dtype=torch.float64), torch.zeros(2)]
        >>> list(group_indices(ts).values())
        [[0, 2], [1]]
    """
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.device, p.dtype), []).append(i)
    return groups


def fused_adam_supports(t: Tensor) -> bool:
    """Whether torch's fused Adam kernels take a tensor of this device type and dtype."""
    return t.device.type in FUSED_ADAM_DEVICE_TYPES and t.dtype in FUSED_ADAM_DTYPES


def check_real_number(fn: str, name: str, value: object) -> None:
    """Reject tensors and non-numbers where the update needs a Python number."""
    if isinstance(value, Tensor):
        raise TypeError(
            f"{fn}: {name} is a Tensor; zero_functional takes {name} as a Python float "
            f"(pass float({name}) or use the torch.optim optimizer with capturable=True)"
        )
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{fn}: {name} must be a float, got {type(value).__name__}")
