"""What an update costs per tensor, and Muon + AdamW ownership balanced by it (pure).

``torch.optim.Muon``'s Newton–Schulz iteration needs whole matrices, at a cost of ``m * n *
min(m, n)``: :func:`muon_plan` balances them by it (what ``zero-functional plan --muon`` prints)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from zero_functional.core._validate import check_world_size
from zero_functional.core.partition import FlatPartition, flat, sorted_greedy

MUON_STATE_BYTES = 4  # per element: Muon's fp32 momentum_buffer
ADAMW_STATE_BYTES = 8  # per element: AdamW's fp32 exp_avg and exp_avg_sq


def newton_schulz_cost(shape: Sequence[int]) -> int:
    """One Muon update's cost for a matrix ``(m, n)``: ``m * n * min(m, n)`` multiply-adds per
    product of its Newton–Schulz steps (the constant, the same for every matrix, left out).

    Example:
        >>> newton_schulz_cost((768, 3072))  # GPT-2 small's mlp.c_fc
        1811939328
    """
    dims = tuple(shape)
    if len(dims) != 2:
        raise ValueError(
            f"shape {dims} is not 2-D: torch.optim.Muon takes 2-D parameters only; put this "
            "parameter in the AdamW group"
        )
    return _numel(dims) * min(dims)


UPDATE_COSTS: dict[str, Callable[[Sequence[int]], int]] = {"torch.optim.Muon": newton_schulz_cost}
"""One update's cost by class name, where it is not the element count."""


def update_cost(class_name: str, shape: Sequence[int]) -> int:
    """One update's cost for ``shape`` under ``class_name``: :data:`UPDATE_COSTS`, else numel.

    Example:
        >>> update_cost("torch.optim.Muon", (4, 8)), update_cost("torch.optim.Adafactor", (4, 8))
        (128, 32)
    """
    cost = UPDATE_COSTS.get(class_name)
    return cost(shape) if cost is not None else _numel(shape)


def cost_greedy(costs: Sequence[int], world_size: int) -> tuple[tuple[int, ...], ...]:
    """Whole tensors balanced by cost: ``sorted_greedy`` keyed by it (busiest <= mean + largest).

    Example:
        >>> cost_greedy([64, 32, 64, 1], world_size=2)
        ((0, 1), (2, 3))
    """
    return sorted_greedy(costs, world_size)


@dataclass(frozen=True, slots=True)
class MuonPlan:
    """Who owns what under Muon + AdamW: ``matrices`` owned whole (``matrix_owned[rank]``),
    ``rest`` split by ``rest_split`` (its pieces index into ``rest``); per rank, elements owned
    (``muon_numel``) and summed Newton–Schulz ``cost``."""

    matrices: tuple[int, ...]
    rest: tuple[int, ...]
    matrix_owned: tuple[tuple[int, ...], ...]
    rest_split: FlatPartition
    muon_numel: tuple[int, ...]
    cost: tuple[int, ...]

    @property
    def adamw_numel(self) -> tuple[int, ...]:
        """Elements of ``rest`` each rank owns."""
        return self.rest_split.loads

    @property
    def state_bytes(self) -> tuple[int, ...]:
        """Per rank, fp32 optimizer state: Muon's 4 B and AdamW's 8 B per owned element."""
        return tuple(
            MUON_STATE_BYTES * m + ADAMW_STATE_BYTES * a
            for m, a in zip(self.muon_numel, self.adamw_numel)
        )


def muon_plan(shapes: Sequence[Sequence[int]], muon: Sequence[bool], world_size: int) -> MuonPlan:
    """Muon's matrices (``muon[i]``) owned whole by :func:`cost_greedy` of their cost and AdamW's
    rest split ``flat``, as the optimizer owns them: two balances, apart.

    Example:
        >>> plan = muon_plan([(8, 8), (8,), (4, 8), (4, 8)], [True, False, True, True], 2)
        >>> plan.matrix_owned, plan.cost, plan.adamw_numel, plan.state_bytes
        (((0,), (2, 3)), (512, 256), (4, 4), (288, 288))
    """
    check_world_size(world_size)
    if len(muon) != len(shapes):
        raise ValueError(
            f"muon has {len(muon)} entries for {len(shapes)} shapes: pass one bool per parameter"
        )
    matrices = tuple(i for i, m in enumerate(muon) if m)
    rest = tuple(i for i, m in enumerate(muon) if not m)
    numel = [_numel(s) for s in shapes]
    costs = [newton_schulz_cost(shapes[i]) for i in matrices]
    owned = tuple(tuple(matrices[j] for j in r) for r in cost_greedy(costs, world_size))
    return MuonPlan(
        matrices=matrices,
        rest=rest,
        matrix_owned=owned,
        rest_split=flat([numel[i] for i in rest], world_size),
        muon_numel=tuple(sum(numel[i] for i in r) for r in owned),
        cost=tuple(sum(newton_schulz_cost(shapes[i]) for i in r) for r in owned),
    )


def _numel(shape: Sequence[int]) -> int:
    if any(d < 0 for d in shape):
        raise ValueError(f"shape {tuple(shape)} has a negative size: pass tensor.shape")
    return math.prod(shape)
