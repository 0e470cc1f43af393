"""Classes per group: adding and marking parameter groups that carry their own class.

With one class nothing here changes a group; the checks are :mod:`zero_functional.core.classes`.
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


def add_group(
    add: Callable[[dict[str, Any]], None],
    groups: list[dict[str, Any]],
    group: dict[str, Any],
    default: type[Optimizer],
) -> None:
    """Add ``group`` through ``add`` (``Optimizer.add_param_group``), filled by its own class only.

    Example:
        >>> opt = torch.optim.AdamW([torch.zeros(2)], weight_decay=0.3)
        >>> muon = {"params": [torch.zeros(2, 2)], "optimizer_class": torch.optim.Muon}
        >>> add_group(opt.add_param_group, opt.param_groups, muon, torch.optim.AdamW)
        >>> [(g["optimizer_class"], g["weight_decay"]) for g in opt.param_groups]
        [('torch.optim.AdamW', 0.3), ('torch.optim.Muon', 0.1)]
    """
    if isinstance(group, dict) and GROUP_CLASS_KEY in group:
        filled = own_class_group(group, len(groups))
        own = set(filled)
        add(filled)  # torch fills the very dict it adds, from the optimizer's defaults
        for key in [k for k in groups[-1] if k not in own]:  # the optimizer's: not its class's
            del groups[-1][key]
    else:
        add(group)
    mark_classes(groups, default)


def mark_classes(groups: list[dict[str, Any]], default: type[Optimizer]) -> None:
    """Where any group has its own class, record ``default``'s name in those without one.

    Example:
        >>> groups = [{"params": []}, {"params": [], "optimizer_class": "torch.optim.Muon"}]
        >>> mark_classes(groups, torch.optim.AdamW); groups[0]["optimizer_class"]
        'torch.optim.AdamW'
    """
    if not is_mixed(groups):
        return
    for g in groups:
        g.setdefault(GROUP_CLASS_KEY, optimizer_name(default))


def whole_params(groups: list[dict[str, Any]], default: type[Optimizer]) -> list[bool] | None:
    """Per parameter, whether its group's class needs it owned whole; ``None`` with one class.

    Example:
        >>> muon = {"params": [torch.zeros(2, 2)], "optimizer_class": "torch.optim.Muon"}
        >>> whole_params([muon, {"params": [torch.zeros(2)]}], torch.optim.AdamW)
        [True, False]
    """
    if not is_mixed(groups):
        return None
    return [
        update_kind(group_class(g, default)) != "elementwise" for g in groups for _ in g["params"]
    ]


def update_costs(groups: list[dict[str, Any]], default: type[Optimizer]) -> list[int]:
    """Per parameter, what one update of it costs under its group's class.

    Example:
        >>> muon = {"params": [torch.zeros(2, 4)], "optimizer_class": "torch.optim.Muon"}
        >>> update_costs([muon, {"params": [torch.zeros(2)]}], torch.optim.AdamW)
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
    """Global index -> the rank owning that tensor of a per-tensor class whole, by cost.

    Example:
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
