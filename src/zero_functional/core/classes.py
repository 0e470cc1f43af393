"""A class per param group (pure): which class runs a group, its checks, what ``"flat"`` splits.

A group may carry its own ``"optimizer_class"`` (Muon for the matrices, AdamW for the rest); the
stateful half (filling and recording groups, update costs) is :mod:`zero_functional.shell.classes`.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from zero_functional.functional import IGNORED_GROUP_KEYS, update_kind
from zero_functional.functional.registry import (
    GROUP_CLASS_KEY,
    optimizer_by_name,
    optimizer_name,
    update_block,
)

__all__ = [
    "check_group_classes",
    "check_hyperparameter_types",
    "group_class",
    "is_mixed",
    "own_class_group",
    "param_blocks",
    "split_items",
]


def group_class(group: Any, default: type[Optimizer]) -> type[Optimizer]:
    """The class that runs ``group``: its ``"optimizer_class"`` (a class, or a name
    :func:`~zero_functional.functional.registry.optimizer_by_name` knows), else ``default``.

    Raises:
        TypeError: The key holds neither an ``Optimizer`` subclass nor a known name.

    Example:
        >>> group_class({"params": [], "optimizer_class": "torch.optim.Adam"}, torch.optim.SGD)
        <class 'torch.optim.adam.Adam'>
        >>> group_class({"params": []}, torch.optim.SGD)
        <class 'torch.optim.sgd.SGD'>
    """
    value = group.get(GROUP_CLASS_KEY) if isinstance(group, dict) else None
    if value is None:
        return default
    cls = optimizer_by_name(value) if isinstance(value, str) else value
    if not (isinstance(cls, type) and issubclass(cls, Optimizer)):
        raise TypeError(
            f"a param group's {GROUP_CLASS_KEY!r} must be a torch.optim.Optimizer subclass (or "
            f"the name of a torch.optim or registered class), got {value!r}"
        )
    return cls


def is_mixed(items: Sequence[Any]) -> bool:
    """Whether any param group carries its own ``"optimizer_class"``.

    Example:
        >>> is_mixed([{"params": [], "optimizer_class": torch.optim.SGD}]), is_mixed([])
        (True, False)
    """
    return any(isinstance(g, dict) and GROUP_CLASS_KEY in g for g in items)


def param_blocks(
    param_groups: Sequence[Any], default: type[Optimizer], defaults: Mapping[str, Any]
) -> list[int] | None:
    """Per parameter (global index), the quantization block of its class's state
    (:func:`~zero_functional.functional.registry.update_block`: torchao's low-bit optimizers),
    which ``"flat"`` cuts on; ``None`` where no class has blocks. The constructor's keyword
    ``defaults`` reach ``default``'s groups only.

    Example:
        >>> param_blocks([{"params": [torch.zeros(2)]}], torch.optim.AdamW, {}) is None
        True
    """
    blocks = [
        update_block(cls, defaults if cls is default else None)
        for g in param_groups
        for cls in [group_class(g, default)]
        for _ in g["params"]
    ]
    return blocks if any(b > 1 for b in blocks) else None


def split_items(items: Sequence[Any], default: type[Optimizer]) -> list[Any]:
    """The groups (or tensors) ``partition="flat"`` splits: those of an elementwise class
    (with classes per group, the others are owned whole).

    Example:
        >>> g = {"params": [torch.zeros(2, 2)], "optimizer_class": torch.optim.Muon}
        >>> split_items([g, {"params": []}], torch.optim.SGD)
        [{'params': []}]
    """
    if not is_mixed(items):
        return list(items)
    return [g for g in items if update_kind(group_class(g, default)) == "elementwise"]


def _taken_keys(optimizer_class: type) -> set[str] | None:
    """The hyperparameters ``optimizer_class``'s constructor takes (``None``: any)."""
    try:
        parameters = inspect.signature(optimizer_class).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return {p.name for p in parameters if p.name != "params"}


def own_class_group(group: dict[str, Any], index: int) -> dict[str, Any]:
    """Group ``index`` as its own class fills it (that class's defaults, not the optimizer's),
    its class recorded by name; the class's own checks ran on its values and parameters.

    Raises:
        TypeError: Not a class, or a hyperparameter the class does not take (named, with the
            class), or one of the wrong type.
        ValueError: The class refused the group (its own message, with the group's index:
            Muon's for a parameter that is not 2-D).

    Example:
        >>> g = own_class_group({"params": [torch.zeros(2, 2)], "optimizer_class": torch.optim.Muon}, 0)
        >>> g["optimizer_class"], g["momentum"]
        ('torch.optim.Muon', 0.95)
        >>> own_class_group({"params": [torch.zeros(2)], "optimizer_class": torch.optim.Muon}, 1)
        Traceback (most recent call last):
        ...
        ValueError: parameter group 1 (torch.optim.Muon): Muon only supports 2D parameters whereas we found a parameter with size: torch.Size([2])
    """
    cls = group_class(group, Optimizer)
    name = optimizer_name(cls)
    hyper = {k: v for k, v in group.items() if k not in ("params", GROUP_CLASS_KEY)}
    taken = _taken_keys(cls)
    unknown = [k for k in hyper if taken is not None and k not in taken | set(IGNORED_GROUP_KEYS)]
    if unknown:
        raise TypeError(
            f"parameter group {index} runs {name}, which takes no hyperparameter "
            f"{unknown[0]!r} (it takes {', '.join(sorted(taken or ()))})"
        )
    check_hyperparameter_types(cls, hyper)
    ps = group["params"]
    params = [ps] if isinstance(ps, Tensor) else list(ps)
    try:
        filled = cls([{**hyper, "params": params}]).param_groups[0]  # type: ignore[call-arg]
    except ValueError as e:
        raise ValueError(f"parameter group {index} ({name}): {e}") from e
    return {**filled, GROUP_CLASS_KEY: name}


def check_group_classes(items: Sequence[Any], default: type[Optimizer], first: int = 0) -> None:
    """Every group's own class: :func:`own_class_group`, and no class whose step needs a
    closure (it cannot share a step with other classes); ``first`` is the first group's index.

    Example:
        >>> check_group_classes([{"params": [torch.zeros(2)], "optimizer_class": torch.optim.LBFGS}],
        ...                     torch.optim.SGD)
        Traceback (most recent call last):
        ...
        ValueError: parameter group 0 runs LBFGS, whose step re-evaluates the model through a closure: it cannot share a step with other groups' classes; give it its own optimizer
    """
    for i, g in enumerate(items, start=first):
        cls = group_class(g, default)
        if update_kind(cls) == "closure":
            raise ValueError(
                f"parameter group {i} runs {cls.__name__}, whose step re-evaluates the model "
                "through a closure: it cannot share a step with other groups' classes; give it "
                "its own optimizer"
            )
        if isinstance(g, dict) and GROUP_CLASS_KEY in g:
            own_class_group(g, i)


def check_hyperparameter_types(optimizer_class: type, defaults: dict[str, Any]) -> None:
    """Each hyperparameter whose default in ``optimizer_class`` is a number is a number (or a
    tensor), and each tuple of numbers a tuple of numbers, before torch compares it.

    Raises:
        TypeError: Names the hyperparameter, what it must be and what it got.

    Example:
        >>> check_hyperparameter_types(torch.optim.Adam, {"lr": 1e-3, "betas": (0.9, 0.99)})
        >>> check_hyperparameter_types(torch.optim.Adam, {"lr": "abc"})
        Traceback (most recent call last):
        ...
        TypeError: Adam's hyperparameter lr must be a number (or a Tensor), got str 'abc'
    """
    try:
        signature = inspect.signature(optimizer_class)
    except (TypeError, ValueError):
        return

    def numeric(v: object) -> bool:
        # numbers.Real: numpy's scalars too, which torch's own comparisons accept
        return isinstance(v, numbers.Real | Tensor) and not isinstance(v, bool)

    for name, value in defaults.items():
        parameter = signature.parameters.get(name)
        default = parameter.default if parameter is not None else inspect.Parameter.empty
        where = f"{optimizer_class.__name__}'s hyperparameter {name}"
        if numeric(default) and not numeric(value):
            raise TypeError(
                f"{where} must be a number (or a Tensor), got {type(value).__name__} {value!r}"
            )
        if (
            isinstance(default, tuple)
            and default
            and all(numeric(d) for d in default)
            and not (isinstance(value, tuple | list) and all(numeric(v) for v in value))
        ):
            raise TypeError(
                f"{where} must be a tuple of {len(default)} numbers like {default!r}, got "
                f"{type(value).__name__} {value!r}"
            )
