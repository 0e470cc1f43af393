"""Checks of what users pass in (pure): parameters, class, partition, devices, hyperparameters.

Every check raises before anything is built or changed, with a message that names the fix."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch
from torch import Tensor
from torch.optim import Optimizer

from zero_functional.core.classes import (
    check_group_classes,
    check_hyperparameter_types,
    is_mixed,
    split_items,
)
from zero_functional.core.layout import check_splittable
from zero_functional.core.ownership import check_partition
from zero_functional.functional import update_kind


def check_params(params: object) -> list[Any]:
    """The parameters (or groups, each ``params`` read into a list) after torch's checks and
    ours: dense, floating, each tensor once.

    Example:
        >>> len(check_params([torch.zeros(2)]))
        1
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
        for i, g in enumerate(items):
            if "params" not in g:
                raise ValueError(f"parameter group {i} has no 'params' key")
            # a generator (model.parameters()) is read once, here: keep what it gave
            items[i] = {**g, "params": param_tensors([g])}
    elif not all(isinstance(p, Tensor) for p in items):
        bad = next(p for p in items if not isinstance(p, Tensor | dict))
        raise TypeError(
            "params must be all Tensors or all parameter-group dicts, but got a "
            f"{type(bad).__name__}"
        )
    tensors: list[Any] = param_tensors(items)
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
    """The tensors of a parameter list (tensors, or group dicts with ``params``).

    Example:
        >>> t = torch.zeros(1)
        >>> param_tensors([{"params": [t]}, {"params": t}]) == [t, t]
        True
    """
    out: list[Tensor] = []
    for item in items:
        ps = item if isinstance(item, Tensor) else item["params"]
        out.extend([ps] if isinstance(ps, Tensor) else ps)
    return out


def check_devices(tensors: Sequence[Tensor], backend: str) -> None:
    """A ValueError unless ``backend`` can move every parameter (no meta tensors, CUDA for NCCL).

    Example:
        >>> check_devices([torch.zeros(1)], "gloo")
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
    """A ValueError unless ``optimizer_class``'s update kind (``OPTIMIZER_KINDS``) runs where the
    options put it: elementwise under ``"flat"``, no closure in overlap mode.

    Example:
        >>> check_update_kind(torch.optim.Adam, "flat", overlap=False)
    """
    kind = update_kind(optimizer_class)
    name = optimizer_class.__name__
    if overlap and kind == "closure":
        raise ValueError(
            f"{name} is registered as 'closure': its step re-evaluates the model through a "
            "closure, which cannot run inside DDP's backward. Use overlap_with_ddp=False and "
            "call step(closure) at world size 1 (see check_world_size), or an optimizer "
            "without a closure"
        )
    if partition == "flat" and kind != "elementwise":
        raise ValueError(
            f"{name} is registered as {kind!r}, not 'elementwise': its update needs whole "
            "tensors, which partition='flat' splits across ranks. Use partition='sorted_greedy', "
            "or, if its update is elementwise, declare it with "
            f"zero_functional.functional.register_optimizer({name}, 'elementwise')"
        )


def check_world_size(optimizer_class: type, world_size: int) -> None:
    """A ValueError where a ``"closure"`` class (LBFGS) would be sharded: each rank would search
    on its own tensors, calling the closure (and its collectives) a different number of times.

    Example:
        >>> check_world_size(torch.optim.LBFGS, 1)
    """
    if world_size > 1 and update_kind(optimizer_class) == "closure":
        name = optimizer_class.__name__
        raise ValueError(
            f"{name} is registered as 'closure' and cannot be sharded over {world_size} ranks: "
            f"each rank would run its own {name} on its own parameters (its own direction and "
            "line search, not DDP + "
            f"{name}'s over all of them) and call the closure a different number of times, "
            "so the collectives in it would not pair up. Step torch.optim."
            f"{name} itself on every rank (its state is small), or use an optimizer without a "
            "closure; at world size 1 ZeroRedundancyOptimizer runs it as the plain class"
        )


def check_inputs(
    params: object,
    optimizer_class: object,
    partition: object,
    overlap_with_ddp: bool,
    defaults: dict[str, Any],
) -> tuple[list[Any], Optimizer]:
    """Every local check of ``ZeroRedundancyOptimizer``'s arguments, the likeliest mistake
    first; the parameters as a list and a probe instance of the class (whose ``defaults`` are
    all of the class's, so that ``param_groups`` carry every key torch's would).

    Example:
        >>> items, probe = check_inputs([torch.zeros(2)], torch.optim.SGD, "flat", False, {"lr": 0.1})
        >>> len(items), probe.defaults["momentum"]
        (1, 0)
    """
    items = check_params(params)
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
        raise TypeError(
            f"optimizer_class must be a torch.optim.Optimizer subclass, got {optimizer_class!r}"
        )
    name = check_partition(partition)
    mixed = is_mixed(items)
    # with classes per group, a per-tensor class's groups are owned whole under "flat" too
    check_update_kind(optimizer_class, "sorted_greedy" if mixed else name, overlap_with_ddp)
    check_hyperparameter_types(optimizer_class, defaults)
    if mixed:
        check_group_classes(items, optimizer_class)
    if name == "flat":
        check_splittable(param_tensors(split_items(items, optimizer_class)))
    # a 1x1 placeholder: classes for matrices (Muon) take it too
    return items, optimizer_class([torch.nn.Parameter(torch.zeros(1, 1))], **defaults)


def check_new_group(
    param_group: object,
    backend: str,
    partition: str,
    default: type[Optimizer] = Optimizer,
    index: int = 0,
) -> None:
    """The local checks of a group given to ``add_param_group`` as group ``index``.

    Example:
        >>> check_new_group({"params": [torch.zeros(2)]}, "gloo", "flat")
    """
    items = check_params([param_group])
    check_devices(param_tensors(items), backend)
    if is_mixed(items):
        check_group_classes(items, default, index)
    if partition == "flat":
        check_splittable(param_tensors(split_items(items, default)))


def warn_ignored_bucket_view(overlap_with_ddp: bool, parameters_as_bucket_view: bool) -> None:
    """A warning that ``parameters_as_bucket_view`` is ignored in overlap mode (torch's rule).

    Example:
        >>> warn_ignored_bucket_view(overlap_with_ddp=False, parameters_as_bucket_view=True)
    """
    if overlap_with_ddp and parameters_as_bucket_view:
        logging.getLogger("zero_functional.optimizer").warning(
            "parameters_as_bucket_view=True is ignored when overlap_with_ddp=True: "
            "parameters are grouped by DDP's gradient buckets instead"
        )
