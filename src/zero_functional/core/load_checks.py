"""Checks of a loaded state dict before anything is installed (pure): its structure, each
group's hyperparameters, and each parameter's (or piece's) state against the optimizer's keys."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from zero_functional.core._validate import prefix_sums
from zero_functional.core.param_table import ParamTable
from zero_functional.functional.registry import GROUP_CLASS_KEY

__all__ = [
    "StateSchema",
    "check_hyperparameters",
    "check_param_state",
    "check_shard_state",
    "validated_state",
]


StateSchema = Mapping[str, str]
"""Per state key, ``"elementwise"`` (one entry per element of the parameter) or ``"scalar"``
(one value per parameter: a number or a 0-d tensor), as one step of the optimizer makes it."""


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
