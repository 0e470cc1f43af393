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
    if is_mixed(groups):  # the groups without a class of their own: ``default``'s name
        for g in groups:
            g.setdefault(GROUP_CLASS_KEY, optimizer_name(default))


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
    if not is_mixed(groups):
        return {}
    classes = [group_class(g, default) for g in groups for _ in g["params"]]
    kept = [k for k, cls in enumerate(classes) if update_kind(cls) != "elementwise"]
    shapes = [tuple(table.params[k].shape) for k in kept]
    costs = [update_cost(optimizer_name(classes[k]), s) for k, s in zip(kept, shapes)]
    return dict(zip(kept, whole_owners(shapes, world_size, costs), strict=True))
