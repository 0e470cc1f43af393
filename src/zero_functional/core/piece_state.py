"""Per-piece optimizer state <-> torch's per-parameter format (pure).

A rank that owns a piece ``[start, stop)`` of a parameter keeps that parameter's state for the
piece only: each *elementwise* state tensor (``exp_avg``, ``momentum_buffer``, ...) holds the
piece's elements, 1-D (or in the parameter's shape when the piece is the whole parameter), and
each *per-parameter* value (Adam's 0-d ``step``, a Python number) is the same on every rank that
holds a piece. :func:`slice_state` cuts the state of a piece down to a sub-range,
:func:`join_states` glues the states of adjacent ranges back together; with them one rank's
state moves to another ownership and every rank's pieces become torch's format.

Example:
    >>> import torch
    >>> whole = {"step": torch.tensor(3.0), "exp_avg": torch.arange(6.0).view(2, 3)}
    >>> a = slice_state(whole, (0, 6), (0, 4))
    >>> b = slice_state(whole, (0, 6), (4, 6))
    >>> a["exp_avg"].tolist(), b["exp_avg"].tolist()
    ([0.0, 1.0, 2.0, 3.0], [4.0, 5.0])
    >>> back = join_states([((0, 4), a), ((4, 6), b)], (2, 3))
    >>> back["exp_avg"].tolist(), back["step"].item()
    ([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], 3.0)
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor

from zero_functional.core._validate import first_of, prefix_sums
from zero_functional.core.blockwise import is_blockwise, joined_blocks, sliced_blocks
from zero_functional.core.param_table import ParamTable
from zero_functional.functional.registry import GROUP_CLASS_KEY

__all__ = [
    "Consolidation",
    "StateSchema",
    "check_hyperparameters",
    "check_param_state",
    "is_elementwise",
    "join_states",
    "PARTIAL_KEY",
    "check_shard_state",
    "merge_shards",
    "not_consolidated_message",
    "placed",
    "rank_state_dict",
    "slice_state",
    "to_cpu",
    "validated_state",
]

Range = tuple[int, int]
StateSchema = Mapping[str, str]
"""Per state key, ``"elementwise"`` (one entry per element of the parameter) or ``"scalar"``
(one value per parameter: a number or a 0-d tensor), as one step of the optimizer makes it."""


def is_elementwise(value: object, numel: int) -> bool:
    """Whether a state value holds one entry per element of a piece of ``numel`` elements.

    A tensor of at least one dimension and ``numel`` elements is elementwise; 0-d tensors
    (``step``), numbers and other objects are per-parameter values.

    Example:
        >>> import torch
        >>> is_elementwise(torch.zeros(2, 3), 6), is_elementwise(torch.tensor(1.0), 1)
        (True, False)
    """
    return isinstance(value, Tensor) and value.dim() >= 1 and value.numel() == numel


def slice_state(state: Mapping[str, object], held: Range, want: Range) -> dict[str, object]:
    """The state of elements ``want`` of a parameter, from the state of the piece ``held``.

    Pure: elementwise tensors come back as new 1-D tensors (copies), per-parameter values as
    they are (tensors cloned). ``want`` equal to ``held`` returns the state unchanged in shape.

    Args:
        state: The state of the piece ``held`` (``held``'s elements, any shape).
        held: ``(start, stop)`` of the piece the state belongs to, in parameter elements.
        want: ``(start, stop)`` inside ``held``.

    Returns:
        The state of ``want``.

    Raises:
        ValueError: ``want`` is not inside ``held``.

    Example:
        >>> import torch
        >>> slice_state({"momentum_buffer": torch.arange(4.0)}, (2, 6), (3, 5))
        {'momentum_buffer': tensor([1., 2.])}
    """
    (a, b), (lo, hi) = held, want
    if not a <= lo <= hi <= b:
        raise ValueError(f"elements [{lo}, {hi}) are not inside the piece [{a}, {b})")
    out: dict[str, object] = {}
    for key, value in state.items():
        if not isinstance(value, Tensor):
            out[key] = value
        elif want == held:
            out[key] = copied(value.detach())
        elif is_elementwise(value, b - a) and is_blockwise(value):
            out[key] = sliced_blocks(key, value, (a, b), (lo, hi))
        elif is_elementwise(value, b - a):
            out[key] = copied(value.detach().reshape(-1)[lo - a : hi - a])
        else:
            out[key] = copied(value.detach())
    return out


def copied(value: Tensor) -> Tensor:
    """A copy of ``value``: ``clone()``, or for a wrapper tensor subclass without one (torchao's
    quantized optimizer state: codes, scales and a code table) each of its inner tensors cloned.

    Example:
        >>> import torch
        >>> copied(torch.ones(2))
        tensor([1., 1.])
    """
    flatten = getattr(type(value), "__tensor_flatten__", None)
    if flatten is None:
        return value.clone()
    names, ctx = value.__tensor_flatten__()  # type: ignore[attr-defined]
    inner = {n: getattr(value, n).clone() for n in names}
    return cast(
        Tensor,
        type(value).__tensor_unflatten__(inner, ctx, value.shape, value.stride()),  # type: ignore[attr-defined]
    )


def join_states(
    parts: Sequence[tuple[Range, Mapping[str, object]]], shape: Sequence[int] | None = None
) -> dict[str, object]:
    """One state from the states of adjacent ranges, in element order; pure.

    Elementwise tensors are concatenated (and viewed as ``shape`` when given, for a piece that
    is the whole parameter); per-parameter values are taken from the first part.

    Args:
        parts: ``((start, stop), state)`` per range, contiguous and in order.
        shape: The parameter's shape when the ranges cover it all; else ``None`` (1-D).

    Returns:
        The state of the union of the ranges.

    Raises:
        ValueError: No parts, ranges that are not contiguous, or parts with different keys.

    Example:
        >>> import torch
        >>> join_states([((0, 1), {"v": torch.ones(1)}), ((1, 3), {"v": torch.zeros(2)})])
        {'v': tensor([1., 0., 0.])}
    """
    if not parts:
        raise ValueError("join_states needs at least one part")
    for (before, _), (after, _) in zip(parts, parts[1:]):
        if before[1] != after[0]:
            raise ValueError(
                f"ranges {before} and {after} (of {len(parts)}) are not contiguous and in order"
            )
    keys = set(parts[0][1])
    for r, s in parts[1:]:
        if set(s) != keys:
            raise ValueError(
                f"the state of elements {r} has keys {sorted(s)} but that of "
                f"{parts[0][0]} has {sorted(keys)}: the pieces were stepped differently"
            )
    if len(parts) == 1 and shape is None:
        return dict(parts[0][1])
    out: dict[str, object] = {}
    for key, first in parts[0][1].items():
        sizes = [hi - lo for (lo, hi), _ in parts]
        values = [s[key] for _, s in parts]
        elementwise = all(is_elementwise(v, n) for v, n in zip(values, sizes))
        blockwise = [is_blockwise(v) for v in values]
        if elementwise and any(blockwise):
            if not all(blockwise):
                raise ValueError(
                    f"the pieces of {key!r} are quantized for some ranges and not for others "
                    f"({first_of([r for r, _ in parts])}): a parameter's state is quantized "
                    "whole or not"
                )
            whole = tuple(shape) if shape is not None else (sum(sizes),)
            out[key] = joined_blocks(key, cast(list[Tensor], values), whole)
        elif elementwise:
            joined = torch.cat([cast(Tensor, s[key]).detach().reshape(-1) for _, s in parts])
            out[key] = joined.view(tuple(shape)) if shape is not None else joined
        else:
            out[key] = first
    return out


def check_param_state(
    where: str,
    state: object,
    shape: Sequence[int],
    *,
    is_complex: bool = False,
    schema: StateSchema | None = None,
) -> None:
    """Raise a ValueError or TypeError naming the problem unless ``state`` fits the parameter.

    With a ``schema`` (the keys one step of the optimizer makes), every key of the schema must
    be present in a non-empty state, an elementwise value must be a floating tensor (complex
    for a complex parameter) of the parameter's shape and a scalar value a real number or a
    0-d tensor. Without one, only the shape of tensors that are not 0-d is checked. An empty
    state is always fine (a parameter not stepped yet).

    Args:
        where: How to name the parameter in the message (``"parameter 3"``).
        state: The loaded state of one parameter.
        shape: The parameter's shape.
        is_complex: Whether the parameter is complex.
        schema: The optimizer's keys, if known.

    Example:
        >>> import torch
        >>> schema = {"step": "scalar", "exp_avg": "elementwise"}
        >>> check_param_state("parameter 0", {"step": 1, "exp_avg": torch.zeros(2)}, (2,), schema=schema)
        >>> check_param_state("parameter 0", {"step": 1, "exp_avg": torch.zeros(())}, (2,), schema=schema)
        Traceback (most recent call last):
        ...
        ValueError: parameter 0 has shape (2,) but its loaded state 'exp_avg' has shape (): the state belongs to another model or was edited
    """
    shape = tuple(shape)
    if not isinstance(state, Mapping):
        raise TypeError(
            f"{where}'s loaded state is a {type(state).__name__}, not a dict of state values: "
            "pass a state_dict() of this optimizer class"
        )
    if not state:
        return
    for key in state:
        if not isinstance(key, str):
            raise TypeError(f"{where}'s loaded state has a key {key!r}; state keys are strings")
    if schema is not None:
        missing = sorted(set(schema) - set(state))
        if missing:
            raise ValueError(
                f"{where}'s loaded state lacks {missing} (it has {sorted(state)}): the state comes "
                "from another optimizer class or other options (e.g. amsgrad)"
            )
    for key, value in state.items():
        kind = schema.get(key) if schema is not None else None
        if kind == "scalar":
            if isinstance(value, Tensor):
                if value.dim() != 0 or value.is_complex() or value.dtype == torch.bool:
                    raise ValueError(
                        f"{where}'s loaded state {key!r} is a tensor of shape "
                        f"{tuple(value.shape)} and dtype {value.dtype}; it holds one real number "
                        "per parameter (a 0-d tensor): the state belongs to another model"
                    )
                number = float(value.item())
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(
                    f"{where}'s loaded state {key!r} is a {type(value).__name__}; it must be a "
                    "number or a 0-d tensor"
                )
            else:
                number = float(value)
            if not math.isfinite(number) or (key == "step" and number < 0):
                raise ValueError(
                    f"{where}'s loaded state {key!r} is {number}; it must be finite (a step "
                    "count >= 0): the state is corrupt"
                )
            continue
        if not isinstance(value, Tensor):
            if kind == "elementwise":
                raise TypeError(
                    f"{where}'s loaded state {key!r} is a {type(value).__name__}; it must be a "
                    f"tensor of the parameter's shape {shape}"
                )
            continue
        if kind == "elementwise" or value.dim() > 0:
            if tuple(value.shape) != shape:
                raise ValueError(
                    f"{where} has shape {shape} but its loaded state {key!r} has shape "
                    f"{tuple(value.shape)}: the state belongs to another model or was edited"
                )
        if kind == "elementwise":
            ok = value.is_complex() if is_complex else value.is_floating_point()
            if not ok:
                raise TypeError(
                    f"{where}'s loaded state {key!r} has dtype {value.dtype}; it must be "
                    f"{'complex' if is_complex else 'floating point'} like the parameter"
                )


def check_hyperparameters(i: int, saved: Mapping[str, Any], current: Mapping[str, Any]) -> None:
    """A loaded group's hyperparameters must be of the kinds this optimizer's are: a number
    for a number, a flag for a flag, a pair for a pair (``lr="0.1"`` would fail mid-step); a
    group with its own class must have been saved with that class (or with none recorded).

    Example:
        >>> check_hyperparameters(0, {"lr": 0.1}, {"lr": 0.2, "params": []})
        >>> check_hyperparameters(0, {"lr": "0.1"}, {"lr": 0.2, "params": []})
        Traceback (most recent call last):
        ...
        TypeError: parameter group 0's loaded 'lr' is '0.1', but this optimizer's is 0.2: the state dict is of another optimizer class or was edited
        >>> check_hyperparameters(1, {"optimizer_class": "torch.optim.AdamW"},
        ...                       {"optimizer_class": "torch.optim.Muon"})
        Traceback (most recent call last):
        ...
        ValueError: parameter group 1 was saved for torch.optim.AdamW, but this optimizer runs it with torch.optim.Muon: load a state dict of the same classes
    """
    if (
        GROUP_CLASS_KEY in current
        and saved.get(GROUP_CLASS_KEY, current[GROUP_CLASS_KEY]) != (current[GROUP_CLASS_KEY])
    ):
        raise ValueError(
            f"parameter group {i} was saved for {saved[GROUP_CLASS_KEY]}, but this optimizer "
            f"runs it with {current[GROUP_CLASS_KEY]}: load a state dict of the same classes"
        )
    for key, now in current.items():
        if key in ("params", GROUP_CLASS_KEY) or key not in saved:
            continue
        value = saved[key]
        if isinstance(now, bool) or now is None:
            ok = value is None or isinstance(value, bool) or now is None
        elif isinstance(now, (int, float)) and not isinstance(now, bool):
            ok = isinstance(value, (int, float, Tensor)) and not isinstance(value, bool)
        elif isinstance(now, (tuple, list)):
            ok = isinstance(value, (tuple, list)) and len(value) == len(now)
        else:
            ok = True
        if not ok:
            raise TypeError(
                f"parameter group {i}'s loaded {key!r} is {value!r}, but this optimizer's is "
                f"{now!r}: the state dict is of another optimizer class or was edited"
            )


def validated_state(
    state_dict: Mapping[str, Any],
    param_groups: Sequence[Mapping[str, Any]],
    schemas: Sequence[StateSchema | None],
) -> dict[int, Mapping[str, Any]]:
    """The per-parameter state of a loaded state dict, keyed by global index, after every check.

    Checks the structure, the parameter counts per group, each group's hyperparameters against
    this optimizer's (:func:`check_hyperparameters`) and every parameter's state
    (:func:`check_param_state` with the group's schema); changes nothing. Saved parameter ids
    may be any keys (``torch.optim`` uses positions): they are mapped to global positions.

    Args:
        state_dict: ``{"state": ..., "param_groups": [...]}`` as ``state_dict()`` returns.
        param_groups: This optimizer's groups (with their ``params``).
        schemas: Per group, the state keys of the optimizer class, or ``None``.

    Raises:
        ValueError, TypeError: The first problem found, named.

    Example:
        >>> import torch
        >>> groups = [{"params": [torch.zeros(2)], "lr": 0.1}]
        >>> sd = {"state": {0: {"step": 1.0}}, "param_groups": [{"params": [0], "lr": 0.2}]}
        >>> validated_state(sd, groups, [{"step": "scalar"}])
        {0: {'step': 1.0}}
        >>> validated_state({"state": {}, "param_groups": []}, groups, [None])
        Traceback (most recent call last):
        ...
        ValueError: loaded state dict has 0 parameter groups, this optimizer has 1
    """
    if (
        not isinstance(state_dict, Mapping)
        or "state" not in state_dict
        or "param_groups" not in state_dict
    ):
        raise ValueError(
            "state_dict must be a dict with 'state' and 'param_groups' keys, as state_dict() returns"
        )
    saved_groups = state_dict["param_groups"]
    if not isinstance(saved_groups, Sequence) or not all(
        isinstance(s, Mapping) and isinstance(s.get("params"), Sequence) for s in saved_groups
    ):
        raise TypeError(
            "state_dict['param_groups'] must be a list of dicts, each with a 'params' list, "
            "as state_dict() returns"
        )
    if len(saved_groups) != len(param_groups):
        raise ValueError(
            f"loaded state dict has {len(saved_groups)} parameter groups, this optimizer has "
            f"{len(param_groups)}"
        )
    for i, (s, g) in enumerate(zip(saved_groups, param_groups)):
        if len(s["params"]) != len(g["params"]):
            raise ValueError(
                f"parameter group {i} has {len(g['params'])} parameters but the loaded state "
                f"dict's has {len(s['params'])}: the state belongs to another model"
            )
    starts = prefix_sums([len(g["params"]) for g in param_groups])
    group_of = [gi for gi, g in enumerate(param_groups) for _ in g["params"]]
    # Saved indices may be any ids (torch.optim uses positions); map them to our positions.
    index_of = {
        saved: start + j
        for s, start in zip(saved_groups, starts)
        for j, saved in enumerate(s["params"])
    }
    for i, (s, g) in enumerate(zip(saved_groups, param_groups)):
        check_hyperparameters(i, s, g)
    params = ParamTable.of(param_groups).params
    saved_state = state_dict["state"]
    if not isinstance(saved_state, Mapping):
        raise TypeError(
            f"state_dict['state'] is a {type(saved_state).__name__}, not a dict keyed by "
            "parameter index"
        )
    state: dict[int, Mapping[str, Any]] = {}
    for key, value in saved_state.items():
        if key not in index_of:
            raise ValueError(
                f"loaded state has an entry for parameter {key!r}, which no group lists"
            )
        index = index_of[key]
        p = params[index]
        check_param_state(
            f"parameter {index}",
            value,
            tuple(p.shape),
            is_complex=p.is_complex(),
            schema=schemas[group_of[index]],
        )
        state[index] = value
    return state


def to_cpu(state: Mapping[str, object]) -> dict[str, object]:
    """A copy of ``state`` with every tensor on the CPU (what travels to a consolidating rank).

    Example:
        >>> import torch
        >>> to_cpu({"step": torch.tensor(2.0), "lr": 0.1})
        {'step': tensor(2.), 'lr': 0.1}
    """
    return {
        k: v.detach().to("cpu", copy=True) if isinstance(v, Tensor) else v for k, v in state.items()
    }


def merge_shards(
    shards: Sequence[Mapping[int, tuple[Range, Mapping[str, object]]]],
    shapes: Sequence[Sequence[int]],
) -> dict[int, dict[str, object]]:
    """Each parameter's whole state, in its own shape, from every rank's pieces (pure).

    Args:
        shards: Per rank, global index -> (the piece's range, the piece's state).
        shapes: Each parameter's shape, by global index.

    Raises:
        RuntimeError: A parameter's pieces do not cover it (some ranks stepped it, others not).

    Example:
        >>> import torch
        >>> a = {0: ((0, 2), {"momentum_buffer": torch.tensor([1.0, 2.0])})}
        >>> b = {0: ((2, 4), {"momentum_buffer": torch.tensor([3.0, 4.0])})}
        >>> merge_shards([b, a], [(2, 2)])[0]["momentum_buffer"]
        tensor([[1., 2.],
                [3., 4.]])
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


def placed(
    key: str,
    value: object,
    param: Tensor,
    *,
    fp32_step: bool,
    copy: bool,
    dtype: torch.dtype | None = None,
) -> object:
    """Where a loaded or moved state value lives: torch's rule (floating values in the
    parameter's dtype, everything on its device), except that ``step`` is float32 on the
    parameter's device where ``fp32_step`` (the functional core, fused or capturable groups:
    the fused kernels need it there; torch's CPU step: pytorch#124133), and floating values are
    in ``dtype`` where given (a parameter updated through a main copy of that dtype);
    ``copy=False`` keeps a tensor that is already in place.

    Example:
        >>> import torch
        >>> p = torch.zeros(2, dtype=torch.float64)
        >>> placed("exp_avg", torch.ones(2), p, fp32_step=True, copy=True).dtype
        torch.float64
        >>> placed("step", torch.tensor(3), p, fp32_step=True, copy=True).dtype
        torch.float32
    """
    if not isinstance(value, Tensor):
        return value
    if key == "step":
        if fp32_step:
            return value.detach().to(device=param.device, dtype=torch.float32, copy=copy)
        return value.detach().clone() if copy else value.detach()
    if value.is_floating_point():
        return value.detach().to(device=param.device, dtype=dtype or param.dtype, copy=copy)
    return value.detach().to(device=param.device, copy=copy)


PARTIAL_KEY = "zero_partial"
"""The key that marks a rank's :meth:`ZeroRedundancyOptimizer.state_dict` after consolidation
onto another rank: full ``param_groups``, no state; ``load_state_dict`` refuses it."""


def not_consolidated_message(rank: int) -> str:
    """What ``state_dict()`` says when the state changed since the last consolidation: torch's
    words, then the fix for the training framework in use (judged by what is imported).

    Example:
        >>> not_consolidated_message(1).startswith(
        ...     "Optimizer state has not been consolidated on this rank")
        True
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
    shards: Sequence[Mapping[int, tuple[Range, Mapping[str, object]]]],
    *,
    updates: int,
    consolidated_at: int | None,
    rank: int,
) -> dict[str, Any]:
    """What ``ZeroRedundancyOptimizer.state_dict()`` returns on ``rank`` (pure).

    Args:
        param_groups: The optimizer's groups.
        shards: Every rank's shard as the last consolidation onto this rank gathered them (see
            :func:`merge_shards`); empty where none was gathered here.
        updates: How often this rank's state has changed (steps and loads).
        consolidated_at: ``updates`` at the last consolidation (``None``: none ran).
        rank: This rank, for the message.

    Raises:
        RuntimeError: The state changed since the last consolidation (or none ran).

    Example:
        >>> import torch
        >>> groups = [{"params": [torch.zeros(2)], "lr": 0.1}]
        >>> rank_state_dict(groups, [], updates=0, consolidated_at=None, rank=0)
        {'state': {}, 'param_groups': [{'lr': 0.1, 'params': [0]}]}
        >>> shard = {0: ((0, 2), {"momentum_buffer": torch.ones(2)})}
        >>> rank_state_dict(groups, [shard], updates=1, consolidated_at=1, rank=0)["state"]
        {0: {'momentum_buffer': tensor([1., 1.])}}
    """
    starts = prefix_sums([len(g["params"]) for g in param_groups])
    groups = [
        {
            **{k: v for k, v in g.items() if k != "params"},
            "params": list(range(a, a + len(g["params"]))),
        }
        for g, a in zip(param_groups, starts)
    ]
    if updates == 0 and not shards:
        return {"state": {}, "param_groups": groups}
    if consolidated_at != updates:
        raise RuntimeError(not_consolidated_message(rank))
    if not shards:
        return {"state": {}, "param_groups": groups, PARTIAL_KEY: True}
    shapes = [tuple(p.shape) for p in ParamTable.of(param_groups).params]
    return {"state": merge_shards(shards, shapes), "param_groups": groups}


class Consolidation:
    """How often this rank's state changed, and what the last consolidation gathered here: all
    ``state_dict()`` needs to answer without a collective (:func:`rank_state_dict`).

    Example:
        >>> import torch
        >>> groups = [{"params": [torch.zeros(2)], "lr": 0.1}]
        >>> book = Consolidation()
        >>> book.state_dict(groups, rank=0)["state"]
        {}
        >>> book.changed()
        >>> book.gathered([{0: ((0, 2), {"momentum_buffer": torch.ones(2)})}])
        >>> book.state_dict(groups, rank=0)["state"]
        {0: {'momentum_buffer': tensor([1., 1.])}}
    """

    def __init__(self) -> None:
        self.updates = 0
        self.consolidated_at: int | None = None
        self.shards: list[Mapping[int, tuple[Range, Mapping[str, object]]]] = []

    def changed(self) -> None:
        """This rank's state changed (a step or a load)."""
        self.updates += 1

    def gathered(self, shards: Sequence[Mapping[int, tuple[Range, Mapping[str, object]]]]) -> None:
        """A consolidation ran: ``shards`` are every rank's on its target rank, none elsewhere."""
        self.shards = list(shards)
        self.consolidated_at = self.updates

    def state_dict(self, param_groups: Sequence[Mapping[str, Any]], rank: int) -> dict[str, Any]:
        """:func:`rank_state_dict` as of now."""
        return rank_state_dict(
            param_groups,
            self.shards,
            updates=self.updates,
            consolidated_at=self.consolidated_at,
            rank=rank,
        )


def check_shard_state(
    state: Mapping[int, Mapping[str, Any]],
    saved_groups: Sequence[Mapping[str, Any]],
    groups: Sequence[Mapping[str, Any]],
    pieces: Mapping[int, tuple[Any, Tensor]],
    schemas: Sequence[StateSchema | None],
) -> None:
    """Check one rank's piece states before any is installed (pure).

    Args:
        state: Global index -> the state of this rank's piece of that parameter.
        saved_groups: The groups' saved hyperparameters.
        groups: The optimizer's groups.
        pieces: Global index -> (the piece this rank owns, with ``start``/``stop``; the parameter).
        schemas: Each parameter's state schema (``None``: not elementwise, unchecked keys).

    Raises:
        ValueError: Another number of groups, or a value that does not fit its piece.
        TypeError: A value of the wrong type.

    Example:
        >>> import torch
        >>> from zero_functional.core.partition import Piece
        >>> p = torch.zeros(4)
        >>> check_shard_state({0: {"momentum_buffer": torch.zeros(2)}}, [{}], [{}],
        ...                   {0: (Piece(0, 0, 2, 4), p)}, [{"momentum_buffer": "elementwise"}])
    """
    if len(saved_groups) != len(groups):
        raise ValueError(
            f"the loaded state has {len(saved_groups)} parameter groups, this optimizer "
            f"has {len(groups)}: the state belongs to another model"
        )
    for i, (saved, group) in enumerate(zip(saved_groups, groups)):
        check_hyperparameters(i, saved, group)
    for k, value in state.items():
        piece, param = pieces[k]
        check_param_state(
            f"parameter {k} (this rank's piece [{piece.start}, {piece.stop}))",
            value,
            tuple(param.shape) if piece.is_whole else (piece.stop - piece.start,),
            is_complex=param.is_complex(),
            schema=schemas[k],
        )
