"""A class per parameter group: groups that carry their own ``"optimizer_class"`` (issue 30).

A group may name its own ``torch.optim`` class (Muon for the hidden matrices, AdamW for the
rest). Such a group is filled from its dict and its class's defaults, never from the
optimizer's keyword defaults (those are the constructor's class's), and records its class by
name (:func:`~zero_functional.functional.registry.optimizer_name`), so that ``param_groups``
and the state dict hold only strings. Once any group has a class of its own, every group
records its class. Without one anywhere, nothing here changes a group: one class for all
groups behaves exactly as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.optim import Optimizer

from zero_functional.core.classes import group_class, is_mixed, own_class_group
from zero_functional.core.cost import update_cost
from zero_functional.core.param_table import ParamTable
from zero_functional.core.plans import whole_owners
from zero_functional.functional import update_kind
from zero_functional.functional.registry import GROUP_CLASS_KEY, optimizer_name

__all__ = ["add_group", "mark_classes", "pinned_owners", "update_costs", "whole_params"]


def add_group(
    add: Callable[[dict[str, Any]], None],
    groups: list[dict[str, Any]],
    group: dict[str, Any],
    default: type[Optimizer],
) -> None:
    """Add ``group`` to ``groups`` through ``add`` (``torch.optim.Optimizer.add_param_group``):
    a group with its own class filled by that class, and nothing of the optimizer's defaults.

    Example:
        >>> import torch
        >>> opt = torch.optim.AdamW([torch.zeros(2)], weight_decay=0.3)
        >>> muon = {"params": [torch.zeros(2, 2)], "optimizer_class": torch.optim.Muon}
        >>> add_group(opt.add_param_group, opt.param_groups, muon, torch.optim.AdamW)
        >>> g = opt.param_groups[1]
        >>> g["optimizer_class"], g["weight_decay"], "betas" in g, opt.param_groups[0]["optimizer_class"]
        ('torch.optim.Muon', 0.1, False, 'torch.optim.AdamW')
    """
    if not (isinstance(group, dict) and GROUP_CLASS_KEY in group):
        add(group)
        mark_classes(groups, default)
        return
    filled = own_class_group(group, len(groups))
    own = set(filled)
    add(filled)  # torch fills the very dict it adds, from the optimizer's defaults
    added = groups[-1]
    for key in [k for k in added if k not in own]:  # the optimizer's defaults: not its class's
        del added[key]
    mark_classes(groups, default)


def mark_classes(groups: list[dict[str, Any]], default: type[Optimizer]) -> None:
    """Where any group has its own class, record ``default``'s name in the groups without one
    (in place); else leave every group as it is.

    Example:
        >>> import torch
        >>> groups = [{"params": []}, {"params": [], "optimizer_class": "torch.optim.Muon"}]
        >>> mark_classes(groups, torch.optim.AdamW)
        >>> groups[0]["optimizer_class"]
        'torch.optim.AdamW'
    """
    if not is_mixed(groups):
        return
    for g in groups:
        g.setdefault(GROUP_CLASS_KEY, optimizer_name(default))


def whole_params(groups: list[dict[str, Any]], default: type[Optimizer]) -> list[bool] | None:
    """Per parameter (global index), whether its group's class needs it owned whole (its
    update is not elementwise: Muon's reads the whole matrix); ``None`` with one class.

    Example:
        >>> import torch
        >>> groups = [{"params": [torch.zeros(2, 2)], "optimizer_class": "torch.optim.Muon"},
        ...           {"params": [torch.zeros(2)], "optimizer_class": "torch.optim.AdamW"}]
        >>> whole_params(groups, torch.optim.AdamW)
        [True, False]
    """
    if not is_mixed(groups):
        return None
    return [
        update_kind(group_class(g, default)) != "elementwise" for g in groups for _ in g["params"]
    ]


def update_costs(groups: list[dict[str, Any]], default: type[Optimizer]) -> list[int]:
    """Per parameter (global index), what one update of it costs under its group's class
    (:func:`~zero_functional.core.cost.update_cost`): what whole-owned tensors are balanced by.

    Example:
        >>> import torch
        >>> groups = [{"params": [torch.zeros(2, 4)], "optimizer_class": "torch.optim.Muon"},
        ...           {"params": [torch.zeros(2)]}]
        >>> update_costs(groups, torch.optim.AdamW)
        [16, 2]
    """
    return [
        update_cost(optimizer_name(group_class(g, default)), tuple(p.shape))
        for g in groups
        for p in g["params"]
    ]


def pinned_owners(
    groups: list[dict[str, Any]], default: type[Optimizer], table: ParamTable, world_size: int
) -> dict[int, int]:
    """The rank that owns each tensor of a per-tensor class whole (global index to rank),
    placed by its update's cost as under ``"flat"`` after backward; empty with one class.
    What overlap mode's buckets keep whole
    (:func:`~zero_functional.core.ownership.bucket_ownership`'s ``pinned``).

    Example:
        >>> import torch
        >>> groups = [{"params": [torch.zeros(2, 2), torch.zeros(4, 4)],
        ...            "optimizer_class": "torch.optim.Muon"}, {"params": [torch.zeros(8)]}]
        >>> pinned_owners(groups, torch.optim.AdamW, ParamTable.of(groups), 2)
        {0: 1, 1: 0}
    """
    whole = whole_params(groups, default)
    if not whole:
        return {}
    kept = [k for k, w in enumerate(whole) if w]
    costs = update_costs(groups, default)
    shapes = [tuple(table.params[k].shape) for k in kept]
    return dict(zip(kept, whole_owners(shapes, world_size, [costs[k] for k in kept]), strict=True))
