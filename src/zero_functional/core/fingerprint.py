"""What the ranks compare before they build or change anything (pure): a fingerprint of the
parameters, the gradients of parameters unfrozen since the build, and the verdicts."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor

from zero_functional.core._validate import first_of
from zero_functional.core.checks import param_tensors


def fingerprint(items: Sequence[Any]) -> list[int]:
    """What ranks must agree on: groups, parameters, elements, a hash of shapes, dtypes, devices.

    Example:
        >>> fingerprint([{"params": [torch.zeros(3), torch.zeros(2)]}])[:3]
        [1, 2, 5]
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
    """What a rank raises once each rank's ``(error type name, message)`` or :func:`fingerprint`
    is known: its own problem, else another rank's, else the ranks that differ from rank 0.

    Example:
        >>> agreement_verdict("step()", None, [[1, 2, 3, 4], ("ValueError", "bad")])
        ValueError('step() failed on rank(s) [1]: bad')
    """
    if problem is not None:
        return problem
    if failed := {r: v for r, v in enumerate(everyone) if isinstance(v, tuple)}:
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
    """The parameters frozen at the build that now require gradients: an error under a DDP the
    optimizer knows (``ddp``), else they train, as in torch's, once averaged (:func:`unaveraged`).

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
    """Of ``indices``, those whose gradients differ between ranks (:func:`grad_checksums`).

    Example:
        >>> unaveraged([4, 7], torch.tensor([3.0, 5.0, 1.0, 1.0, -3.0, -5.0, -0.5, -1.0]))
        [7]
    """
    n = 2 * len(indices)
    high, low = reduced[:n].view(-1, 2), -reduced[n:].view(-1, 2)
    return [k for k, h, lo in zip(indices, high, low) if not torch.equal(h, lo)]
