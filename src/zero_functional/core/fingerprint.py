"""What the ranks compare before they build or change anything (pure): a fingerprint of the
parameters, and the verdict once every rank's check result is known."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, cast

from torch import Tensor

from zero_functional.core.checks import param_tensors


def fingerprint(items: Sequence[Any]) -> list[int]:
    """Groups, parameters, elements and a hash of each parameter's shape, dtype and device
    type (tensors or param groups): what every rank must agree on.

    Example:
        >>> a = fingerprint([torch.zeros(3)])
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
    """What a rank raises once each rank's ``(error type name, message)`` or
    :func:`fingerprint` is known: its own problem first, else another rank's, else one error
    naming the ranks whose fingerprints differ from rank 0's.

    Example:
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
