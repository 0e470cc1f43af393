"""Checks of a loaded state dict before anything is installed (pure): its structure, each
group's hyperparameters, and each parameter's (or piece's) state against the optimizer's keys."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from zero_functional.core.param_table import ParamTable
from zero_functional.core.partition import Piece
from zero_functional.functional.registry import GROUP_CLASS_KEY

StateSchema = Mapping[str, str]
"""Per state key one step of the optimizer makes, ``"elementwise"`` or ``"scalar"`` (a number
or a 0-d tensor per parameter)."""


def check_param_state(
    where: str,
    state: object,
    shape: Sequence[int],
    *,
    is_complex: bool = False,
    schema: StateSchema | None = None,
) -> None:
    """A ValueError or TypeError naming the problem unless ``state`` fits the parameter
    ``where`` of ``shape``: empty (not stepped yet), or with every key of ``schema``, elementwise
    values floating (complex) tensors of the shape, scalars real numbers; without a schema, the
    shapes of tensors that are not 0-d.

    Example:
        >>> schema = {"step": "scalar", "exp_avg": "elementwise"}
        >>> check_param_state("parameter 0", {"step": 1, "exp_avg": torch.zeros(2)}, (2,), schema=schema)
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
    if missing := sorted(set(schema or {}) - set(state)):
        raise ValueError(
            f"{where}'s loaded state lacks {missing} (it has {sorted(state)}): the state comes "
            "from another optimizer class or other options (e.g. amsgrad)"
        )
    for key, value in state.items():
        kind = (schema or {}).get(key)
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
        if (kind == "elementwise" or value.dim() > 0) and tuple(value.shape) != shape:
            raise ValueError(
                f"{where} has shape {shape} but its loaded state {key!r} has shape "
                f"{tuple(value.shape)}: the state belongs to another model or was edited"
            )
        floating = value.is_complex() if is_complex else value.is_floating_point()
        if kind == "elementwise" and not floating:
            raise TypeError(
                f"{where}'s loaded state {key!r} has dtype {value.dtype}; it must be "
                f"{'complex' if is_complex else 'floating point'} like the parameter"
            )


def check_groups(
    saved_groups: Sequence[Mapping[str, Any]], groups: Sequence[Mapping[str, Any]]
) -> None:
    """The loaded groups, as many as this optimizer's, each with hyperparameters of the kinds
    its are (a number for a number, a flag for a flag, a pair for a pair) and its own class.

    Example:
        >>> check_groups([{"lr": 0.1}], [{"lr": 0.2, "params": []}])
        >>> check_groups([{"lr": "0.1"}], [{"lr": 0.2, "params": []}])
        Traceback (most recent call last):
        ...
        TypeError: parameter group 0's loaded 'lr' is '0.1', but this optimizer's is 0.2: the state dict is of another optimizer class or was edited
    """
    if len(saved_groups) != len(groups):
        raise ValueError(
            f"loaded state dict has {len(saved_groups)} parameter groups, this optimizer has "
            f"{len(groups)}: the state belongs to another model"
        )
    for i, (saved, current) in enumerate(zip(saved_groups, groups)):
        own = current.get(GROUP_CLASS_KEY)
        if own is not None and saved.get(GROUP_CLASS_KEY, own) != own:
            raise ValueError(
                f"parameter group {i} was saved for {saved[GROUP_CLASS_KEY]}, but this optimizer "
                f"runs it with {own}: load a state dict of the same classes"
            )
        for key, now in current.items():
            if key in ("params", GROUP_CLASS_KEY) or key not in saved:
                continue
            value = saved[key]
            if isinstance(now, bool) or now is None:
                ok = value is None or isinstance(value, bool) or now is None
            elif isinstance(now, (int, float)):
                ok = isinstance(value, (int, float, Tensor)) and not isinstance(value, bool)
            elif isinstance(now, (tuple, list)):
                ok = isinstance(value, (tuple, list)) and len(value) == len(now)
            else:
                ok = True
            if not ok:
                raise TypeError(
                    f"parameter group {i}'s loaded {key!r} is {value!r}, but this optimizer's "
                    f"is {now!r}: the state dict is of another optimizer class or was edited"
                )


def validated_state(
    state_dict: Mapping[str, Any],
    param_groups: Sequence[Mapping[str, Any]],
    schemas: Sequence[StateSchema | None],
) -> dict[int, Mapping[str, Any]]:
    """The per-parameter state of a loaded state dict by global index (its saved ids may be
    any keys), after every check (:func:`check_groups`, :func:`check_param_state` with each
    group's schema); changes nothing.

    Example:
        >>> groups = [{"params": [torch.zeros(2)], "lr": 0.1}]
        >>> sd = {"state": {0: {"step": 1.0}}, "param_groups": [{"params": [0], "lr": 0.2}]}
        >>> validated_state(sd, groups, [{"step": "scalar"}])
        {0: {'step': 1.0}}
    """
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= state_dict.keys():
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
    check_groups(saved_groups, param_groups)
    table = ParamTable.of(param_groups)
    for i, (s, (_, n)) in enumerate(zip(saved_groups, table.spans)):
        if len(s["params"]) != n:
            raise ValueError(
                f"parameter group {i} has {n} parameters but the loaded state "
                f"dict's has {len(s['params'])}: the state belongs to another model"
            )
    index_of = {
        saved: start + j
        for s, (start, _) in zip(saved_groups, table.spans)
        for j, saved in enumerate(s["params"])
    }
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
        k = index_of[key]
        p, schema = table.params[k], schemas[table.group_of(k)]
        check_param_state(
            f"parameter {k}", value, p.shape, is_complex=p.is_complex(), schema=schema
        )
        state[k] = value
    return state


def check_shard_state(
    state: Mapping[int, Mapping[str, Any]],
    saved_groups: Sequence[Mapping[str, Any]],
    groups: Sequence[Mapping[str, Any]],
    pieces: Mapping[int, tuple[Piece, Tensor]],
    schemas: Sequence[StateSchema | None],
) -> None:
    """:func:`check_groups`, then each of this rank's piece states (global index -> state;
    ``pieces``: index -> its piece and parameter; ``schemas``: per parameter).

    Example:
        >>> from zero_functional.core.partition import Piece
        >>> pieces, schemas = {0: (Piece(0, 0, 2, 4), torch.zeros(4))}, [{"v": "elementwise"}]
        >>> check_shard_state({0: {"v": torch.zeros(2)}}, [{}], [{}], pieces, schemas)
    """
    check_groups(saved_groups, groups)
    for k, value in state.items():
        piece, param = pieces[k]
        check_param_state(
            f"parameter {k} (this rank's piece [{piece.start}, {piece.stop}))",
            value,
            tuple(param.shape) if piece.is_whole else (piece.numel,),
            is_complex=param.is_complex(),
            schema=schemas[k],
        )
