"""Checks of what users pass in: parameter lists, devices, and the fingerprint ranks compare (pure).

Every check raises before anything is built or changed, with a message that names the fix.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch
from torch import Tensor

from zero_functional.functional import update_kind

__all__ = [
    "check_devices",
    "check_hyperparameter_types",
    "check_params",
    "check_update_kind",
    "fingerprint",
    "param_tensors",
]


def check_params(params: object) -> list[Any]:
    """The parameters (or groups) as a list, after torch's checks and ours.

    Raises:
        TypeError: Not an iterable of tensors or group dicts, or a non-tensor parameter.
        ValueError: No parameters, a group without ``params``, a sparse or non-floating
            parameter, or one tensor listed twice.

    Example:
        >>> w = torch.zeros(2)
        >>> len(check_params([w]))
        1
        >>> check_params([w, w])
        Traceback (most recent call last):
        ...
        ValueError: parameters 0 and 1 are the same tensor: it would be sharded and updated twice; pass each parameter once (e.g. list(dict.fromkeys(params)))
    """
    if isinstance(params, dict):
        raise TypeError(
            "params argument should be an iterable of Tensors or dicts, but got a dict (keys "
            f"{list(params)[:3]!r}...): pass model.parameters(), or a list of parameter groups: "
            "[{'params': ..., 'lr': ...}]; for named parameters, pass their values"
        )
    if isinstance(params, Tensor):
        raise TypeError(
            "params argument should be an iterable of Tensors or dicts, but got "
            f"{torch.typename(params)}; wrap it in a list: [tensor]"
        )
    try:
        items = list(cast(Iterable[Any], params))
    except TypeError as e:
        raise TypeError(
            f"params argument should be an iterable of Tensors or dicts, but got {type(params).__name__}"
        ) from e
    if not items:
        hint = (
            ": it is an exhausted iterator (model.parameters() can be read only once; pass "
            "list(model.parameters()) to read it twice)"
            if iter(cast(Iterable[Any], params)) is params
            else ""
        )
        raise ValueError(f"ZeroRedundancyOptimizer got an empty parameter list{hint}")
    if all(isinstance(p, dict) for p in items):
        tensors: list[Any] = []
        for i, g in enumerate(items):
            if "params" not in g:
                raise ValueError(f"parameter group {i} has no 'params' key")
            ps = g["params"]
            # a generator (model.parameters()) is read once, here: keep what it gave
            items[i] = {**g, "params": [ps] if isinstance(ps, Tensor) else list(ps)}
            tensors.extend(items[i]["params"])
    elif all(isinstance(p, Tensor) for p in items):
        tensors = items
    else:
        bad = next(p for p in items if not isinstance(p, Tensor | dict))
        raise TypeError(
            "params must be all Tensors or all parameter-group dicts, but got a "
            f"{type(bad).__name__}"
        )
    seen: dict[int, int] = {}
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise TypeError(f"parameter {i} is a {type(t).__name__}, not a Tensor")
        if id(t) in seen:
            raise ValueError(
                f"parameters {seen[id(t)]} and {i} are the same tensor: it would be sharded and "
                "updated twice; pass each parameter once (e.g. list(dict.fromkeys(params)))"
            )
        seen[id(t)] = i
        if t.is_sparse or t.layout != torch.strided:
            raise ValueError(
                f"parameter {i} is sparse ({t.layout}); ZeroRedundancyOptimizer shards dense "
                "parameters only: keep sparse embeddings out of it and give them their own "
                "optimizer (e.g. torch.optim.SparseAdam)"
            )
        if not (t.is_floating_point() or t.is_complex()):
            dtypes = sorted({str(x.dtype).removeprefix("torch.") for x in tensors})
            raise ValueError(
                f"parameters have dtypes {', '.join(dtypes)}; parameter {i} is "
                f"{str(t.dtype).removeprefix('torch.')}, which "
                "no optimizer can update: pass only floating-point parameters, or freeze this "
                "one outside the optimizer"
            )
    return items


def param_tensors(items: Sequence[Any]) -> list[Tensor]:
    """The tensors of a checked parameter list (tensors, or group dicts with ``params``).

    Example:
        >>> t = torch.zeros(1)
        >>> param_tensors([{"params": [t]}, {"params": t}]) == [t, t]
        True
    """
    out: list[Tensor] = []
    for item in items:
        if isinstance(item, Tensor):
            out.append(item)
        else:
            ps = item["params"]
            out.extend([ps] if isinstance(ps, Tensor) else list(ps))
    return out


def check_hyperparameter_types(optimizer_class: type, defaults: dict[str, Any]) -> None:
    """Each hyperparameter whose default in ``optimizer_class`` is a number is a number (or a
    tensor), and each tuple of numbers a tuple of numbers, before torch compares it.

    Raises:
        TypeError: Names the hyperparameter, what it must be and what it got.

    Example:
        >>> check_hyperparameter_types(torch.optim.Adam, {"lr": 1e-3, "betas": (0.9, 0.99)})
        >>> check_hyperparameter_types(torch.optim.Adam, {"lr": "abc"})
        Traceback (most recent call last):
        ...
        TypeError: Adam's hyperparameter lr must be a number (or a Tensor), got str 'abc'
    """
    try:
        signature = inspect.signature(optimizer_class)
    except (TypeError, ValueError):
        return

    def numeric(v: object) -> bool:
        return isinstance(v, int | float | Tensor) and not isinstance(v, bool)

    for name, value in defaults.items():
        parameter = signature.parameters.get(name)
        default = parameter.default if parameter is not None else inspect.Parameter.empty
        where = f"{optimizer_class.__name__}'s hyperparameter {name}"
        if numeric(default) and not numeric(value):
            raise TypeError(
                f"{where} must be a number (or a Tensor), got {type(value).__name__} {value!r}"
            )
        if (
            isinstance(default, tuple)
            and default
            and all(numeric(d) for d in default)
            and not (isinstance(value, tuple | list) and all(numeric(v) for v in value))
        ):
            raise TypeError(
                f"{where} must be a tuple of {len(default)} numbers like {default!r}, got "
                f"{type(value).__name__} {value!r}"
            )


def check_devices(tensors: Sequence[Tensor], backend: str) -> None:
    """Every parameter on a device the backend moves: no meta tensors, CUDA for NCCL.

    Raises:
        ValueError: The first parameter the backend cannot move, and what to do.

    Example:
        >>> check_devices([torch.zeros(1)], "gloo")
        >>> check_devices([torch.zeros(1, device="meta")], "gloo")
        Traceback (most recent call last):
        ...
        ValueError: parameter 0 is on the meta device (it has no data); materialise the model first (e.g. model.to_empty(device=...) and initialise it) before building the optimizer
    """
    for i, t in enumerate(tensors):
        kind = t.device.type
        if kind == "meta":
            raise ValueError(
                f"parameter {i} is on the meta device (it has no data); materialise the model "
                "first (e.g. model.to_empty(device=...) and initialise it) before building the "
                "optimizer"
            )
        if "nccl" in backend.lower() and kind != "cuda":
            raise ValueError(
                f"parameter {i} is on {t.device}, but the process group's backend is NCCL, "
                "which moves CUDA tensors only: move the model to the GPU, or use gloo"
            )
        if "gloo" in backend.lower() and kind not in ("cpu", "cuda"):
            raise ValueError(
                f"parameter {i} is on {t.device}, which the gloo backend cannot move: put the "
                "parameters on the CPU (or CUDA), or use the backend for that device"
            )


def check_update_kind(optimizer_class: type, partition: str, overlap: bool) -> None:
    """Whether ``optimizer_class`` can run where the options put it (see ``OPTIMIZER_KINDS``).

    Raises:
        ValueError: A class that needs whole tensors under ``partition="flat"``, or a closure
            in overlap mode, naming the class and what to do instead.

    Example:
        >>> check_update_kind(torch.optim.Adam, "flat", overlap=False)
        >>> check_update_kind(torch.optim.LBFGS, "flat", overlap=False)
        Traceback (most recent call last):
        ...
        ValueError: LBFGS is registered as 'closure', not 'elementwise': its update needs whole tensors, which partition='flat' splits across ranks. Use partition='sorted_greedy', or, if its update is elementwise, declare it with zero_functional.functional.register_optimizer(LBFGS, 'elementwise')
    """
    kind = update_kind(optimizer_class)
    name = optimizer_class.__name__
    if overlap and kind == "closure":
        raise ValueError(
            f"{name} is registered as 'closure': its step re-evaluates the model through a "
            "closure, which cannot run inside DDP's backward. Use overlap_with_ddp=False and "
            "call step(closure), or an optimizer without a closure"
        )
    if partition == "flat" and kind != "elementwise":
        raise ValueError(
            f"{name} is registered as {kind!r}, not 'elementwise': its update needs whole "
            "tensors, which partition='flat' splits across ranks. Use partition='sorted_greedy', "
            "or, if its update is elementwise, declare it with "
            f"zero_functional.functional.register_optimizer({name}, 'elementwise')"
        )


def fingerprint(items: Sequence[Any]) -> list[int]:
    """Count, elements and a hash of every parameter's shape, dtype and device type, by group:
    what every rank must agree on (a fp32 and a fp64 model of equal size differ here).

    Example:
        >>> a = fingerprint([torch.zeros(3)])  # a list of tensors, or of param groups
        >>> b = fingerprint([{"params": [torch.zeros(3, dtype=torch.float64)]}])
        >>> a[:3] == b[:3], a[3] == b[3]
        (True, False)
    """
    if items and all(isinstance(item, Tensor) for item in items):
        groups = [list(items)]
    else:
        groups = [param_tensors([item]) for item in items]
    described = repr([[(tuple(p.shape), str(p.dtype), p.device.type) for p in g] for g in groups])
    digest = int.from_bytes(hashlib.blake2b(described.encode(), digest_size=7).digest(), "big")
    params = [p for g in groups for p in g]
    return [len(groups), len(params), sum(p.numel() for p in params), digest]
