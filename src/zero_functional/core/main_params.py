"""Main parameters (pure): a wider copy of the owned pieces of bf16/fp16 parameters.

Kept in the piece's state under :data:`MAIN_KEY` (Megatron-LM's "main" params), so it moves with
the state; or, with ``store_param_remainders``, as an int16 remainder beside the bf16 value
(TransformerEngine's rule, :func:`join_main`), which never leaves its rank (:func:`with_main`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor

MAIN_KEY = "main_param"  # the state key of a piece's main copy
REMAINDER_KEY = "main_param_remainder"  # ... of its int16 remainder (never saved)
StepPieces = Callable[
    [Mapping[str, Any], Sequence[Tensor], Sequence[Tensor], list[dict[str, Any]]], None
]


def check_main_params_dtype(value: object) -> torch.dtype | None:
    """``value`` if it is a valid ``main_params_dtype`` (``None``, or floating of >= 4 bytes).

    Example:
        >>> check_main_params_dtype(torch.float32)
        torch.float32
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
    param_dtype: torch.dtype, main_params_dtype: torch.dtype | None, always: bool = False
) -> torch.dtype | None:
    """A parameter's main dtype: ``main_params_dtype`` where wider (or ``always``: a gather of
    changes keeps fp32 parameters' main copies too), else ``None`` (updated in place).

    Example:
        >>> main_dtype_for(torch.bfloat16, torch.float32), main_dtype_for(torch.float32, torch.float32)
        (torch.float32, None)
    """
    if main_params_dtype is None or not param_dtype.is_floating_point:
        return None
    wider = param_dtype.itemsize < main_params_dtype.itemsize
    return main_params_dtype if wider or always else None


def check_remainders(
    store: object, main_params_dtype: torch.dtype | None, dtypes: Iterable[torch.dtype]
) -> bool:
    """``store`` (``store_param_remainders``) if it may be on: bf16 parameters, an fp32 main.

    Example:
        >>> check_remainders(True, torch.float32, [torch.bfloat16, torch.float32])
        True
    """
    if not isinstance(store, bool):
        raise TypeError(f"store_param_remainders must be True or False; got {store!r}")
    if not store:
        return False
    if main_params_dtype != torch.float32:
        raise ValueError(
            "store_param_remainders=True keeps each fp32 main copy as a 16-bit remainder beside "
            f"its bf16 parameter: pass main_params_dtype=torch.float32 (got {main_params_dtype})"
        )
    narrow = {d for d in dtypes if main_dtype_for(d, main_params_dtype) is not None}
    if narrow != {torch.bfloat16}:
        which = ", ".join(sorted(map(str, narrow - {torch.bfloat16}))) or "no"
        raise ValueError(
            "store_param_remainders=True needs bf16 parameters (the fp32 main value is the bf16 "
            f"bits plus a 16-bit remainder); these have {which} main copies: cast them to "
            "torch.bfloat16 or pass store_param_remainders=False"
        )
    return True


def split_main(main: Tensor) -> tuple[Tensor, Tensor]:
    """An fp32 tensor as (bf16 rounded to nearest, ties away from zero; the int16 remainder).

    Example:
        >>> x = torch.tensor([1.0 + 2**-8, 1.0 + 2**-9])  # a tie, then not
        >>> [t.tolist() for t in split_main(x)], torch.equal(join_main(*split_main(x)), x)
        ([[1.0078125, 1.0], [-32768, 16384]], True)
    """
    bits = main.view(torch.int32)
    remainder = (bits & 0xFFFF).to(torch.int16)  # the low 16 bits, read as signed
    high = ((bits >> 16) + (remainder < 0)).to(torch.int16)
    return high.view(torch.bfloat16), remainder


def join_main(param: Tensor, remainder: Tensor) -> Tensor:
    """The fp32 value whose bits are ``param``'s (bf16) shifted up 16 plus ``remainder``.

    Example:
        >>> join_main(torch.ones(1, dtype=torch.bfloat16), torch.ones(1, dtype=torch.int16)).item()
        1.0000001192092896
    """
    bits = (param.view(torch.int16).to(torch.int32) << 16) + remainder.to(torch.int32)
    return bits.view(torch.float32)


def tie_count(param: Tensor, remainder: Tensor) -> Tensor:
    """How many elements of a :func:`split_main` pair differ from torch's rounding (ties to even).

    Example:
        >>> tie_count(*split_main(torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.5]))).item()
        1
    """
    odd = (param.view(torch.int16) & 1) == 1
    return ((remainder == -0x8000) & odd).sum()


def main_value(view: Tensor, state: Mapping[str, Any], dtype: torch.dtype) -> Tensor:
    """A piece's main value: its :data:`MAIN_KEY`, or joined from its remainder, or a copy.

    Example:
        >>> main_value(torch.ones(1, dtype=torch.bfloat16), {}, torch.float32)
        tensor([1.])
    """
    if (main := state.get(MAIN_KEY)) is not None:
        return cast(Tensor, main)
    if (remainder := state.get(REMAINDER_KEY)) is not None:
        return join_main(view.detach(), remainder)
    return view.detach().to(dtype, copy=True)


def with_main(view: Tensor, state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` as it leaves its rank: a remainder replaced by the fp32 main it makes.

    Example:
        >>> remainder = torch.zeros(1, dtype=torch.int16)
        >>> with_main(torch.ones(1, dtype=torch.bfloat16), {REMAINDER_KEY: remainder})
        {'main_param': tensor([1.])}
    """
    out = {k: v for k, v in state.items() if k != REMAINDER_KEY}
    if REMAINDER_KEY in state:
        out[MAIN_KEY] = join_main(view.detach(), state[REMAINDER_KEY])
    return out


def step_through_main_(
    step_pieces: StepPieces,
    group: Mapping[str, Any],
    views: Sequence[Tensor],
    grads: Sequence[Tensor],
    states: Sequence[dict[str, Any]],
    dtypes: Sequence[torch.dtype | None],
    *,
    remainders: bool = False,
    write_back: bool = True,
) -> Tensor | None:
    """``step_pieces(group, params, grads, states)`` over ``views`` in place, each through its main
    copy where ``dtypes`` names one; with ``remainders``, the summed :func:`tie_count`. Without
    ``write_back`` the views keep their values (a gather of the changes writes them).

    Example:
        >>> p, state = torch.ones(1, dtype=torch.bfloat16), {}
        >>> sgd = lambda group, params, grads, states: params[0].sub_(1e-3 * grads[0])
        >>> step_through_main_(sgd, {}, [p], [torch.ones_like(p)], [state], [torch.float32])
        >>> state[MAIN_KEY].item(), p.item()  # bf16 alone would have stayed at 1.0
        (0.9990000128746033, 1.0)
    """
    params: list[Tensor] = []
    upcast: list[Tensor] = []
    inner: list[dict[str, Any]] = []
    written: list[tuple[Tensor, Tensor, dict[str, Any]]] = []
    for view, grad, state, dtype in zip(views, grads, states, dtypes, strict=True):
        if dtype is None:
            params.append(view)
            upcast.append(grad)
            inner.append(state)
            continue
        if remainders:
            check_remainders(True, dtype, [view.dtype])
        main = main_value(view, state, dtype)
        if not remainders:
            state[MAIN_KEY] = main
        params.append(main)
        upcast.append(grad.to(dtype))
        inner.append({k: v for k, v in state.items() if k not in (MAIN_KEY, REMAINDER_KEY)})
        written.append((view, main, state))
    step_pieces(group, params, upcast, inner)
    for state, own in zip(states, inner):
        if own is not state:
            state.update(own)
    ties: Tensor | None = None
    with torch.no_grad():
        for view, main, state in written:
            if not remainders:
                if write_back:
                    view.copy_(main)
                continue
            rounded, state[REMAINDER_KEY] = split_main(main)
            state.pop(MAIN_KEY, None)
            view.copy_(rounded)
            n = tie_count(rounded, state[REMAINDER_KEY])
            ties = n if ties is None else ties + n.to(ties.device)
    return ties
