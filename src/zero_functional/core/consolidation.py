"""Consolidation (pure): every rank's piece states as torch's state dict on one rank.

``consolidate_state_dict(to)`` gathers each rank's pieces to rank ``to``; :class:`Consolidation`
keeps what it gathered and answers ``state_dict()`` (:func:`rank_state_dict`)."""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor

from zero_functional.core.blockwise import Range
from zero_functional.core.param_table import ParamTable
from zero_functional.core.piece_state import join_states

Shard = Mapping[int, tuple[Range, Mapping[str, object]]]
"""One rank's pieces: global index -> (the piece's range, its state)."""

# marks a state_dict() of a rank that another rank consolidated onto; load_state_dict refuses it
PARTIAL_KEY = "zero_partial"


def to_cpu(state: Mapping[str, object]) -> dict[str, object]:
    """A copy of ``state`` with every tensor on the CPU (what travels to a consolidating rank).

    Example:
        >>> to_cpu({"step": torch.tensor(2.0), "lr": 0.1})
        {'step': tensor(2.), 'lr': 0.1}
    """
    return {
        k: v.detach().to("cpu", copy=True) if isinstance(v, Tensor) else v for k, v in state.items()
    }


def merge_shards(
    shards: Sequence[Shard], shapes: Sequence[Sequence[int]]
) -> dict[int, dict[str, object]]:
    """Each parameter's whole state, in its shape, from every rank's pieces (which must cover it).

    Example:
        >>> a = {0: ((0, 2), {"momentum_buffer": torch.tensor([1.0, 2.0])})}
        >>> b = {0: ((2, 4), {"momentum_buffer": torch.tensor([3.0, 4.0])})}
        >>> merge_shards([b, a], [(2, 2)])[0]["momentum_buffer"].tolist()
        [[1.0, 2.0], [3.0, 4.0]]
    """
    parts: dict[int, list[tuple[Range, Mapping[str, object]]]] = {}
    for shard in shards:
        for k, (rng, s) in shard.items():
            parts.setdefault(k, []).append((rng, s))
    state: dict[int, dict[str, object]] = {}
    for k in sorted(parts):
        pieces = sorted(parts[k], key=lambda rs: rs[0])
        numel = math.prod(shapes[k])
        covered = sum(b - a for (a, b), _ in pieces)
        if covered != numel:
            raise RuntimeError(
                f"parameter {k} has state for {covered} of its {numel} elements: some ranks "
                "stepped it and others did not"
            )
        state[k] = join_states(pieces, tuple(shapes[k]))
    return state


def not_consolidated_message(rank: int) -> str:
    """``state_dict()``'s error after an unconsolidated change: torch's words, then the fix.

    Example:
        >>> not_consolidated_message(1)[:54]
        'Optimizer state has not been consolidated on this rank'
    """
    message = (
        "Optimizer state has not been consolidated on this rank. Please call "
        f"`consolidate_state_dict(to={rank})` on all ranks beforehand if you meant to save the "
        "global state (after the last step: every step changes the state)."
    )
    if "transformers.trainer" in sys.modules:
        message += (
            " With the Transformers Trainer, pass "
            "callbacks=[zero_functional.integrations.ZeroTrainerCallback()], which "
            "consolidates on every rank before each save."
        )
    elif "accelerate" in sys.modules:
        message += (
            " With Accelerate, call zero_functional.integrations.accelerate.register("
            "accelerator, optimizer) once after prepare(): save_state then consolidates on "
            "every rank first."
        )
    else:
        message += (
            " Lightning and Fabric consolidate by themselves; for DCP (distributed checkpoint) "
            "use zero_functional.checkpoint.stateful(model, optimizer)."
        )
    return message


def rank_state_dict(
    param_groups: Sequence[Mapping[str, Any]],
    shards: Sequence[Shard],
    *,
    updates: int,
    consolidated_at: int | None,
    rank: int,
) -> dict[str, Any]:
    """What ``state_dict()`` returns on ``rank``: groups, and the state of the ``shards`` the last
    consolidation gathered here (a RuntimeError if ``updates`` came since ``consolidated_at``).

    Example:
        >>> groups = [{"params": [torch.zeros(2)], "lr": 0.1}]
        >>> rank_state_dict(groups, [], updates=0, consolidated_at=None, rank=0)
        {'state': {}, 'param_groups': [{'lr': 0.1, 'params': [0]}]}
    """
    table = ParamTable.of(param_groups)
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": list(range(a, a + n))}
        for g, (a, n) in zip(param_groups, table.spans)
    ]
    if updates == 0 and not shards:
        return {"state": {}, "param_groups": groups}
    if consolidated_at != updates:
        raise RuntimeError(not_consolidated_message(rank))
    if not shards:
        return {"state": {}, "param_groups": groups, PARTIAL_KEY: True}
    shapes = [tuple(p.shape) for p in table.params]
    return {"state": merge_shards(shards, shapes), "param_groups": groups}


class Consolidation:
    """How often this rank's state changed, and what the last consolidation gathered here: all
    ``state_dict()`` needs to answer without a collective.

    Example:
        >>> book = Consolidation(); book.changed()  # a step
        >>> book.gathered([{0: ((0, 2), {"momentum_buffer": torch.ones(2)})}])
        >>> book.state_dict([{"params": [torch.zeros(2)], "lr": 0.1}], rank=0)["state"]
        {0: {'momentum_buffer': tensor([1., 1.])}}
    """

    def __init__(self) -> None:
        self.updates = 0
        self.consolidated_at: int | None = None
        self.shards: list[Shard] = []

    def changed(self) -> None:
        """This rank's state changed (a step or a load)."""
        self.updates += 1

    def gathered(self, shards: Sequence[Shard]) -> None:
        """A consolidation gathered ``shards`` here (every rank's; none elsewhere)."""
        self.shards = list(shards)
        self.consolidated_at = self.updates

    def state_dict(self, param_groups: Sequence[Mapping[str, Any]], rank: int) -> dict[str, Any]:
        return rank_state_dict(
            param_groups,
            self.shards,
            updates=self.updates,
            consolidated_at=self.consolidated_at,
            rank=rank,
        )
