"""A class per param group (pure): which class runs a group, its checks, what ``"flat"`` splits.

A group may name its own ``"optimizer_class"`` (Muon for matrices, AdamW for the rest); the
stateful half is :mod:`zero_functional.shell.classes`."""

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


def group_class(group: Any, default: type[Optimizer]) -> type[Optimizer]:
    """The class that runs ``group``: its ``"optimizer_class"`` (a class or name), else ``default``.

    Example:
        >>> group_class({"params": [], "optimizer_class": "torch.optim.Adam"}, torch.optim.SGD)
        <class 'torch.optim.adam.Adam'>
    """
    value = group.get(GROUP_CLASS_KEY) if isinstance(group, dict) else None
    if value is None:
        return default
    cls = optimizer_by_name(value) if isinstance(value, str) else value
    if not (isinstance(cls, type) and issubclass(cls, Optimizer)):
        raise TypeError(
            f"a param group's {GROUP_CLASS_KEY!r} must be a torch.optim.Optimizer subclass, its "
            "full name ('torch.optim.Muon') or, for torch.optim's and registered classes, its "
            f"own name ('Muon'); got {value!r}"
        )
    return cls


def is_mixed(items: Sequence[Any]) -> bool:
    """Whether any param group names its own ``"optimizer_class"``.

    Example:
        >>> is_mixed([{"params": [], "optimizer_class": torch.optim.SGD}]), is_mixed([])
        (True, False)
    """
    return any(isinstance(g, dict) and GROUP_CLASS_KEY in g for g in items)


def param_blocks(
    param_groups: Sequence[Any], default: type[Optimizer], defaults: Mapping[str, Any]
) -> list[int] | None:
    """Per parameter, its class's quantization block (``"flat"`` cuts on it); ``None`` if none.

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
    """The groups (or tensors) ``"flat"`` splits: those of an elementwise class.

    Example:
        >>> g = {"params": [torch.zeros(2, 2)], "optimizer_class": torch.optim.Muon}
        >>> split_items([g, {"params": []}], torch.optim.SGD)
        [{'params': []}]
    """
    if not is_mixed(items):
        return list(items)
    return [g for g in items if update_kind(group_class(g, default)) == "elementwise"]


def _signature(optimizer_class: type) -> Mapping[str, inspect.Parameter] | None:
    try:
        return inspect.signature(optimizer_class).parameters
    except (TypeError, ValueError):
        return None


def own_class_group(group: dict[str, Any], index: int) -> dict[str, Any]:
    """Group ``index`` filled and checked by its own class, the class recorded by name.

    Example:
        >>> g = own_class_group({"params": [torch.zeros(2, 2)], "optimizer_class": torch.optim.Muon}, 0)
        >>> g["optimizer_class"], g["momentum"]
        ('torch.optim.Muon', 0.95)
    """
    cls = group_class(group, Optimizer)
    name = optimizer_name(cls)
    hyper = {k: v for k, v in group.items() if k not in ("params", GROUP_CLASS_KEY)}
    parameters = _signature(cls) or {}
    if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        taken = set(parameters) - {"params"}
        unknown = [k for k in hyper if k not in taken | set(IGNORED_GROUP_KEYS)]
        if parameters and unknown:
            raise TypeError(
                f"parameter group {index} runs {name}, which takes no hyperparameter "
                f"{unknown[0]!r} (it takes {', '.join(sorted(taken))})"
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
    """Every group's own class checked (:func:`own_class_group`), none needing a closure.

    Example:
        >>> check_group_classes([{"params": [], "optimizer_class": torch.optim.LBFGS}], object)
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
    """A TypeError unless each hyperparameter whose default is a number (or numbers) is one.

    Example:
        >>> check_hyperparameter_types(torch.optim.Adam, {"lr": 1e-3, "betas": (0.9, 0.99)})
    """
    parameters = _signature(optimizer_class)
    if parameters is None:
        return

    def numeric(v: object) -> bool:
        # numbers.Real: numpy's scalars too, which torch's own comparisons accept
        return isinstance(v, numbers.Real | Tensor) and not isinstance(v, bool)

    for name, value in defaults.items():
        parameter = parameters.get(name)
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
