"""Registry: what the core knows of each torch.optim class (its functional spec, how it updates).

The stateful shell reads a param group, asks :func:`supports_group` whether the core implements
every option with torch's semantics, picks the keys with :func:`group_hyperparams` and calls
the spec's ``init``/``update_`` with them; state crosses to and from torch's format through
``state_to_dicts``/``state_from_dicts``.
"""

from __future__ import annotations

import importlib
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, Union, cast

import torch
from torch import Tensor

from zero_functional.functional._common import to_dicts
from zero_functional.functional.adam import (
    ADAM_DEFAULTS,
    ADAMW_DEFAULTS,
    AdamHyper,
    AdamState,
    adam_apply_,
    adam_update,
    adam_update_,
)
from zero_functional.functional.lowbit import LOW_BIT
from zero_functional.functional.sgd import (
    SGD_DEFAULTS,
    SGDHyper,
    SGDState,
    sgd_apply_,
    sgd_update,
    sgd_update_,
)

__all__ = [
    "GROUP_CLASS_KEY",
    "IGNORED_GROUP_KEYS",
    "OPTIMIZER_KINDS",
    "SUPPORTED",
    "FunctionalSpec",
    "State",
    "UpdateKind",
    "functional_spec",
    "group_hyperparams",
    "optimizer_by_name",
    "optimizer_name",
    "register_optimizer",
    "supports_group",
    "update_block",
    "update_kind",
]

GROUP_CLASS_KEY = "optimizer_class"
"""The param-group key that names the group's own ``torch.optim`` class (a class, or its
:func:`optimizer_name`); groups without it run the optimizer's ``optimizer_class``."""

State = Union[SGDState, AdamState]  # noqa: UP007 - a runtime alias, kept 3.10-friendly

# Keys a param group may carry that do not change the update: torch's bookkeeping, LR/momentum
# schedulers' bookkeeping (they write the keys the update reads, which are read fresh each step).
IGNORED_GROUP_KEYS: tuple[str, ...] = (
    "params",
    "param_names",
    "foreach",
    "initial_lr",
    "max_lr",
    "min_lr",
    "base_momentum",
    "max_momentum",
    "base_lr",
    "optimizer_class",
)
# torch.optim options the core implements only switched off (SGD's fused among them)
_OFF_ONLY = ("differentiable", "capturable", "fused")


@dataclass(frozen=True)
class FunctionalSpec:
    """How one torch.optim class maps onto the functional core: everything the shell asks of
    an optimizer, so that no caller branches on its name.

    Attributes:
        name: ``"sgd"``, ``"adam"`` or ``"adamw"``.
        defaults: the hyperparameter record (:class:`SGDHyper`, :class:`AdamHyper`) holding
            torch's default for each param-group key the update reads (used when a group
            lacks one).
        state_type: the state (:class:`SGDState`, :class:`AdamState`); its ``from_dicts``
            reads torch's per-param dicts.
        update: pure ``update(params, grads, state, **group_hyperparams)``.
        update_: ``update_(params, grads, state, **group_hyperparams)`` in place.
        apply_: ``apply_(params, grads, state, hyper, compile=...)`` in place, ``hyper`` from
            :meth:`record`: ``update_`` without its per-tensor checks of the lists, for a
            caller that built them (the shell).
        fixed: the keys the class fixes whatever a group says (AdamW's decoupled decay); a
            group with another value is not supported.
    """

    name: str
    defaults: SGDHyper | AdamHyper
    state_type: type[SGDState] | type[AdamState]
    update: Callable[..., tuple[list[Tensor], State]]
    update_: Callable[..., None]
    apply_: Callable[..., None]
    fixed: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def hyperparam_keys(self) -> tuple[str, ...]:
        """The param-group keys the update reads, in torch's order."""
        return self.defaults._fields

    def record(self, hyper: Mapping[str, object]) -> SGDHyper | AdamHyper:
        """The hyperparameter record of :func:`group_hyperparams`' keywords, for :attr:`apply_`
        (the spec's defaults for keys ``hyper`` lacks).

        Example:
            >>> import torch
            >>> functional_spec(torch.optim.SGD).record({"lr": 0.5, "momentum": 0.9}).momentum
            0.9
        """
        return self.defaults._replace(**hyper)  # type: ignore[arg-type]

    def init(self, params: Sequence[Tensor], **hyper: object) -> State:
        """Fresh state for ``params``: what torch's empty per-param dicts stand for.

        Example:
            >>> import torch
            >>> functional_spec(torch.optim.AdamW).init([torch.zeros(1)], amsgrad=True).step
            [tensor(0.)]
        """
        return self.state_from_dicts([{} for _ in params], params, **hyper)

    def state_to_dicts(self, state: State) -> list[dict[str, Tensor]]:
        """Per-param state in torch.optim's format; tensors are shared, not copied.

        SGD: ``{"momentum_buffer": buf}`` once a buffer exists, else ``{}`` (torch stores
        nothing for momentum=0 or before the first step). Adam: ``step``, ``exp_avg``,
        ``exp_avg_sq`` and, with amsgrad, ``max_exp_avg_sq``; a never-stepped param gives
        step 0 and zero moments (torch would have no entry; loading them is equivalent).

        Args:
            state: an instance of :attr:`state_type`.

        Returns:
            One dict per param.

        Example:
            >>> import torch
            >>> spec = functional_spec(torch.optim.SGD)
            >>> spec.state_to_dicts(SGDState([None, torch.ones(1)]))
            [{}, {'momentum_buffer': tensor([1.])}]
        """
        if not isinstance(state, self.state_type):
            raise TypeError(f"spec {self.name!r} got an {type(state).__name__}")
        return to_dicts(state)

    def state_from_dicts(
        self, dicts: Sequence[Mapping[str, Tensor]], params: Sequence[Tensor], **hyper: object
    ) -> State:
        """Inverse of :meth:`state_to_dicts`: the :attr:`state_type`'s ``from_dicts``.

        Tensors are used as-is (no copy; Adam's ``step`` is moved to its param's device in
        float32, where the fused kernels read it). An empty dict gives fresh state for that
        param.

        Args:
            dicts: one mapping per param, as ``torch.optim.Optimizer.state[p]``.
            params: the params, in the same order.
            **hyper: the group's hyperparams (``amsgrad`` is read for Adam).

        Returns:
            The ``SGDState`` or ``AdamState``.

        Raises:
            ValueError: lengths differ, or amsgrad is on and a stepped param lacks
                ``max_exp_avg_sq``.

        Example:
            >>> import torch
            >>> spec = functional_spec(torch.optim.Adam)
            >>> p = [torch.zeros(2)]
            >>> s = spec.state_from_dicts([{}], p, amsgrad=False)
            >>> s.step[0], s.exp_avg[0]
            (tensor(0.), tensor([0., 0.]))
        """
        if len(dicts) != len(params):
            raise ValueError(
                f"state_from_dicts: got {len(dicts)} state dicts for {len(params)} params; "
                "pass one (possibly empty) dict per param, in the params' order"
            )
        return self.state_type.from_dicts(dicts, params, self.record(hyper))  # type: ignore[arg-type]


_SPECS: dict[type, FunctionalSpec] = {
    torch.optim.SGD: FunctionalSpec(
        "sgd", SGD_DEFAULTS, SGDState, sgd_update, sgd_update_, sgd_apply_
    ),
    torch.optim.Adam: FunctionalSpec(
        "adam", ADAM_DEFAULTS, AdamState, adam_update, adam_update_, adam_apply_
    ),
    # AdamW is Adam with decoupled_weight_decay=True in every group (torch's AdamW forces it);
    # the update reads decoupled_weight_decay from the group like Adam's does.
    torch.optim.AdamW: FunctionalSpec(
        "adamw",
        ADAMW_DEFAULTS,
        AdamState,
        adam_update,
        adam_update_,
        adam_apply_,
        MappingProxyType({"decoupled_weight_decay": True}),
    ),
}
SUPPORTED: tuple[type, ...] = tuple(_SPECS)


def functional_spec(optimizer_class: type) -> FunctionalSpec | None:
    """The spec for a torch.optim class, or ``None`` when the core does not implement it.

    Exact class match: a subclass may override ``step``, so it is not assumed to be the same.

    Args:
        optimizer_class: e.g. ``torch.optim.Adam``.

    Returns:
        The ``FunctionalSpec`` or ``None``.

    Example:
        >>> import torch
        >>> functional_spec(torch.optim.AdamW).name
        'adamw'
        >>> functional_spec(torch.optim.RMSprop) is None
        True
    """
    return _SPECS.get(optimizer_class)


def group_hyperparams(spec: FunctionalSpec, group: Mapping[str, object]) -> dict[str, object]:
    """Pick the keys the update reads from a torch param group, torch's defaults for missing ones.

    Args:
        spec: from :func:`functional_spec`.
        group: a ``torch.optim.Optimizer.param_groups`` entry.

    Returns:
        Keyword arguments for ``spec.init``/``spec.update_``/``spec.update``.

    Example:
        >>> import torch
        >>> spec = functional_spec(torch.optim.SGD)
        >>> group_hyperparams(spec, {"params": [], "lr": 0.1, "momentum": 0.9})["momentum"]
        0.9
    """
    return {k: group.get(k, d) for k, d in zip(spec.hyperparam_keys, spec.defaults)}


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, Tensor))


def supports_group(spec: FunctionalSpec, group: Mapping[str, object]) -> bool:
    """Whether every option in the group is implemented by the core with torch's semantics.

    False for ``capturable=True``, ``differentiable=True``, ``fused=True`` where the record
    has no ``fused`` (SGD), ``foreach=True`` together with ``fused=True``, a Tensor (or other
    non-number) where the record's default is a number or a tuple of numbers (``lr``,
    ``betas``, ``weight_decay``...), a key :attr:`FunctionalSpec.fixed` holds at another
    value, and keys neither read by the update nor in :data:`IGNORED_GROUP_KEYS`; the shell
    then falls back to a real torch optimizer.

    Args:
        spec: from :func:`functional_spec`.
        group: a ``torch.optim.Optimizer.param_groups`` entry.

    Returns:
        ``True`` when ``spec.update_(..., **group_hyperparams(spec, group))`` is torch's step.

    Example:
        >>> import torch
        >>> spec = functional_spec(torch.optim.Adam)
        >>> supports_group(spec, {"params": [], "lr": 0.1, "foreach": True})
        True
        >>> supports_group(spec, {"params": [], "lr": 0.1, "capturable": True})
        False
    """
    for key, value in group.items():
        known = key in spec.hyperparam_keys or key in IGNORED_GROUP_KEYS
        if not known and (value or key not in _OFF_ONLY):
            return False
    if group.get("fused") and group.get("foreach"):
        return False
    hp = group_hyperparams(spec, group)
    for key, default in zip(spec.hyperparam_keys, spec.defaults):
        value = hp[key]
        if _is_number(default) and not _is_number(value):
            return False
        if isinstance(default, tuple) and not (
            isinstance(value, (tuple, list))
            and len(value) == len(default)
            and all(map(_is_number, value))
        ):
            return False
    return all(hp[k] == v for k, v in spec.fixed.items())


UpdateKind = Literal["elementwise", "per_tensor", "closure"]

OPTIMIZER_KINDS: dict[type, UpdateKind] = {
    **{
        cls: "elementwise"
        for cls in (
            torch.optim.SGD,
            torch.optim.Adam,
            torch.optim.AdamW,
            torch.optim.Adamax,
            torch.optim.NAdam,
            torch.optim.RAdam,
            torch.optim.RMSprop,
            torch.optim.Rprop,
            torch.optim.Adagrad,
            torch.optim.Adadelta,
            torch.optim.ASGD,
        )
    },
    torch.optim.LBFGS: "closure",
    **({torch.optim.Adafactor: "per_tensor"} if hasattr(torch.optim, "Adafactor") else {}),
}
"""How each ``torch.optim`` class updates, which decides where it can run (data; extend it with
:func:`register_optimizer`):

* ``"elementwise"``: each element's update reads only that element's parameter, gradient and
  state, plus per-parameter scalars (the step count): it runs on any piece of a tensor, so under
  ``partition="flat"`` and on the pieces of DDP buckets in overlap mode;
* ``"per_tensor"``: the update reads a whole tensor (Adafactor's row and column factors): it needs
  whole-tensor ownership (``partition="sorted_greedy"``);
* ``"closure"``: ``step`` re-evaluates the model through a closure (LBFGS): whole tensors,
  never inside backward, and at world size 1 only (sharded, each rank would run its own search
  on its own tensors and call the closure a different number of times).

A class not listed counts as ``"per_tensor"``, the safe assumption.

An elementwise class may quantize its state in blocks (:data:`OPTIMIZER_BLOCKS`): each element's
update still reads only its own element, but its state is stored per block of ``block`` elements
counted from the parameter's start (one scale per block), so a piece must start and end on a
block boundary of its parameter, and whether the state is quantized at all is decided on the
whole parameter."""

OPTIMIZER_BLOCKS: dict[type, int] = {}
"""The quantization block of each elementwise class that stores its state in blocks (data; set
by :func:`register_optimizer`'s ``block``); classes not listed have blocks of one element."""

# compat: torchao's low-bit AdamW/Adam (torchao.optim, an optional dependency, so known by name
# and imported only when asked): elementwise per block of 256 elements (8-bit, FP8) or 128 (4-bit)
_KNOWN_BY_NAME: dict[str, tuple[UpdateKind, int]] = {
    f"torchao.optim.adam.{name}{spec.suffix}": ("elementwise", spec.block)
    for name in ("Adam", "AdamW")
    for spec in LOW_BIT.values()
}


def register_optimizer(optimizer_class: type, kind: UpdateKind, *, block: int = 1) -> None:
    """Declare how ``optimizer_class`` updates (see :data:`OPTIMIZER_KINDS`) and, for an
    elementwise class that quantizes its state in blocks, the block's element count.

    Example:
        >>> class MySGD(torch.optim.SGD):
        ...     pass
        >>> update_kind(MySGD)
        'per_tensor'
        >>> register_optimizer(MySGD, "elementwise", block=64)
        >>> update_kind(MySGD), update_block(MySGD)
        ('elementwise', 64)
    """
    if not (
        isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
    ):
        raise TypeError(
            f"register_optimizer takes a torch.optim.Optimizer subclass, got {optimizer_class!r}"
        )
    if kind not in ("elementwise", "per_tensor", "closure"):
        raise ValueError(f"kind must be 'elementwise', 'per_tensor' or 'closure', got {kind!r}")
    if not (isinstance(block, int) and block >= 1) or (block > 1 and kind != "elementwise"):
        raise ValueError(
            f"block must be an int >= 1, and > 1 only for an elementwise class; got {block!r} "
            f"for kind {kind!r}"
        )
    OPTIMIZER_KINDS[optimizer_class] = kind
    OPTIMIZER_BLOCKS.pop(optimizer_class, None)
    if block > 1:
        OPTIMIZER_BLOCKS[optimizer_class] = block


def _known(optimizer_class: type) -> tuple[UpdateKind, int] | None:
    """A class this module knows by name (torchao's), where it was not registered."""
    if not isinstance(optimizer_class, type):
        return None
    return _KNOWN_BY_NAME.get(f"{optimizer_class.__module__}.{optimizer_class.__qualname__}")


def update_kind(optimizer_class: type) -> UpdateKind:
    """How ``optimizer_class`` updates: its registered kind, ``"per_tensor"`` if unregistered.

    Exact class match, as :func:`functional_spec`: a subclass may override ``step``.

    Example:
        >>> update_kind(torch.optim.RMSprop), update_kind(torch.optim.LBFGS)
        ('elementwise', 'closure')
    """
    if optimizer_class in OPTIMIZER_KINDS:
        return OPTIMIZER_KINDS[optimizer_class]
    known = _known(optimizer_class)
    return known[0] if known else "per_tensor"


def update_block(optimizer_class: type, defaults: Mapping[str, object] | None = None) -> int:
    """The element count of ``optimizer_class``'s quantization block (1: none), counted from
    each parameter's start: a piece of a parameter starts and ends on one. A ``block_size``
    among the constructor's keyword ``defaults`` (torchao's) overrides the class's.

    Example:
        >>> update_block(torch.optim.AdamW)
        1
        >>> class Blocky(torch.optim.SGD):
        ...     pass
        >>> register_optimizer(Blocky, "elementwise", block=256)
        >>> update_block(Blocky), update_block(Blocky, {"block_size": 512})
        (256, 512)
    """
    if optimizer_class in OPTIMIZER_KINDS:
        block = OPTIMIZER_BLOCKS.get(optimizer_class, 1)
    else:
        known = _known(optimizer_class)
        block = known[1] if known else 1
    if block > 1 and defaults is not None and "block_size" in defaults:
        return int(cast(int, defaults["block_size"]))
    return block


def optimizer_name(optimizer_class: type) -> str:
    """The class as a string a state dict records (``torch.load(weights_only=True)`` reads it):
    its module and qualified name, ``torch.optim.X`` for torch's classes.

    Example:
        >>> optimizer_name(torch.optim.AdamW)
        'torch.optim.AdamW'
    """
    module = optimizer_class.__module__
    if module.startswith("torch.optim") and getattr(
        torch.optim, optimizer_class.__name__, None
    ) is (optimizer_class):
        module = "torch.optim"
    return f"{module}.{optimizer_class.__qualname__}"


def optimizer_by_name(name: str) -> type | None:
    """The class :func:`optimizer_name` gives ``name``, among ``torch.optim``'s classes and
    those given to :func:`register_optimizer`; ``None`` if none.

    Example:
        >>> optimizer_by_name("torch.optim.SGD") is torch.optim.SGD
        True
        >>> optimizer_by_name("torch.optim.Nothing") is None
        True
    """
    torch_classes = (
        c
        for c in vars(torch.optim).values()
        if isinstance(c, type) and issubclass(c, torch.optim.Optimizer)
    )
    for cls in (*OPTIMIZER_KINDS, *torch_classes):
        if optimizer_name(cls) == name:
            return cls
    if name in _KNOWN_BY_NAME:  # torchao's, imported only now (an optional dependency)
        module, _, qualname = name.rpartition(".")
        found = getattr(importlib.import_module(module), qualname, None)
        return found if isinstance(found, type) else None
    return None
