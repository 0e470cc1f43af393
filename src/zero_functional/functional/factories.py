"""Optimizer factories: torch.optim's keywords, validated, bound into a ``FunctionalOptimizer``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Union

from torch import Tensor

from zero_functional.functional._common import reject_tensor
from zero_functional.functional.adam import AdamState, adam_init, adam_update, adam_update_
from zero_functional.functional.sgd import SGDState, sgd_init, sgd_update, sgd_update_

__all__ = ["FunctionalOptimizer", "State", "adam", "adamw", "sgd"]

State = Union[SGDState, AdamState]  # noqa: UP007 - a runtime alias, kept 3.10-friendly


@dataclass(frozen=True)
class FunctionalOptimizer:
    """An optimizer as pure functions with its hyperparameters bound.

    Attributes:
        name: ``"sgd"``, ``"adam"`` or ``"adamw"``.
        hyperparams: the validated keywords (read-only mapping), torch.optim's names.
        init: ``init(params) -> state``.
        update: pure ``update(params, grads, state) -> (new_params, new_state)``.
        update_: in-place ``update_(params, grads, state) -> None``.
    """

    name: str
    hyperparams: Mapping[str, object]
    init: Callable[[Sequence[Tensor]], State]
    update: Callable[[Sequence[Tensor], Sequence[Tensor], State], tuple[list[Tensor], State]]
    update_: Callable[[Sequence[Tensor], Sequence[Tensor], State], None]

    def __post_init__(self) -> None:
        if self.name not in ("sgd", "adam", "adamw"):
            raise ValueError(f"unknown optimizer name {self.name!r}; expected sgd, adam or adamw")


def _reject_unknown(factory: str, unknown: Mapping[str, object], accepted: Sequence[str]) -> None:
    if unknown:
        raise TypeError(
            f"{factory}() got unknown keyword(s) {sorted(unknown)}; accepted keywords: "
            f"{', '.join(accepted)}"
        )


def _sgd_state(fn: str, state: State) -> SGDState:
    if not isinstance(state, SGDState):
        raise TypeError(f"{fn}: expected an SGDState, got {type(state).__name__}")
    return state


def _adam_state(fn: str, state: State) -> AdamState:
    if not isinstance(state, AdamState):
        raise TypeError(f"{fn}: expected an AdamState, got {type(state).__name__}")
    return state


_SGD_KEYS = (
    "lr",
    "momentum",
    "dampening",
    "weight_decay",
    "nesterov",
    "maximize",
    "foreach",
    "differentiable",
    "fused",
)


def sgd(
    *,
    lr: float = 1e-3,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    maximize: bool = False,
    foreach: bool | None = None,
    differentiable: bool = False,
    fused: bool | None = None,
    **unknown: object,
) -> FunctionalOptimizer:
    """SGD with torch.optim.SGD's keywords, defaults and validation messages.

    Args:
        lr: learning rate.
        momentum: momentum factor.
        dampening: dampening for momentum.
        weight_decay: L2 penalty.
        nesterov: Nesterov momentum (needs momentum > 0 and zero dampening).
        maximize: maximize the objective.
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
    _reject_unknown("sgd", unknown, _SGD_KEYS)
    reject_tensor("lr", lr)
    reject_tensor("weight_decay", weight_decay)
    if lr < 0.0:
        raise ValueError(f"Invalid learning rate: {lr}")
    if momentum < 0.0:
        raise ValueError(f"Invalid momentum value: {momentum}")
    if weight_decay < 0.0:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")
    if differentiable:
        raise ValueError("differentiable=True is not supported by zero_functional's sgd")
    if fused:
        raise ValueError(
            "fused=True is not implemented by zero_functional's sgd; pass fused=None "
            "(foreach kernels) or use torch.optim.SGD(fused=True)"
        )
    hp: dict[str, object] = {
        "lr": lr,
        "momentum": momentum,
        "dampening": dampening,
        "weight_decay": weight_decay,
        "nesterov": nesterov,
        "maximize": maximize,
    }

    def init(params: Sequence[Tensor]) -> State:
        return sgd_init(params, momentum=momentum)

    def update(
        params: Sequence[Tensor], grads: Sequence[Tensor], state: State
    ) -> tuple[list[Tensor], State]:
        return sgd_update(
            params,
            grads,
            _sgd_state("sgd.update", state),
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
        )

    def update_(params: Sequence[Tensor], grads: Sequence[Tensor], state: State) -> None:
        sgd_update_(
            params,
            grads,
            _sgd_state("sgd.update_", state),
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
        )

    return FunctionalOptimizer("sgd", MappingProxyType(hp), init, update, update_)


_ADAM_KEYS = (
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "amsgrad",
    "maximize",
    "foreach",
    "capturable",
    "differentiable",
    "fused",
    "decoupled_weight_decay",
)


def _adam_factory(
    name: str,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
    foreach: bool | None,
    capturable: bool,
    differentiable: bool,
    fused: bool | None,
    decoupled_weight_decay: bool,
) -> FunctionalOptimizer:
    reject_tensor("lr", lr)
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    beta1, beta2 = betas
    reject_tensor("betas[0]", beta1)
    reject_tensor("betas[1]", beta2)
    if not 0.0 <= beta1 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {beta1}")
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {beta2}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if capturable:
        raise ValueError(
            f"capturable=True is not supported by zero_functional's {name}; "
            "use the torch.optim optimizer"
        )
    if differentiable:
        raise ValueError(
            f"differentiable=True is not supported by zero_functional's {name}; "
            "use the torch.optim optimizer"
        )
    if fused and foreach:
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
    hp: dict[str, object] = {
        "lr": lr,
        "betas": (beta1, beta2),
        "eps": eps,
        "weight_decay": weight_decay,
        "amsgrad": amsgrad,
        "maximize": maximize,
        "decoupled_weight_decay": decoupled_weight_decay,
        "fused": fused,
    }

    def init(params: Sequence[Tensor]) -> State:
        return adam_init(params, amsgrad=amsgrad)

    def update(
        params: Sequence[Tensor], grads: Sequence[Tensor], state: State
    ) -> tuple[list[Tensor], State]:
        return adam_update(
            params,
            grads,
            _adam_state(f"{name}.update", state),
            lr=lr,
            betas=(beta1, beta2),
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            decoupled_weight_decay=decoupled_weight_decay,
            fused=fused,
        )

    def update_(params: Sequence[Tensor], grads: Sequence[Tensor], state: State) -> None:
        adam_update_(
            params,
            grads,
            _adam_state(f"{name}.update_", state),
            lr=lr,
            betas=(beta1, beta2),
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            decoupled_weight_decay=decoupled_weight_decay,
            fused=fused,
        )

    return FunctionalOptimizer(name, MappingProxyType(hp), init, update, update_)


def adam(
    *,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    maximize: bool = False,
    foreach: bool | None = None,
    capturable: bool = False,
    differentiable: bool = False,
    fused: bool | None = None,
    decoupled_weight_decay: bool = False,
    **unknown: object,
) -> FunctionalOptimizer:
    """Adam with torch.optim.Adam's keywords, defaults and validation messages.

    Args:
        lr: learning rate.
        betas: running-average coefficients.
        eps: added to the denominator.
        weight_decay: L2 penalty (decoupled when ``decoupled_weight_decay``).
        amsgrad: AMSGrad variant.
        maximize: maximize the objective.
        foreach: accepted and ignored.
        capturable: only False is supported.
        differentiable: only False is supported.
        fused: kernel choice, see :func:`adam_update_`.
        decoupled_weight_decay: behave as AdamW.
        **unknown: rejected.

    Returns:
        The bound ``FunctionalOptimizer``.

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
    """
    _reject_unknown("adam", unknown, _ADAM_KEYS)
    return _adam_factory(
        "adamw" if decoupled_weight_decay else "adam",
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        amsgrad=amsgrad,
        maximize=maximize,
        foreach=foreach,
        capturable=capturable,
        differentiable=differentiable,
        fused=fused,
        decoupled_weight_decay=decoupled_weight_decay,
    )


def adamw(
    *,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    maximize: bool = False,
    foreach: bool | None = None,
    capturable: bool = False,
    differentiable: bool = False,
    fused: bool | None = None,
    **unknown: object,
) -> FunctionalOptimizer:
    """AdamW with torch.optim.AdamW's keywords and defaults (``weight_decay=1e-2``).

    Args:
        lr: learning rate.
        betas: running-average coefficients.
        eps: added to the denominator.
        weight_decay: decoupled decay coefficient.
        amsgrad: AMSGrad variant.
        maximize: maximize the objective.
        foreach: accepted and ignored.
        capturable: only False is supported.
        differentiable: only False is supported.
        fused: kernel choice, see :func:`adam_update_`.
        **unknown: rejected.

    Returns:
        The bound ``FunctionalOptimizer``.

    Raises:
        ValueError: invalid values, with torch's messages.
        TypeError: unknown keywords.

    Example:
        >>> opt = adamw(lr=0.1)
        >>> opt.name, opt.hyperparams["weight_decay"], opt.hyperparams["decoupled_weight_decay"]
        ('adamw', 0.01, True)
    """
    _reject_unknown("adamw", unknown, [k for k in _ADAM_KEYS if k != "decoupled_weight_decay"])
    return _adam_factory(
        "adamw",
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        amsgrad=amsgrad,
        maximize=maximize,
        foreach=foreach,
        capturable=capturable,
        differentiable=differentiable,
        fused=fused,
        decoupled_weight_decay=True,
    )
