"""The keys of a checkpoint's items, and plain dicts from a ``dcp_to_torch_save`` file of one.

Example:
    >>> model_key("0.weight"), state_key("0.weight", "exp_avg"), ema_key("0.weight")
    ('model.0.weight', 'state.0.weight.exp_avg', 'ema.0.weight')
    >>> split_state_key("state.0.weight.exp_avg"), split_state_key("model.0.weight")
    (('0.weight', 'exp_avg'), None)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from zero_functional.checkpoint.storage import CheckpointError

MODEL_PREFIX, STATE_PREFIX, EMA_PREFIX = "model.", "state.", "ema."


def model_key(name: str) -> str:
    """The key of the model tensor ``name`` (see the module's example)."""
    return MODEL_PREFIX + name


def state_key(name: str, key: str) -> str:
    """The key of the optimizer state ``key`` (which has no dot) of the parameter ``name``."""
    return f"{STATE_PREFIX}{name}.{key}"


def ema_key(name: str) -> str:
    """The key of the EMA of the parameter ``name``."""
    return EMA_PREFIX + name


def split_state_key(key: str) -> tuple[str, str] | None:
    """The parameter name and state key of an optimizer state item; ``None`` for another item."""
    if not key.startswith(STATE_PREFIX):
        return None
    name, _, rest = key[len(STATE_PREFIX) :].rpartition(".")
    return (name, rest) if name else None


def model_state_dict(flat: Mapping[str, Any]) -> dict[str, Any]:
    """The model's ``state_dict`` from a ``dcp_to_torch_save`` file of a checkpoint.

    Example:
        >>> model_state_dict({"model.w": 1, "state.w.step": 2, "extra": None})
        {'w': 1}
    """
    return {k[len(MODEL_PREFIX) :]: v for k, v in flat.items() if k.startswith(MODEL_PREFIX)}


def optimizer_state_dict(flat: Mapping[str, Any]) -> dict[str, Any]:
    """A ``torch.optim`` state dict from a ``dcp_to_torch_save`` file, numbered as torch numbers.

    Example:
        >>> optimizer_state_dict({"state.w.step": 3, "param_groups": [{"params": ["w"]}]})
        {'state': {0: {'step': 3}}, 'param_groups': [{'params': [0]}]}
    """
    groups = flat["param_groups"]
    index = {name: i for i, name in enumerate(name for g in groups for name in g["params"])}
    state: dict[int, dict[str, Any]] = {}
    for key, value in flat.items():
        if (split := split_state_key(key)) is not None:
            state.setdefault(index[split[0]], {})[split[1]] = value
    return {
        "state": state,
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in groups],
    }


def check_groups(saved: object, expected: Sequence[Sequence[str]]) -> list[dict[str, Any]]:
    """The saved ``param_groups``, checked to list the parameters ``expected`` group by group
    (else :class:`CheckpointError`: another model, or another group order).

    Example:
        >>> check_groups([{"lr": 0.1, "params": ["w"]}], [["w"]])
        [{'lr': 0.1, 'params': ['w']}]
    """
    listed = [list(names) for names in expected]
    if not isinstance(saved, list) or [g.get("params") for g in saved] != listed:
        raise CheckpointError(
            "the checkpoint's parameter groups list other parameters than the optimizer's: "
            "it belongs to another model (or the groups were built in another order)"
        )
    return saved
