"""Agreement: verdicts every rank shares, from local checks and one small gather of objects.

A check failed on one rank only would leave the others waiting in its next collective.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import Tensor
from torch.optim import Optimizer

from zero_functional import comm
from zero_functional.core.checks import check_devices, check_inputs, check_world_size, param_tensors
from zero_functional.core.fingerprint import (
    agreement_verdict,
    fingerprint,
    grad_checksums,
    unaveraged,
    unfrozen_error,
)
from zero_functional.core.main_params import check_main_params_dtype, check_remainders
from zero_functional.functional import update_kind

# what a failed local check raises; anything else is a bug, raised where it happens
CHECK_ERRORS: tuple[type[Exception], ...] = (TypeError, ValueError, RuntimeError)


def agree(
    call: str,
    check: Callable[[], object],
    items: Sequence[Any],
    group: comm.ProcessGroup,
    timeout: float | None = None,
    errors: tuple[type[Exception], ...] = CHECK_ERRORS,
) -> None:
    """Run ``check``; raise its error on every rank if it failed on any, or ``items`` differ.

    Example:
        >>> agree("example()", lambda: int("x"), [], group)
        Traceback (most recent call last):
        ...
        ValueError: invalid literal for int() with base 10: 'x'
    """
    problem: Exception | None = None
    try:
        check()
    except errors as e:
        problem = e
    mine = (type(problem).__name__, str(problem)) if problem is not None else fingerprint(items)
    with comm.call(call, group, timeout=timeout):
        everyone = comm.all_gather_objects(mine, group)
    error = agreement_verdict(call, problem, everyone)
    if error is not None:
        raise error


def agreed_inputs(
    params: object,
    optimizer_class: object,
    process_group: comm.ProcessGroup | None,
    partition: object,
    overlap_with_ddp: bool,
    defaults: Mapping[str, Any],
    timeout: float | None = None,
    main_params_dtype: object = None,
    store_param_remainders: object = False,
    gather_dtype: object = None,
) -> tuple[comm.ProcessGroup, list[Any], Optimizer]:
    """The optimizer's arguments checked on every rank: the group, the items and the probe.

    Example:
        >>> agreed_inputs([], torch.optim.SGD, None, "flat", False, {"lr": 0.1})
        Traceback (most recent call last):
        ...
        ValueError: ZeroRedundancyOptimizer got an empty parameter list
    """
    problem: Exception | None = None
    checked: tuple[list[Any], Optimizer] | None = None
    try:
        checked = check_inputs(params, optimizer_class, partition, overlap_with_ddp, dict(defaults))
        main = check_main_params_dtype(main_params_dtype)
        if comm.check_wire_dtype(gather_dtype, "gather_dtype") is not None:
            if store_param_remainders:
                raise ValueError(
                    "gather_dtype sends each step's change, which every rank adds to its "
                    "parameters, and store_param_remainders keeps main copies as the remainder "
                    "below the parameter: pass store_param_remainders=False"
                )
            main = main or torch.float32
        if main is not None and update_kind(cast(type, optimizer_class)) != "elementwise":
            which = "main_params_dtype" if gather_dtype is None else "gather_dtype (main copies)"
            raise ValueError(
                f"{which} needs an elementwise optimizer; "
                f"{cast(type, optimizer_class).__name__} couples its parameters"
            )
        dtypes = [t.dtype for t in param_tensors(checked[0])]
        check_remainders(store_param_remainders, main, dtypes)
    except CHECK_ERRORS as e:
        problem = e
    try:
        group = comm.default_group(process_group)
    except RuntimeError:
        if problem is not None:
            raise problem from None
        raise
    items, backend = (checked[0] if checked is not None else []), comm.backend(group)

    def check() -> None:
        if problem is not None:
            raise problem
        check_devices(param_tensors(items), backend)
        check_world_size(cast(type, optimizer_class), comm.group_size(group))

    agree("ZeroRedundancyOptimizer()", check, items, group, timeout=timeout)
    assert checked is not None  # agree raised otherwise
    return group, items, checked[1]


def check_averaged(
    grads: Mapping[int, Tensor],
    params: Sequence[Tensor],
    group: comm.ProcessGroup,
    timeout: float | None = None,
) -> None:
    """Refuse, naming DDP, unfrozen parameters whose gradients differ between ranks: no one
    averaged them (a DDP built while they were frozen does not).

    Example:
        >>> check_averaged({0: torch.ones(2)}, [torch.zeros(2)], group)
    """
    if not grads or comm.group_size(group) == 1:
        return
    indices = sorted(grads)
    with comm.call("step() (unfrozen parameters' gradients compared)", group, timeout=timeout):
        checksums = grad_checksums([grads[k] for k in indices])
        reduced = comm.all_reduce_scalar(checksums, group, op="max")
    differ = unaveraged(indices, reduced)
    if differ:
        raise unfrozen_error(differ, [p.shape for p in params])
