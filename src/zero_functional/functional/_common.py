"""What the functional optimizers share: list checks, (device, dtype) groups, pure from in-place."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Concatenate, ParamSpec, TypeVar, cast

import torch
from torch import Tensor

if TYPE_CHECKING:  # annotations only: adam.py and sgd.py import this module
    from zero_functional.functional.adam import AdamState
    from zero_functional.functional.sgd import SGDState

P = ParamSpec("P")
S = TypeVar("S", bound=tuple[Sequence[Tensor | None], ...])  # a NamedTuple state of tensor lists


def check_lists(
    fn: str,
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    states: Mapping[str, Sequence[Tensor | None]],
) -> None:
    """A ValueError or TypeError naming the fix where the lists do not line up with ``params``."""
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
    """Indices of ``params`` by (device, dtype), in first-seen order: a foreach call each.

    Example:
        >>> ts = [torch.zeros(1), torch.zeros(1, dtype=torch.float64), torch.zeros(2)]
        >>> list(group_indices(ts).values())
        [[0, 2], [1]]
    """
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, p in enumerate(params):
        groups.setdefault((p.device, p.dtype), []).append(i)
    return groups


def to_dicts(state: SGDState | AdamState) -> list[dict[str, Tensor]]:
    """Per param, its state as torch.optim keeps it (tensors shared; no empty lists or ``None``).

    Example:
        >>> from zero_functional.functional import SGDState
        >>> to_dicts(SGDState([None, torch.ones(1)]))
        [{}, {'momentum_buffer': tensor([1.])}]
    """
    lists: tuple[Sequence[Tensor | None], ...] = state
    return [
        {k: t for k, ts in zip(state._fields, lists) if ts and (t := ts[i]) is not None}
        for i in range(len(lists[0]))
    ]


def bias_corrections(
    lr: float, betas: tuple[float, float], steps: Sequence[float]
) -> tuple[list[float], list[float]]:
    """Adam's scalars ``-lr / (1 - beta1**t)`` and ``sqrt(1 - beta2**t)`` for step counts
    ``steps``, in Python floats as torch's ``_multi_tensor_adam`` computes them.

    Example:
        >>> bias_corrections(0.1, (0.5, 0.75), [1.0, 2.0])
        ([-0.2, -0.13333333333333333], [0.5, 0.6614378277661477])
    """
    beta1, beta2 = betas
    step_size = [(lr / (1 - beta1**t)) * -1 for t in steps]
    bias_correction2_sqrt = [(1 - beta2**t) ** 0.5 for t in steps]
    return step_size, bias_correction2_sqrt


def check_real_number(fn: str, name: str, value: object) -> None:
    """Reject tensors and non-numbers where the update needs a Python number."""
    if isinstance(value, Tensor):
        raise TypeError(
            f"{fn}: {name} is a Tensor; zero_functional takes {name} as a Python float "
            f"(pass float({name}) or use the torch.optim optimizer with capturable=True)"
        )
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{fn}: {name} must be a float, got {type(value).__name__}")


def reject_tensor(name: str, value: object) -> None:
    """A factory's check: hyperparameters are Python numbers here, not Tensors."""
    if isinstance(value, Tensor):
        raise ValueError(
            f"{name} as a Tensor is not supported by zero_functional; pass a Python float "
            "(or use the torch.optim optimizer with capturable=True)"
        )


def pure_from_inplace(
    update_: Callable[Concatenate[Sequence[Tensor], Sequence[Tensor], S, P], None],
) -> Callable[Concatenate[Sequence[Tensor], Sequence[Tensor], S, P], tuple[list[Tensor], S]]:
    """The pure twin of an in-place update: ``update_`` on copies of the params and state,
    returning ``(new_params, new_state)``; no output shares storage with an input.

    Example:
        >>> from zero_functional.functional import sgd_init, sgd_update_
        >>> p = [torch.tensor([1.0])]
        >>> pure_from_inplace(sgd_update_)(p, [torch.tensor([2.0])], sgd_init(p), lr=0.5)[0], p
        ([tensor([0.])], [tensor([1.])])
    """

    def update(
        params: Sequence[Tensor], grads: Sequence[Tensor], state: S, *args: P.args, **kw: P.kwargs
    ) -> tuple[list[Tensor], S]:
        # a non-tensor goes through as is, for update_ to reject with its message
        with torch.no_grad():
            new_params = [p.detach().clone() if isinstance(p, Tensor) else p for p in params]
            new_state = cast(Callable[..., S], type(state))(
                *([t.detach().clone() if isinstance(t, Tensor) else t for t in ts] for ts in state)
            )
        update_(new_params, grads, new_state, *args, **kw)
        return new_params, new_state

    name = update_.__name__.removesuffix("_")
    update.__module__, update.__name__, update.__qualname__ = update_.__module__, name, name
    update.__doc__ = (
        f"Pure :func:`{update_.__name__}`: return ``(new_params, new_state)``, leaving every "
        f"argument untouched.\n\nSame arguments as :func:`{update_.__name__}`; bitwise equal to "
        "it on copies, and no output tensor shares storage with an input tensor."
    )
    signature = inspect.signature(update_)  # for help() and IDEs: update_'s keywords
    vars(update)["__signature__"] = signature.replace(
        return_annotation=f"tuple[list[Tensor], {signature.parameters['state'].annotation}]"
    )
    # params, grads and state stay nameable (as before), which Concatenate cannot express
    return update  # type: ignore[return-value]
