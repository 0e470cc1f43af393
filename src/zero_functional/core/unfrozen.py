"""Parameters frozen when the optimizer was built that now train (pure): found, refused where
DDP never averages them, and their gradients compared across ranks otherwise."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import Tensor

from zero_functional.core._validate import first_of


def check_unfrozen(
    built: Sequence[bool], now: Sequence[bool], shapes: Sequence[object], ddp: bool
) -> list[int]:
    """The parameters frozen (``built``) that now require gradients (``now``); where a DDP
    module the optimizer knows reduces the gradients (``ddp``), a RuntimeError naming them.
    Otherwise they train, as in torch's class, once found averaged (:func:`unaveraged`).

    Example:
        >>> check_unfrozen([True, False], [True, True], [(2,), (3,)], ddp=False)
        [1]
    """
    woke = [k for k, (was, is_now) in enumerate(zip(built, now)) if is_now and not was]
    if woke and ddp:
        raise unfrozen_error(woke, shapes)
    return woke


def unfrozen_error(woke: Sequence[int], shapes: Sequence[object]) -> RuntimeError:
    """The refusal of parameters ``woke`` (global indices) frozen when DDP was built.

    Example:
        >>> str(unfrozen_error([0], [(2,)]))[:41]
        'parameter(s) 0 (2,) (global index, shape)'
    """
    listed = first_of([f"{k} {tuple(cast(Sequence[int], shapes[k]))}" for k in woke])
    return RuntimeError(
        f"parameter(s) {listed} (global index, shape) were frozen "
        "(requires_grad=False) when this optimizer and DDP were built and now require "
        "gradients: DDP does not average their gradients (it reduces only the parameters "
        "trainable when it was built) and overlap mode never updates them, so they would "
        "train wrongly. Rebuild DDP and the ZeroRedundancyOptimizer after unfreezing (or "
        "build both with the parameters trainable and give them lr=0 until they should train)"
    )


def grad_checksums(grads: Sequence[Tensor]) -> Tensor:
    """Per gradient its sum and sum of squares in float64, then the same negated: one MAX
    all-reduce gives every rank the maxima and (negated) minima over the ranks.

    Example:
        >>> grad_checksums([torch.tensor([1.0, 2.0])]).tolist()
        [3.0, 5.0, -3.0, -5.0]
    """
    sums = [torch.stack([g.double().sum(), g.double().square().sum()]) for g in grads]
    flat = torch.cat(sums) if sums else torch.zeros(0, dtype=torch.float64)
    return torch.cat([flat, -flat])


def unaveraged(indices: Sequence[int], reduced: Tensor) -> list[int]:
    """Of the parameters ``indices``, those whose gradients differ between ranks (from the MAX
    all-reduce of :func:`grad_checksums`): nothing averaged them.

    Example:
        >>> unaveraged([4, 7], torch.tensor([3.0, 5.0, 1.0, 1.0, -3.0, -5.0, -0.5, -1.0]))
        [7]
    """
    n = 2 * len(indices)
    high, low = reduced[:n].view(-1, 2), -reduced[n:].view(-1, 2)
    return [k for k, h, lo in zip(indices, high, low) if not torch.equal(h, lo)]
