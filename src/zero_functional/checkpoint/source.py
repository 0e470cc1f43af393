"""What a checkpoint asks of its optimizer: one adapter over ours or a plain ``torch.optim``.

Ours holds each rank's pieces of the state; a plain optimizer holds all of it, the same on
every rank (rank 0 writes it, every rank reads it). :func:`source` asks which, once; save, load
and :class:`~zero_functional.checkpoint.stateful.ZeroStateful` ask the :class:`Source`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from zero_functional import comm
from zero_functional.checkpoint.storage import CheckpointError
from zero_functional.comm import ProcessGroup
from zero_functional.core.classes import group_class
from zero_functional.core.main_params import main_dtype_for
from zero_functional.core.ownership import Ownership
from zero_functional.core.param_table import ParamTable
from zero_functional.core.partition import Piece
from zero_functional.functional.registry import update_block
from zero_functional.optimizer import ZeroRedundancyOptimizer

State = dict[int, dict[str, Any]]
"""Optimizer state by global parameter index."""


@dataclass(frozen=True)
class Source:
    """An optimizer as a checkpoint sees it, now (one per save or load): its parameters
    (``table``), the ranks that save and load it (``group``), the pieces this rank reads (ours:
    its own; a plain one: every parameter whole), each group's class, their ``state()``, how
    to ``install`` what was read (checked first; collective for ours), ``finish()`` (wait
    for the parameters' all-gathers in flight) and ``hold`` (what a snapshot holds still).
    Only ours has an ``ownership``, main copies (``main_dtype``) and a ``device_mesh``'s
    ``replicate_group`` (whose first replica writes).
    """

    optimizer: Optimizer
    table: ParamTable
    group: ProcessGroup | None
    pieces: dict[int, Piece]
    classes: tuple[type[Optimizer], ...]
    state: Callable[[], State]
    install: Callable[[State, list[dict[str, Any]]], None]
    finish: Callable[[], None]
    hold: Callable[[Callable[[], None]], RemovableHandle]
    """Registers a callback run before the optimizer next changes its state or parameters."""
    ownership: Ownership | None = None
    main_dtype: torch.dtype | None = None
    replicate_group: ProcessGroup | None = None
    keeps_main_of: Callable[[int], bool] | None = None  # ours: its shard answers

    @property
    def writes(self) -> bool:
        """Whether this rank writes its pieces: every rank of ours, rank 0 of a plain one."""
        return self.ownership is not None or comm.rank_or_zero(self.group) == 0

    def names(self, model: nn.Module | None) -> list[str]:
        """Each parameter's name in ``model`` (its index without one), by global index; a
        :class:`CheckpointError` for parameters that are not the model's."""
        try:
            return self.table.names(model)
        except ValueError as e:
            raise CheckpointError(str(e)) from None

    def group_names(self, names: list[str]) -> list[list[str]]:
        """Each group's parameters' names."""
        return [names[a : a + n] for a, n in self.table.spans]

    def keeps_main(self, k: int) -> bool:
        """Whether the optimizer keeps a main copy of parameter ``k`` (in a wider dtype)."""
        if self.keeps_main_of is not None:
            return self.keeps_main_of(k)
        return main_dtype_for(self.table.params[k].dtype, self.main_dtype) is not None

    def blockwise(self) -> str | None:
        """The name of the first group class that quantizes its state in blocks (torchao's
        low-bit AdamWs), else ``None``: the same on every rank."""
        for cls, g in zip(self.classes, self.optimizer.param_groups):
            if update_block(cls, {**self.optimizer.defaults, **g}) > 1:
                return cls.__name__
        return None


def source(optimizer: Optimizer, process_group: ProcessGroup | None = None) -> Source:
    """``optimizer`` as a checkpoint sees it (``process_group``: a plain one's ranks).

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> plain = source(torch.optim.SGD(model.parameters(), lr=0.1))
        >>> plain.pieces[1], plain.writes, plain.ownership is None, plain.names(model)
        (Piece(param=1, start=0, stop=1), True, True, ['weight', 'bias'])
    """
    if isinstance(optimizer, ZeroRedundancyOptimizer):  # the one place that asks
        return _sharded(optimizer)
    table, state = ParamTable.of(optimizer.param_groups), optimizer.state

    def install(loaded: State, groups: list[dict[str, Any]]) -> None:
        indexed = [{**g, "params": list(range(a, a + n))} for g, (a, n) in zip(groups, table.spans)]
        optimizer.load_state_dict({"state": loaded, "param_groups": indexed})

    return Source(
        optimizer,
        table,
        process_group,
        {k: Piece(k, 0, p.numel(), param_numel=p.numel()) for k, p in enumerate(table.params)},
        (type(optimizer),) * len(table.spans),
        lambda: {k: state[p] for k, p in enumerate(table.params) if state.get(p)},
        install,
        lambda: None,
        lambda hook: optimizer.register_step_pre_hook(lambda *_: hook()),
    )


def _sharded(zero: ZeroRedundancyOptimizer) -> Source:
    def install(state: State, groups: list[dict[str, Any]]) -> None:
        zero.finish_param_sync()
        zero.load_shard_state(state, groups, copy=False)

    return Source(
        zero,
        zero.param_table,
        zero.process_group,
        {s.param: s for s in zero.ownership.owned(zero.rank)},
        tuple(group_class(g, zero.optimizer_class) for g in zero.param_groups),
        lambda: {k: state for k, (_, state) in zero.shard_state().items()},
        install,
        zero.finish_param_sync,
        zero.register_pre_update_hook,
        zero.ownership,
        zero.main_params_dtype,
        zero.replicate_group,
        lambda k: zero.shard.main_dtype(zero.param_table.params[k]) is not None,
    )
