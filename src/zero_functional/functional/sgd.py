r"""SGD with momentum, dampening, Nesterov and weight decay, as ``torch.optim.SGD`` computes it.

With gradient :math:`g_t`, weight decay :math:`\lambda`, momentum :math:`\mu`, dampening
:math:`\tau` and learning rate :math:`\gamma`:

.. math::
    g_t &\leftarrow \pm g_t + \lambda \theta_{t-1} \quad (- \text{ when maximize}) \\
    b_t &\leftarrow g_t \text{ at the first step, else } \mu b_{t-1} + (1 - \tau) g_t \\
    g_t &\leftarrow g_t + \mu b_t \text{ (nesterov) or } b_t \\
    \theta_t &\leftarrow \theta_{t-1} - \gamma g_t

The momentum buffer is only created (lazily, at the first step) when ``momentum != 0``.

Example:
    The pure update is the in-place one on copies:

    >>> import torch
    >>> p = [torch.tensor([1.0])]
    >>> new_p, new_state = sgd_update(p, [torch.tensor([2.0])], sgd_init(p), lr=0.5)
    >>> new_p[0], p[0]
    (tensor([0.]), tensor([1.]))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from zero_functional.functional._common import (
    check_lists,
    check_real_number,
    group_indices,
    pure_from_inplace,
)

__all__ = ["SGDState", "sgd_init", "sgd_update", "sgd_update_"]


class SGDState(NamedTuple):
    """Per-parameter SGD state.

    Attributes:
        momentum_buffer: one entry per param; ``None`` until the first step with
            ``momentum != 0`` (torch creates the buffer lazily as a copy of the first grad).
    """

    momentum_buffer: list[Tensor | None]


def sgd_init(params: Sequence[Tensor], *, momentum: float = 0.0) -> SGDState:
    """Create the SGD state for ``params``: no buffers yet, as torch.optim.SGD starts.

    Args:
        params: the parameters the state belongs to.
        momentum: accepted for symmetry with the update; buffers are created lazily either way.

    Returns:
        An ``SGDState`` with ``len(params)`` ``None`` buffers.

    Example:
        >>> import torch
        >>> sgd_init([torch.zeros(2), torch.zeros(3)], momentum=0.9)
        SGDState(momentum_buffer=[None, None])
    """
    del momentum
    return SGDState(momentum_buffer=[None] * len(params))


@torch.no_grad()
def sgd_update_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    state: SGDState,
    *,
    lr: float = 1e-3,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    maximize: bool = False,
) -> None:
    """Apply one SGD step in place with torch's foreach kernels, grouped by (device, dtype).

    ``params`` and the momentum buffers are updated in place; a ``None`` buffer is replaced
    inside the ``state.momentum_buffer`` list. ``grads`` are never modified.

    Args:
        params: parameters, updated in place.
        grads: one gradient per parameter, same shape, dtype and device.
        state: from :func:`sgd_init` (or a previous step) for the same params.
        lr: learning rate.
        momentum: momentum factor; 0 disables the buffer.
        dampening: dampening for momentum.
        weight_decay: L2 penalty added to the gradient.
        nesterov: use Nesterov momentum.
        maximize: maximize the objective instead of minimizing it.

    Raises:
        ValueError: when the lists have different lengths or a grad does not match its param.
        TypeError: when ``lr`` is not a Python number.

    Example:
        >>> import torch
        >>> p = [torch.tensor([1.0, 2.0])]
        >>> state = sgd_init(p, momentum=0.9)
        >>> sgd_update_(p, [torch.tensor([1.0, 1.0])], state, lr=0.1, momentum=0.9)
        >>> p[0]
        tensor([0.9000, 1.9000])
        >>> state.momentum_buffer[0]
        tensor([1., 1.])
    """
    check_lists("sgd_update_", params, grads, {"momentum_buffer": state.momentum_buffer})
    check_real_number("sgd_update_", "lr", lr)
    bufs_all = state.momentum_buffer
    for indices in group_indices(params).values():
        ps = [params[i] for i in indices]
        gs: list[Tensor] = [grads[i] for i in indices]
        owned = False  # whether gs are our temporaries (safe to modify) or the caller's grads
        if maximize:
            gs = list(torch._foreach_neg(gs))
            owned = True
        if weight_decay != 0:
            if owned:
                torch._foreach_add_(gs, ps, alpha=weight_decay)
            else:
                gs = list(torch._foreach_add(gs, ps, alpha=weight_decay))
                owned = True
        if momentum != 0:
            existing = [bufs_all[i] for i in indices]
            bufs: list[Tensor] = []
            if all(b is not None for b in existing):
                bufs = [b for b in existing if b is not None]
                torch._foreach_mul_(bufs, momentum)
                torch._foreach_add_(bufs, gs, alpha=1 - dampening)
            else:
                for j, (i, b) in enumerate(zip(indices, existing)):
                    if b is None:
                        b = gs[j].detach().clone()
                        bufs_all[i] = b
                    else:
                        b.mul_(momentum).add_(gs[j], alpha=1 - dampening)
                    bufs.append(b)
            if nesterov:
                # compat: torch's foreach SGD adds into p.grad itself here when neither
                # maximize nor weight_decay made a copy; we never touch the caller's grads.
                if owned:
                    torch._foreach_add_(gs, bufs, alpha=momentum)
                else:
                    gs = list(torch._foreach_add(gs, bufs, alpha=momentum))
            else:
                gs = bufs
        torch._foreach_add_(ps, gs, alpha=-lr)


sgd_update = pure_from_inplace(sgd_update_)
