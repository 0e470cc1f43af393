"""Optimizer factories: torch.optim's keywords, validated by the record, bound to the updates
(optax's ``init``/``update`` pair)."""

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


@dataclass(frozen=True)
class FunctionalOptimizer:
    """An optimizer as functions with its validated ``hyperparams`` bound (optax's pair):
    ``init(params) -> state``, pure ``update(params, grads, state) -> (params, state)`` and its
    in-place twin ``update_``."""

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
    """``spec``'s functions with ``hyper``'s fields bound as keywords."""
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
    """SGD with torch.optim.SGD's keywords, defaults and messages (``foreach`` ignored,
    ``differentiable`` and ``fused`` refused).

    Example:
        >>> opt, p = sgd(lr=0.1, momentum=0.9), [torch.tensor([1.0])]
        >>> opt.update(p, [torch.tensor([1.0])], opt.init(p))[0]
        [tensor([0.9000])]
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
    """Adam with torch.optim.Adam's keywords, defaults and messages (``foreach`` ignored,
    ``capturable`` and ``differentiable`` refused); ``"adamw"`` with decoupled decay.

    Example:
        >>> adamw(lr=0.1).hyperparams["weight_decay"]  # adam with torch.optim.AdamW's defaults
        0.01
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
