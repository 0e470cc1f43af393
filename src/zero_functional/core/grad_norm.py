"""Gradient norms from the pieces a rank owns, in torch's arithmetic (pure, but for ``clip_``).

As ``clip_grad_norm_``: the norm of the tensors' norms, per rank over its pieces, then over the
ranks, so that whole tensors give torch's total bit for bit."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from zero_functional.functional import group_indices


def local_norm(
    grads: Sequence[Tensor], pieces: Sequence[Tensor], norm_type: float, device: torch.device
) -> Tensor:
    """This rank's share of the total: the norm of the gradient ``pieces`` it owns (0 if none),
    on the device of all ``grads`` (else ``device``), in float64 where any of them is.

    Example:
        >>> g = torch.tensor([3.0, 4.0, 12.0])
        >>> local_norm([g], [g[:2]], 2.0, torch.device("cpu"))
        tensor(5.)
    """
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"norm_type must be positive (or inf), got {norm_type}")
    at = grads[0].device if grads else device
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    with torch.no_grad():
        norms = [
            n.to(at)
            for idx in group_indices(pieces).values()
            for n in torch._foreach_norm([pieces[i].detach() for i in idx], norm_type)
        ]
        if not norms:
            return torch.zeros((), device=at, dtype=dtype)
        total: Tensor = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        return total.to(dtype)


def total_norm(rank_norms: Tensor, norm_type: float, error_if_nonfinite: bool = False) -> Tensor:
    """The norm of the ranks' norms (a RuntimeError where non-finite and ``error_if_nonfinite``).

    Example:
        >>> total_norm(torch.tensor([3.0, 4.0]), 2.0)
        tensor(5.)
    """
    total: Tensor = torch.linalg.vector_norm(rank_norms, float(norm_type))
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {float(norm_type)} of the gradients is non-finite, so it "
            "cannot be clipped; pass error_if_nonfinite=False to clip anyway"
        )
    return total


def clip_(grads: Sequence[Tensor], total: Tensor, max_norm: float) -> None:
    """Scale ``grads`` in place by ``max_norm / (total + 1e-6)`` where below 1 (torch's rule).

    Example:
        >>> g = torch.tensor([3.0, 4.0])
        >>> clip_([g], torch.tensor(5.0), 1.0); g
        tensor([0.6000, 0.8000])
    """
    with torch.no_grad():
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for (dev, _), idx in group_indices(grads).items():
            torch._foreach_mul_([grads[i] for i in idx], coef.to(dev))
