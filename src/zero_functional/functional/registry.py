"""What the core knows of each torch.optim class: its functional spec, how it updates (data)."""

from __future__ import annotations

import importlib
import logging
import numbers
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType, ModuleType
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

GROUP_CLASS_KEY = "optimizer_class"  # a group's own class (or its optimizer_name)

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
    """How one torch.optim class maps onto the functional core (no caller branches on its name):
    its record of ``defaults``, state type, pure ``update``, checked ``update_``, worker
    ``apply_(params, grads, state, record, compile=...)``, keys ``fixed`` whatever a group says."""

    name: str
    defaults: SGDHyper | AdamHyper
    state_type: type[SGDState] | type[AdamState]
    update: Callable[..., tuple[list[Tensor], State]]
    update_: Callable[..., None]
    apply_: Callable[..., None]
    fixed: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))

    def record(self, hyper: Mapping[str, object]) -> SGDHyper | AdamHyper:
        """The record of :func:`group_hyperparams`' keywords (defaults for those it lacks).

        Example:
            >>> functional_spec(torch.optim.SGD).record({"lr": 0.5, "momentum": 0.9}).momentum
            0.9
        """
        return self.defaults._replace(**hyper)  # type: ignore[arg-type]

    def init(self, params: Sequence[Tensor], **hyper: object) -> State:
        """Fresh state for ``params``: what torch's empty per-param dicts stand for."""
        return self.state_from_dicts([{} for _ in params], params, **hyper)

    def state_to_dicts(self, state: State) -> list[dict[str, Tensor]]:
        """Per param, its state as torch.optim keeps it (tensors shared).

        Example:
            >>> functional_spec(torch.optim.SGD).state_to_dicts(SGDState([None, torch.ones(1)]))
            [{}, {'momentum_buffer': tensor([1.])}]
        """
        if not isinstance(state, self.state_type):
            raise TypeError(f"spec {self.name!r} got an {type(state).__name__}")
        return to_dicts(state)

    def state_from_dicts(
        self, dicts: Sequence[Mapping[str, Tensor]], params: Sequence[Tensor], **hyper: object
    ) -> State:
        """Inverse of :meth:`state_to_dicts`, for ``params`` and the group's ``hyper``."""
        if len(dicts) != len(params):
            raise ValueError(
                f"state_from_dicts: got {len(dicts)} state dicts for {len(params)} params; "
                "pass one (possibly empty) dict per param, in the params' order"
            )
        return self.state_type.from_dicts(dicts, params, self.record(hyper))  # type: ignore[arg-type]


_SGD = FunctionalSpec("sgd", SGD_DEFAULTS, SGDState, sgd_update, sgd_update_, sgd_apply_)
_ADAM = FunctionalSpec("adam", ADAM_DEFAULTS, AdamState, adam_update, adam_update_, adam_apply_)
# AdamW is Adam with decoupled_weight_decay=True in every group (torch's AdamW forces it);
# the update reads decoupled_weight_decay from the group like Adam's does.
_ADAMW = replace(
    _ADAM,
    name="adamw",
    defaults=ADAMW_DEFAULTS,
    fixed=MappingProxyType({"decoupled_weight_decay": True}),
)
_SPECS: dict[type, FunctionalSpec] = {
    torch.optim.SGD: _SGD,
    torch.optim.Adam: _ADAM,
    torch.optim.AdamW: _ADAMW,
}
SUPPORTED: tuple[type, ...] = tuple(_SPECS)


def functional_spec(optimizer_class: type) -> FunctionalSpec | None:
    """The spec of exactly this torch.optim class (a subclass may override ``step``), or ``None``.

    Example:
        >>> functional_spec(torch.optim.AdamW).name, functional_spec(torch.optim.RMSprop)
        ('adamw', None)
    """
    return _SPECS.get(optimizer_class)


def group_hyperparams(spec: FunctionalSpec, group: Mapping[str, object]) -> dict[str, object]:
    """The keys the update reads from a torch param group (torch's defaults for missing ones).

    Example:
        >>> group_hyperparams(functional_spec(torch.optim.SGD), {"lr": 0.1})["momentum"]
        0
    """
    return {k: group.get(k, d) for k, d in spec.defaults._asdict().items()}


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, Tensor))


def supports_group(spec: FunctionalSpec, group: Mapping[str, object]) -> bool:
    """Whether the spec's update is torch's step for every option of ``group`` (else the shell
    runs the torch class): no option it lacks, no Tensor for a number, no ``fixed`` key changed.

    Example:
        >>> supports_group(functional_spec(torch.optim.Adam), {"capturable": True})
        False
    """
    for key, value in group.items():
        known = key in spec.defaults._fields or key in IGNORED_GROUP_KEYS
        if not known and (value or key not in _OFF_ONLY):
            return False
    if group.get("fused") and group.get("foreach"):
        return False
    hp = group_hyperparams(spec, group)
    for key, default in spec.defaults._asdict().items():
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
"""How each ``torch.optim`` class updates, which decides where it can run (extend it with
:func:`register_optimizer`; unlisted: ``"per_tensor"``): ``"elementwise"`` on any piece of a
tensor (``"flat"``, overlap mode's buckets), ``"per_tensor"`` (Adafactor) on whole tensors,
``"closure"`` (LBFGS) on whole tensors, outside backward, at world size 1."""

OPTIMIZER_BLOCKS: dict[type, int] = {}
"""An elementwise class's quantization block, where its state is stored per block of elements
counted from a parameter's start: a piece starts and ends on one (unlisted: 1)."""

# compat: torchao's low-bit AdamW/Adam (torchao.optim, an optional dependency, so known by name
# and imported only when asked): elementwise per block of 256 elements (8-bit, FP8) or 128 (4-bit)
_KNOWN_BY_NAME: dict[str, tuple[UpdateKind, int]] = {
    f"torchao.optim.adam.{name}{spec.suffix}": ("elementwise", spec.block)
    for name in ("Adam", "AdamW")
    for spec in LOW_BIT.values()
}


_TORCHAO_NOISE = (
    ("torchao", "Failed to load "),  # its CUDA kernels (_C_mxfp8.so), absent on this machine
    ("torch.utils._pytree", "%s is an Enum subclass"),  # torch deprecating how it registers Enums
)
"""What importing torchao logs that its user cannot act on: (logger, start of the message)."""


def _not_torchao_noise(record: logging.LogRecord) -> bool:
    return not any(record.name == n and str(record.msg).startswith(m) for n, m in _TORCHAO_NOISE)


def import_torchao(module: str) -> ModuleType:
    """torchao's ``module``, imported without the noise torchao prints that its user cannot act on:
    the log lines of :data:`_TORCHAO_NOISE` during the import, and at its first compiled step
    torch's warning that its quantized state classes have no stable hash for the AOT cache.

    Other messages of these loggers, and the user's own torchao warnings after it, still print.

    Example:
        >>> import_torchao("torchao.optim").AdamW8bit.__name__
        'AdamW8bit'
    """
    warnings.filterwarnings(  # persists: the warning comes at the first compiled step
        "ignore",
        message=r"OptimState\w+ does not implement _stable_hash_for_caching",
        category=UserWarning,
    )
    loggers = [logging.getLogger(name) for name, _ in _TORCHAO_NOISE]
    for logger in loggers:
        logger.addFilter(_not_torchao_noise)
    try:
        return importlib.import_module(module)
    finally:
        for logger in loggers:
            logger.removeFilter(_not_torchao_noise)


def register_optimizer(optimizer_class: type, kind: UpdateKind, *, block: int = 1) -> None:
    """Declare how ``optimizer_class`` updates (:data:`OPTIMIZER_KINDS`) and its ``block``.

    Example:
        >>> class MySGD(torch.optim.SGD):
        ...     pass
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


def _kind_and_block(optimizer_class: type) -> tuple[UpdateKind, int]:
    if optimizer_class in OPTIMIZER_KINDS:
        return OPTIMIZER_KINDS[optimizer_class], OPTIMIZER_BLOCKS.get(optimizer_class, 1)
    if not isinstance(optimizer_class, type):
        return "per_tensor", 1
    name = f"{optimizer_class.__module__}.{optimizer_class.__qualname__}"
    return _KNOWN_BY_NAME.get(name, ("per_tensor", 1))


def update_kind(optimizer_class: type) -> UpdateKind:
    """How exactly this class updates: its kind, else ``"per_tensor"``.

    Example:
        >>> update_kind(torch.optim.RMSprop), update_kind(torch.optim.LBFGS)
        ('elementwise', 'closure')
    """
    return _kind_and_block(optimizer_class)[0]


def update_block(optimizer_class: type, defaults: Mapping[str, object] | None = None) -> int:
    """The class's quantization block (1: none); a ``block_size`` in ``defaults`` overrides it.

    Example:
        >>> update_block(torch.optim.AdamW)
        1
    """
    block = _kind_and_block(optimizer_class)[1]
    if block > 1 and defaults is not None and "block_size" in defaults:
        return int(cast(int, defaults["block_size"]))
    return block


def optimizer_name(optimizer_class: type) -> str:
    """The class as a state dict records it: ``torch.optim.X`` for torch's, else module.qualname.

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
    """The class ``name`` names (torch's, registered, or torchao's), or ``None``: its full name
    (:func:`optimizer_name`, as a state dict records it) or, where one class has it, its own.

    Example:
        >>> optimizer_by_name("torch.optim.SGD") is torch.optim.SGD
        True
        >>> optimizer_by_name("Muon") is torch.optim.Muon
        True
    """
    torch_classes = [
        c
        for c in vars(torch.optim).values()
        if isinstance(c, type) and issubclass(c, torch.optim.Optimizer)
    ]
    known = {optimizer_name(c): c for c in (*OPTIMIZER_KINDS, *torch_classes)}
    full = name if name in known or name in _KNOWN_BY_NAME else None
    if full is None:  # a class's own name, where it names one class only
        named = {f for f in (*known, *_KNOWN_BY_NAME) if f.rpartition(".")[2] == name}
        full = named.pop() if len(named) == 1 else None
    if full in known:
        return known[full]
    if full in _KNOWN_BY_NAME:  # torchao's, imported only now (an optional dependency)
        module, _, qualname = full.rpartition(".")
        found = getattr(import_torchao(module), qualname, None)
        return found if isinstance(found, type) else None
    return None
