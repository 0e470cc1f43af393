r"""SGD with momentum, dampening, Nesterov and weight decay, as ``torch.optim.SGD`` computes it.

With gradient :math:`g_t`, weight decay :math:`\lambda`, momentum :math:`\mu`, dampening
:math:`\tau` and learning rate :math:`\gamma`:

.. math::
    g_t &\leftarrow \pm g_t + \lambda \theta_{t-1} \quad (- \text{ when maximize}) \\
    b_t &\leftarrow g_t \text{ at the first step, else } \mu b_{t-1} + (1 - \tau) g_t \\
    g_t &\leftarrow g_t + \mu b_t \text{ (nesterov) or } b_t \\
    \theta_t &\leftarrow \theta_{t-1} - \gamma g_t
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from zero_functional.functional import compiled
from zero_functional.functional._common import (
    check_lists,
    check_real_number,
    group_indices,
    pure_from_inplace,
    reject_tensor,
)


class SGDHyper(NamedTuple):
    """The keys of a ``torch.optim.SGD`` group that change the update, torch's defaults, in
    torch's order: the one list of them (building one checks nothing: :meth:`validated` does)."""

    lr: float = 1e-3
    momentum: float = 0
    dampening: float = 0
    weight_decay: float = 0
    nesterov: bool = False
    maximize: bool = False

    def validated(self) -> SGDHyper:
        """This record, after torch.optim.SGD's checks (with torch's messages).

        Example:
            >>> SGDHyper(lr=0.1).validated().lr
            0.1
        """
        reject_tensor("lr", self.lr)
        reject_tensor("weight_decay", self.weight_decay)
        if self.lr < 0.0:
            raise ValueError(f"Invalid learning rate: {self.lr}")
        if self.momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {self.momentum}")
        if self.weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {self.weight_decay}")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        return self


SGD_DEFAULTS = SGDHyper()


class SGDState(NamedTuple):
    """Per param, its momentum buffer, ``None`` until its first step with momentum."""

    momentum_buffer: list[Tensor | None]

    @classmethod
    def from_dicts(
        cls, dicts: Sequence[Mapping[str, Tensor]], params: Sequence[Tensor], h: SGDHyper
    ) -> SGDState:
        """The state of torch's per-param dicts (``{}`` before a buffer exists), not copied.

        Example:
            >>> SGDState.from_dicts([{}, {"momentum_buffer": torch.ones(1)}], [], SGD_DEFAULTS)
            SGDState(momentum_buffer=[None, tensor([1.])])
        """
        return cls(momentum_buffer=[d.get("momentum_buffer") for d in dicts])


def sgd_init(params: Sequence[Tensor]) -> SGDState:
    """The SGD state of ``params`` as torch.optim.SGD starts: no buffers yet.

    Example:
        >>> sgd_init([torch.zeros(2), torch.zeros(3)])
        SGDState(momentum_buffer=[None, None])
    """
    return SGDState(momentum_buffer=[None] * len(params))


def _foreach(ps: list[Tensor], gs: list[Tensor], bufs: list[Tensor | None], h: SGDHyper) -> None:
    owned = h.maximize  # whether gs are our temporaries (safe to modify) or the caller's grads
    if owned:
        gs = list(torch._foreach_neg(gs))
    if h.weight_decay != 0:
        if owned:
            torch._foreach_add_(gs, ps, alpha=h.weight_decay)
        else:
            gs = list(torch._foreach_add(gs, ps, alpha=h.weight_decay))
            owned = True
    if h.momentum != 0:
        present: list[Tensor] = []
        if all(b is not None for b in bufs):
            present = [b for b in bufs if b is not None]
            torch._foreach_mul_(present, h.momentum)
            torch._foreach_add_(present, gs, alpha=1 - h.dampening)
        else:
            for j, b in enumerate(bufs):
                if b is None:
                    b = bufs[j] = gs[j].detach().clone()
                else:
                    b.mul_(h.momentum).add_(gs[j], alpha=1 - h.dampening)
                present.append(b)
        if h.nesterov:
            # compat: torch's foreach SGD adds into p.grad itself here when neither
            # maximize nor weight_decay made a copy; we never touch the caller's grads.
            if owned:
                torch._foreach_add_(gs, present, alpha=h.momentum)
            else:
                gs = list(torch._foreach_add(gs, present, alpha=h.momentum))
        else:
            gs = present
    torch._foreach_add_(ps, gs, alpha=-h.lr)


@torch.no_grad()
def sgd_update_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    state: SGDState,
    *,
    lr: float = SGD_DEFAULTS.lr,
    momentum: float = SGD_DEFAULTS.momentum,
    dampening: float = SGD_DEFAULTS.dampening,
    weight_decay: float = SGD_DEFAULTS.weight_decay,
    nesterov: bool = SGD_DEFAULTS.nesterov,
    maximize: bool = SGD_DEFAULTS.maximize,
    compile: bool | None = False,
) -> None:
    """One SGD step in place (``grads`` only read), the lists checked first; ``compile``: ``True``
    a ``torch.compile`` graph for float32/64 on CPU/CUDA, ``None`` where
    :func:`~zero_functional.functional.compile_policy` says, ``False`` never.

    Example:
        >>> p, g = [torch.tensor([1.0, 2.0])], [torch.tensor([1.0, 1.0])]
        >>> sgd_update_(p, g, sgd_init(p), lr=0.1, momentum=0.9); p[0]
        tensor([0.9000, 1.9000])
    """
    h = SGDHyper._make(map(locals().__getitem__, SGDHyper._fields))  # spelled once: above
    check_lists("sgd_update_", params, grads, {"momentum_buffer": state.momentum_buffer})
    sgd_apply_(params, grads, state, h, compile=compile)


@torch.no_grad()
def sgd_apply_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    state: SGDState,
    h: SGDHyper,
    *,
    compile: bool | None = False,
) -> None:
    """The worker: :func:`sgd_update_` from a record, the lists trusted (the shell builds them),
    one kernel per (device, dtype); ``lr`` is still checked.

    Example:
        >>> p = [torch.tensor([1.0])]
        >>> sgd_apply_(p, [torch.tensor([2.0])], sgd_init(p), SGDHyper(lr=0.5)); p[0]
        tensor([0.])
    """
    check_real_number("sgd_update_", "lr", h.lr)
    all_bufs = state.momentum_buffer
    for idx in group_indices(params).values():
        graph = compile is not False and compiled.chosen("sgd", compile, [params[i] for i in idx])
        # torch makes buffers at a param's first step: those with and those without one yet
        # are two graphs (a group normally has all or none)
        parts = [idx]
        if compile is not False and h.momentum != 0:
            parts = [[i for i in idx if all_bufs[i] is not None]]
            parts.append([i for i in idx if all_bufs[i] is None])
        for part in filter(None, parts):
            ps, gs = [params[i] for i in part], [grads[i] for i in part]
            bufs = [all_bufs[i] for i in part]
            if not (graph and compiled.sgd_group(ps, gs, bufs, h)):
                _foreach(ps, gs, bufs, h)
            for i, b in zip(part, bufs):
                all_bufs[i] = b


sgd_update = pure_from_inplace(sgd_update_)
