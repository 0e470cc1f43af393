"""Main parameters: the higher-precision copy of the owned pieces of low-precision parameters.

With ``main_params_dtype=torch.float32`` a bf16 (or fp16) parameter's owned piece is updated
through an fp32 copy kept in the piece's optimizer state under :data:`MAIN_KEY` (Megatron-LM's
and Apex's "main" or "master" parameters, sharded with the state as in their distributed
optimizers): the gradient piece is upcast, the optimizer updates the fp32 copy with fp32 state,
and the parameter's piece receives ``main.to(param.dtype)``, so the parameter all-gather moves
2 bytes per element. Living in the state dict, the copy travels with every state move there is
(consolidation, resharding, sharded checkpoints) with no code of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["MAIN_KEY", "check_main_params_dtype", "main_dtype_for", "step_through_main_"]

MAIN_KEY = "main_param"
"""The state key of a piece's main copy (in the parameter's shape in a consolidated dict)."""


def check_main_params_dtype(value: object) -> torch.dtype | None:
    """``value`` if it is a valid ``main_params_dtype`` (``None`` or a floating dtype of at least
    4 bytes), else a ``TypeError``/``ValueError`` naming the choices.

    Example:
        >>> check_main_params_dtype(torch.float32)
        torch.float32
        >>> check_main_params_dtype(torch.bfloat16)
        Traceback (most recent call last):
        ...
        ValueError: main_params_dtype=torch.bfloat16 is not wider than bf16/fp16 parameters: pass torch.float32 (or None to update the parameters in their own dtype)
    """
    if value is None:
        return None
    if not isinstance(value, torch.dtype):
        raise TypeError(
            f"main_params_dtype must be a torch.dtype such as torch.float32, or None; got {value!r}"
        )
    if not value.is_floating_point or value.itemsize < 4:
        raise ValueError(
            f"main_params_dtype={value} is not wider than bf16/fp16 parameters: pass "
            "torch.float32 (or None to update the parameters in their own dtype)"
        )
    return value


def main_dtype_for(
    param_dtype: torch.dtype, main_params_dtype: torch.dtype | None
) -> torch.dtype | None:
    """The dtype of a parameter's main copy: ``main_params_dtype`` for a floating parameter of a
    narrower dtype, else ``None`` (the parameter is updated in place).

    Example:
        >>> main_dtype_for(torch.bfloat16, torch.float32), main_dtype_for(torch.float32, torch.float32)
        (torch.float32, None)
    """
    if main_params_dtype is None or not param_dtype.is_floating_point:
        return None
    return main_params_dtype if param_dtype.itemsize < main_params_dtype.itemsize else None


StepPieces = Callable[
    [Mapping[str, Any], Sequence[Tensor], Sequence[Tensor], list[dict[str, Any]]], None
]


def step_through_main_(
    step_pieces: StepPieces,
    group: Mapping[str, Any],
    views: Sequence[Tensor],
    grads: Sequence[Tensor],
    states: Sequence[dict[str, Any]],
    dtypes: Sequence[torch.dtype | None],
) -> None:
    """Run ``step_pieces(group, params, grads, states)`` over the pieces ``views``, each through
    its main copy where ``dtypes`` names one: in place on ``states`` and ``views``.

    A piece with a main dtype is stepped as its main copy (``states[i][MAIN_KEY]``, made from the
    piece on its first step), with its gradient upcast and its other state in the main dtype;
    the piece then receives the copy rounded to its own dtype. The stepper never sees
    :data:`MAIN_KEY` (torch's optimizers take a non-empty state for an initialized one).

    Example:
        >>> p = torch.tensor([1.0], dtype=torch.bfloat16)
        >>> def sgd(group, params, grads, states):
        ...     for q, g in zip(params, grads):
        ...         q.sub_(group["lr"] * g)
        >>> state = {}
        >>> step_through_main_(sgd, {"lr": 1e-3}, [p], [torch.ones(1, dtype=torch.bfloat16)],
        ...                    [state], [torch.float32])
        >>> state[MAIN_KEY].item(), p.item()  # bf16 alone would have stayed at 1.0
        (0.9990000128746033, 1.0)
    """
    if not any(d is not None for d in dtypes):
        step_pieces(group, views, grads, list(states))
        return
    params: list[Tensor] = []
    upcast: list[Tensor] = []
    inner: list[dict[str, Any]] = []
    written: list[tuple[Tensor, Tensor]] = []
    for view, grad, state, dtype in zip(views, grads, states, dtypes, strict=True):
        if dtype is None:
            params.append(view)
            upcast.append(grad)
            inner.append(state)
            continue
        main = state.get(MAIN_KEY)
        if main is None:
            main = view.detach().to(dtype, copy=True)
            state[MAIN_KEY] = main
        params.append(main)
        upcast.append(grad.to(dtype))
        inner.append({k: v for k, v in state.items() if k != MAIN_KEY})
        written.append((view, main))
    step_pieces(group, params, upcast, inner)
    for state, own in zip(states, inner):
        if own is not state:
            state.update(own)
    with torch.no_grad():
        for view, main in written:
            view.copy_(main)
