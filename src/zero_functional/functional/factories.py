"""Optimizer factories: torch.optim's keywords, validated by the record, bound to the updates."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import cast

import torch
from torch import Tensor

from zero_functional.functional.adam import ADAM_DEFAULTS, ADAMW_KEYWORDS, AdamHyper
from zero_functional.functional.registry import FunctionalSpec, State, functional_spec
from zero_functional.functional.sgd import SGD_DEFAULTS, SGDHyper

__all__ = ["FunctionalOptimizer", "State", "adam", "adamw", "sgd"]


@dataclass(frozen=True)
class FunctionalOptimizer:
    """An optimizer as pure functions with its hyperparameters bound.

    Attributes:
        name: ``"sgd"``, ``"adam"`` or ``"adamw"`` (its spec's name).
        hyperparams: the validated record's fields (read-only mapping), torch.optim's names.
        init: ``init(params) -> state``.
        update: pure ``update(params, grads, state) -> (new_params, new_state)``.
        update_: in-place ``update_(params, grads, state) -> None``.
    """

    name: str
    hyperparams: Mapping[str, object]
    init: Callable[[Sequence[Tensor]], State]
    update: Callable[[Sequence[Tensor], Sequence[Tensor], State], tuple[list[Tensor], State]]
    update_: Callable[[Sequence[Tensor], Sequence[Tensor], State], None]


def _reject_unknown(
    factory: Callable[..., FunctionalOptimizer], name: str, unknown: Mapping[str, object]
) -> None:
    if unknown:
        accepted = [
            k for k, p in inspect.signature(factory).parameters.items() if p.kind is p.KEYWORD_ONLY
        ]
        raise TypeError(
            f"{name}() got unknown keyword(s) {sorted(unknown)}; accepted keywords: "
            f"{', '.join(accepted)}"
        )


def _spec(optimizer_class: type) -> FunctionalSpec:
    return cast(FunctionalSpec, functional_spec(optimizer_class))  # registered: SGD, Adam(W)


def _bind(spec: FunctionalSpec, hyper: SGDHyper | AdamHyper) -> FunctionalOptimizer:
    """The optimizer whose functions are ``spec``'s with ``hyper``'s fields bound as keywords."""
    kw = hyper._asdict()

    def checked(fn: str, state: State) -> State:
        if not isinstance(state, spec.state_type):
            raise TypeError(
                f"{spec.name}.{fn}: expected an {spec.state_type.__name__}, "
                f"got {type(state).__name__}"
            )
        return state

    return FunctionalOptimizer(
        spec.name,
        MappingProxyType(kw),
        functools.partial(spec.init, **kw),
        lambda params, grads, state: spec.update(params, grads, checked("update", state), **kw),
        lambda params, grads, state: spec.update_(params, grads, checked("update_", state), **kw),
    )


def sgd(
    *,
    lr: float = SGD_DEFAULTS.lr,
    momentum: float = SGD_DEFAULTS.momentum,
    dampening: float = SGD_DEFAULTS.dampening,
    weight_decay: float = SGD_DEFAULTS.weight_decay,
    nesterov: bool = SGD_DEFAULTS.nesterov,
    maximize: bool = SGD_DEFAULTS.maximize,
    foreach: bool | None = None,
    differentiable: bool = False,
    fused: bool | None = None,
    **unknown: object,
) -> FunctionalOptimizer:
    """SGD with torch.optim.SGD's keywords, defaults and validation messages.

    Args:
        lr ... maximize: the :class:`SGDHyper` fields, by name.
        foreach: accepted and ignored (foreach kernels are always used).
        differentiable: only False is supported.
        fused: only None/False (fused SGD is not implemented here).
        **unknown: rejected.

    Returns:
        The bound ``FunctionalOptimizer``.

    Raises:
        ValueError: invalid values, with torch's messages.
        TypeError: unknown keywords.

    Example:
        >>> import torch
        >>> opt = sgd(lr=0.1, momentum=0.9)
        >>> p = [torch.tensor([1.0])]
        >>> s = opt.init(p)
        >>> opt.update_(p, [torch.tensor([1.0])], s)
        >>> p[0]
        tensor([0.9000])
        >>> sgd(lr=-1.0)
        Traceback (most recent call last):
        ...
        ValueError: Invalid learning rate: -1.0
    """
    _reject_unknown(sgd, "sgd", unknown)
    hyper = SGDHyper._make(map(locals().__getitem__, SGDHyper._fields)).validated()
    if differentiable:
        raise ValueError("differentiable=True is not supported by zero_functional's sgd")
    if fused:
        raise ValueError(
            "fused=True is not implemented by zero_functional's sgd; pass fused=None "
            "(foreach kernels) or use torch.optim.SGD(fused=True)"
        )
    return _bind(_spec(torch.optim.SGD), hyper)


def adam(
    *,
    lr: float = ADAM_DEFAULTS.lr,
    betas: tuple[float, float] = ADAM_DEFAULTS.betas,
    eps: float = ADAM_DEFAULTS.eps,
    weight_decay: float = ADAM_DEFAULTS.weight_decay,
    amsgrad: bool = ADAM_DEFAULTS.amsgrad,
    maximize: bool = ADAM_DEFAULTS.maximize,
    foreach: bool | None = None,
    capturable: bool = False,
    differentiable: bool = False,
    fused: bool | None = ADAM_DEFAULTS.fused,
    decoupled_weight_decay: bool = ADAM_DEFAULTS.decoupled_weight_decay,
    **unknown: object,
) -> FunctionalOptimizer:
    """Adam (AdamW with ``decoupled_weight_decay``) with torch.optim.Adam's keywords, defaults
    and validation messages.

    Args:
        lr ... decoupled_weight_decay: the :class:`AdamHyper` fields, by name.
        foreach: accepted and ignored.
        capturable: only False is supported.
        differentiable: only False is supported.
        **unknown: rejected.

    Returns:
        The bound ``FunctionalOptimizer``, named ``"adamw"`` with decoupled decay.

    Raises:
        ValueError: invalid values, with torch's messages.
        TypeError: unknown keywords.

    Example:
        >>> import torch
        >>> opt = adam(lr=0.1)
        >>> p = [torch.tensor([1.0])]
        >>> new_p, new_s = opt.update(p, [torch.tensor([1.0])], opt.init(p))
        >>> new_p[0]
        tensor([0.9000])
        >>> adam(betas=(1.0, 0.999))
        Traceback (most recent call last):
        ...
        ValueError: Invalid beta parameter at index 0: 1.0
        >>> opt = adamw(lr=0.1)  # adam with torch.optim.AdamW's defaults
        >>> opt.name, opt.hyperparams["weight_decay"], opt.hyperparams["decoupled_weight_decay"]
        ('adamw', 0.01, True)
    """
    spec = _spec(torch.optim.AdamW if decoupled_weight_decay else torch.optim.Adam)
    _reject_unknown(adam, spec.name, unknown)
    hyper = AdamHyper._make(map(locals().__getitem__, AdamHyper._fields)).validated()
    for option, value in (("capturable", capturable), ("differentiable", differentiable)):
        if value:
            raise ValueError(
                f"{option}=True is not supported by zero_functional's {spec.name}; "
                "use the torch.optim optimizer"
            )
    if fused and foreach:
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
    return _bind(spec, hyper)


adamw = functools.partial(adam, **ADAMW_KEYWORDS)
adamw.__doc__ = ":func:`adam` with torch.optim.AdamW's defaults (decoupled decay of 1e-2)."
