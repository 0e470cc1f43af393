"""Checks of what users pass in: parameter lists, devices, and the fingerprint ranks compare (pure).

Every check raises before anything is built or changed, with a message that names the fix.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor
from torch.optim import Optimizer

from zero_functional.core.ownership import check_partition, check_splittable
from zero_functional.functional import IGNORED_GROUP_KEYS, update_kind
from zero_functional.functional.registry import (
    GROUP_CLASS_KEY,
    optimizer_by_name,
    optimizer_name,
    update_block,
)

__all__ = [
    "agreement_verdict",
    "check_devices",
    "check_group_classes",
    "check_hyperparameter_types",
    "check_inputs",
    "check_new_group",
    "check_unfrozen",
    "check_params",
    "check_update_kind",
    "check_world_size",
    "fingerprint",
    "grad_checksums",
    "group_class",
    "is_mixed",
    "own_class_group",
    "param_blocks",
    "param_tensors",
    "split_items",
    "unaveraged",
    "unfrozen_error",
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
        # numbers.Real: numpy's scalars too, which torch's own comparisons accept
        return isinstance(v, numbers.Real | Tensor) and not isinstance(v, bool)

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
    """Whether ``optimizer_class`` can be sharded over ``world_size`` ranks: a ``"closure"``
    class (LBFGS) runs at world size 1 only.

    Sharded, each rank's instance would see only its own tensors: its search direction and line
    search would be its own (not DDP + LBFGS's, which steps every rank along one direction over
    all parameters), and the ranks would call the closure different numbers of times, so the
    collectives in it (DDP's backward) would not pair up and hang.

    Raises:
        ValueError: A closure class over more than one rank, naming why and what to use.

    Example:
        >>> check_world_size(torch.optim.LBFGS, 1)
        >>> check_world_size(torch.optim.LBFGS, 2)
        Traceback (most recent call last):
        ...
        ValueError: LBFGS is registered as 'closure' and cannot be sharded over 2 ranks: ...
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


def agreement_verdict(
    call: str, problem: Exception | None, everyone: Sequence[object]
) -> Exception | None:
    """What a rank raises once every rank's check result is known (pure).

    Each rank contributes ``(error type name, message)`` when its own checks failed, else its
    :func:`fingerprint`. This rank's own problem comes first; else another rank's, named; else,
    if the fingerprints differ, one error listing the first ranks' (at most 4, so the message
    stays short at any world size) and how many differ.

    Example:
        >>> agreement_verdict("step()", None, [[1, 2, 3, 4], [1, 2, 3, 4]]) is None
        True
        >>> agreement_verdict("step()", None, [[1, 2, 3, 4], ("ValueError", "bad")])
        ValueError('step() failed on rank(s) [1]: bad')
    """
    if problem is not None:
        return problem
    failed = {r: v for r, v in enumerate(everyone) if isinstance(v, tuple)}
    if failed:
        kinds: dict[str, type[Exception]] = {"TypeError": TypeError, "ValueError": ValueError}
        name, message = next(iter(failed.values()))
        ranks = sorted(failed)
        shown = f"{ranks[:8]}" + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
        return kinds.get(name, RuntimeError)(f"{call} failed on rank(s) {shown}: {message}")
    prints = [cast(list[int], v) for v in everyone]
    differ = [r for r, v in enumerate(prints) if v != prints[0]]
    if not differ:
        return None
    lines = "; ".join(
        f"rank {r}: {v[1]} parameters in {v[0]} groups, {v[2]} elements, fingerprint {v[3]:x}"
        for r, v in [(0, prints[0])] + [(r, prints[r]) for r in differ[:3]]
    )
    return RuntimeError(
        f"{call}: ranks disagree on the parameters (shapes, dtypes or devices): {len(differ)} of "
        f"{len(prints)} ranks differ from rank 0 ({lines}): build the optimizer, and call "
        "add_param_group, on every rank with the same parameters in the same order"
    )


def check_unfrozen(
    built: Sequence[bool], now: Sequence[bool], shapes: Sequence[object], ddp: bool
) -> list[int]:
    """The parameters frozen when the optimizer was built that now require gradients; where a
    DDP module known to the optimizer reduces the gradients (``ddp``: overlap mode), a
    RuntimeError naming them (:func:`unfrozen_error`). Otherwise they train from then on, as in
    torch's class, once the ranks' gradients are found averaged (:func:`unaveraged`).

    Args:
        built: Each parameter's ``requires_grad`` when the ownership was built.
        now: Each one's ``requires_grad`` now.
        shapes: Each one's shape (for the message).
        ddp: Whether a DDP module known to the optimizer reduces the gradients.

    Returns:
        The global indices of the parameters unfrozen since the optimizer was built.

    Example:
        >>> check_unfrozen([True, False], [False, False], [(2,), (3,)], ddp=True)  # freezing
        []
        >>> check_unfrozen([True, False], [True, True], [(2,), (3,)], ddp=False)
        [1]
        >>> check_unfrozen([True, False], [True, True], [(2,), (3,)], ddp=True)
        Traceback (most recent call last):
        ...
        RuntimeError: parameter(s) 1 (3,) (global index, shape) were frozen (requires_grad=False) when this optimizer and DDP were built and now require gradients: DDP does not average their gradients (it reduces only the parameters trainable when it was built) and overlap mode never updates them, so they would train wrongly. Rebuild DDP and the ZeroRedundancyOptimizer after unfreezing (or build both with the parameters trainable and give them lr=0 until they should train)
    """
    woke = [k for k, (was, is_now) in enumerate(zip(built, now)) if is_now and not was]
    if woke and ddp:
        raise unfrozen_error(woke, shapes)
    return woke


def unfrozen_error(woke: Sequence[int], shapes: Sequence[object]) -> RuntimeError:
    """The refusal of parameters ``woke`` (global indices), frozen when DDP was built.

    Example:
        >>> str(unfrozen_error([0], [(2,)]))[:41]
        'parameter(s) 0 (2,) (global index, shape)'
    """
    listed = ", ".join(f"{k} {tuple(cast(Sequence[int], shapes[k]))}" for k in woke[:8])
    more = f" and {len(woke) - 8} more" if len(woke) > 8 else ""
    return RuntimeError(
        f"parameter(s) {listed}{more} (global index, shape) were frozen "
        "(requires_grad=False) when this optimizer and DDP were built and now require "
        "gradients: DDP does not average their gradients (it reduces only the parameters "
        "trainable when it was built) and overlap mode never updates them, so they would "
        "train wrongly. Rebuild DDP and the ZeroRedundancyOptimizer after unfreezing (or "
        "build both with the parameters trainable and give them lr=0 until they should train)"
    )


def grad_checksums(grads: Sequence[Tensor]) -> Tensor:
    """Per gradient, its sum and its sum of squares in float64, then the same negated: one
    all-reduce with MAX gives every rank the maxima and (negated) minima over the ranks.

    Example:
        >>> grad_checksums([torch.tensor([1.0, 2.0])]).tolist()
        [3.0, 5.0, -3.0, -5.0]
    """
    sums = [torch.stack([g.double().sum(), g.double().square().sum()]) for g in grads]
    flat = torch.cat(sums) if sums else torch.zeros(0, dtype=torch.float64)
    return torch.cat([flat, -flat])


def unaveraged(indices: Sequence[int], reduced: Tensor) -> list[int]:
    """Of the parameters ``indices``, those whose gradients differ between ranks, from the
    MAX all-reduce of :func:`grad_checksums`: no one averaged them (a DDP built while they
    were frozen); averaged gradients are the same on every rank.

    Example:
        >>> unaveraged([4, 7], torch.tensor([3.0, 5.0, 1.0, 1.0, -3.0, -5.0, -0.5, -1.0]))
        [7]
    """
    n = 2 * len(indices)
    high, low = reduced[:n].view(-1, 2), -reduced[n:].view(-1, 2)
    return [k for k, h, lo in zip(indices, high, low) if not torch.equal(h, lo)]


def check_inputs(
    params: object,
    optimizer_class: object,
    partition: object,
    overlap_with_ddp: bool,
    defaults: dict[str, Any],
) -> tuple[list[Any], Optimizer]:
    """Every local check of ``ZeroRedundancyOptimizer``'s arguments, in the order a user's
    mistake is most likely: the parameters, the class, the partition and what it needs, the
    hyperparameters' types, then torch's own validation of their values.

    Returns:
        The parameters (or groups) as a list, and a probe instance of the class over one
        placeholder parameter: its ``defaults`` are the class's full defaults (betas, eps,
        ...), so that ``param_groups`` carry every key torch's class would show.

    Raises:
        TypeError: A wrong type (parameters, class, hyperparameter).
        ValueError: A wrong value (no parameters, unknown partition, a per-tensor optimizer
            under ``"flat"``, a non-contiguous parameter under ``"flat"``, torch's own checks).

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
    """The local checks of a group given to ``add_param_group`` (as group ``index`` of an
    optimizer of class ``default``): its parameters, their devices for ``backend``, its own
    class (:func:`own_class_group`), and under ``"flat"`` that they can be split.

    Example:
        >>> check_new_group({"params": [torch.zeros(2)]}, "gloo", "flat")
        >>> check_new_group({"params": [torch.zeros(2, device="meta")]}, "gloo", "flat")
        Traceback (most recent call last):
        ...
        ValueError: parameter 0 is on the meta device (it has no data)...
    """
    items = check_params([param_group])
    check_devices(param_tensors(items), backend)
    if is_mixed(items):
        check_group_classes(items, default, index)
    if partition == "flat":
        check_splittable(param_tensors(split_items(items, default)))


def warn_ignored_bucket_view(overlap_with_ddp: bool, parameters_as_bucket_view: bool) -> None:
    """One warning when ``parameters_as_bucket_view`` is asked for in overlap mode, where DDP's
    gradient buckets group the parameters instead (torch's rule).

    Example:
        >>> warn_ignored_bucket_view(overlap_with_ddp=False, parameters_as_bucket_view=True)
    """
    if overlap_with_ddp and parameters_as_bucket_view:
        logging.getLogger("zero_functional.optimizer").warning(
            "parameters_as_bucket_view=True is ignored when overlap_with_ddp=True: "
            "parameters are grouped by DDP's gradient buckets instead"
        )


def group_class(group: Any, default: type[Optimizer]) -> type[Optimizer]:
    """The class that runs ``group``: its ``"optimizer_class"`` (a class, or a name
    :func:`~zero_functional.functional.registry.optimizer_by_name` knows), else ``default``.

    Raises:
        TypeError: The key holds neither an ``Optimizer`` subclass nor a known name.

    Example:
        >>> group_class({"params": [], "optimizer_class": "torch.optim.Adam"}, torch.optim.SGD)
        <class 'torch.optim.adam.Adam'>
        >>> group_class({"params": []}, torch.optim.SGD)
        <class 'torch.optim.sgd.SGD'>
    """
    value = group.get(GROUP_CLASS_KEY) if isinstance(group, dict) else None
    if value is None:
        return default
    cls = optimizer_by_name(value) if isinstance(value, str) else value
    if not (isinstance(cls, type) and issubclass(cls, Optimizer)):
        raise TypeError(
            f"a param group's {GROUP_CLASS_KEY!r} must be a torch.optim.Optimizer subclass (or "
            f"the name of a torch.optim or registered class), got {value!r}"
        )
    return cls


def is_mixed(items: Sequence[Any]) -> bool:
    """Whether any param group carries its own ``"optimizer_class"``.

    Example:
        >>> is_mixed([{"params": [], "optimizer_class": torch.optim.SGD}]), is_mixed([])
        (True, False)
    """
    return any(isinstance(g, dict) and GROUP_CLASS_KEY in g for g in items)


def param_blocks(
    param_groups: Sequence[Any], default: type[Optimizer], defaults: Mapping[str, Any]
) -> list[int] | None:
    """Per parameter (global index), the quantization block of its class's state
    (:func:`~zero_functional.functional.registry.update_block`: torchao's low-bit optimizers),
    which ``"flat"`` cuts on; ``None`` where no class has blocks. The constructor's keyword
    ``defaults`` reach ``default``'s groups only.

    Example:
        >>> param_blocks([{"params": [torch.zeros(2)]}], torch.optim.AdamW, {}) is None
        True
    """
    blocks = [
        update_block(cls, defaults if cls is default else None)
        for g in param_groups
        for cls in [group_class(g, default)]
        for _ in g["params"]
    ]
    return blocks if any(b > 1 for b in blocks) else None


def split_items(items: Sequence[Any], default: type[Optimizer]) -> list[Any]:
    """The groups (or tensors) ``partition="flat"`` splits: those of an elementwise class
    (with classes per group, the others are owned whole).

    Example:
        >>> g = {"params": [torch.zeros(2, 2)], "optimizer_class": torch.optim.Muon}
        >>> split_items([g, {"params": []}], torch.optim.SGD)
        [{'params': []}]
    """
    if not is_mixed(items):
        return list(items)
    return [g for g in items if update_kind(group_class(g, default)) == "elementwise"]


def _taken_keys(optimizer_class: type) -> set[str] | None:
    """The hyperparameters ``optimizer_class``'s constructor takes (``None``: any)."""
    try:
        parameters = inspect.signature(optimizer_class).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return {p.name for p in parameters if p.name != "params"}


def own_class_group(group: dict[str, Any], index: int) -> dict[str, Any]:
    """Group ``index`` as its own class fills it (that class's defaults, not the optimizer's),
    its class recorded by name; the class's own checks ran on its values and parameters.

    Raises:
        TypeError: Not a class, or a hyperparameter the class does not take (named, with the
            class), or one of the wrong type.
        ValueError: The class refused the group (its own message, with the group's index:
            Muon's for a parameter that is not 2-D).

    Example:
        >>> g = own_class_group({"params": [torch.zeros(2, 2)], "optimizer_class": torch.optim.Muon}, 0)
        >>> g["optimizer_class"], g["momentum"]
        ('torch.optim.Muon', 0.95)
        >>> own_class_group({"params": [torch.zeros(2)], "optimizer_class": torch.optim.Muon}, 1)
        Traceback (most recent call last):
        ...
        ValueError: parameter group 1 (torch.optim.Muon): Muon only supports 2D parameters whereas we found a parameter with size: torch.Size([2])
    """
    cls = group_class(group, Optimizer)
    name = optimizer_name(cls)
    hyper = {k: v for k, v in group.items() if k not in ("params", GROUP_CLASS_KEY)}
    taken = _taken_keys(cls)
    unknown = [k for k in hyper if taken is not None and k not in taken | set(IGNORED_GROUP_KEYS)]
    if unknown:
        raise TypeError(
            f"parameter group {index} runs {name}, which takes no hyperparameter "
            f"{unknown[0]!r} (it takes {', '.join(sorted(taken or ()))})"
        )
    check_hyperparameter_types(cls, hyper)
    ps = group["params"]
    params = [ps] if isinstance(ps, Tensor) else list(ps)
    try:
        filled = cls([{**hyper, "params": params}]).param_groups[0]  # type: ignore[call-arg]
    except ValueError as e:
        raise ValueError(f"parameter group {index} ({name}): {e}") from e
    return {**filled, GROUP_CLASS_KEY: name}


def check_group_classes(items: Sequence[Any], default: type[Optimizer], first: int = 0) -> None:
    """Every group's own class: :func:`own_class_group`, and no class whose step needs a
    closure (it cannot share a step with other classes); ``first`` is the first group's index.

    Example:
        >>> check_group_classes([{"params": [torch.zeros(2)], "optimizer_class": torch.optim.LBFGS}],
        ...                     torch.optim.SGD)
        Traceback (most recent call last):
        ...
        ValueError: parameter group 0 runs LBFGS, whose step re-evaluates the model through a closure: it cannot share a step with other groups' classes; give it its own optimizer
    """
    for i, g in enumerate(items, start=first):
        cls = group_class(g, default)
        if update_kind(cls) == "closure":
            raise ValueError(
                f"parameter group {i} runs {cls.__name__}, whose step re-evaluates the model "
                "through a closure: it cannot share a step with other groups' classes; give it "
                "its own optimizer"
            )
        if isinstance(g, dict) and GROUP_CLASS_KEY in g:
            own_class_group(g, i)
