r"""Adam and AdamW as ``torch.optim.Adam`` / ``torch.optim.AdamW`` compute them.

With gradient :math:`g_t` (negated when maximizing), step :math:`t`, learning rate
:math:`\gamma` and weight decay :math:`\lambda`:

.. math::
    g_t &\leftarrow g_t + \lambda \theta_{t-1} \text{ (L2), or }
        \theta_{t-1} \leftarrow (1 - \gamma\lambda)\theta_{t-1} \text{ (decoupled, AdamW)} \\
    m_t &\leftarrow \beta_1 m_{t-1} + (1 - \beta_1) g_t \\
    v_t &\leftarrow \beta_2 v_{t-1} + (1 - \beta_2) g_t^2, \quad
        \hat v_t = \max(\hat v_{t-1}, v_t) \text{ with amsgrad, else } v_t \\
    \theta_t &\leftarrow \theta_{t-1} - \frac{\gamma}{1 - \beta_1^t}
        \frac{m_t}{\sqrt{\hat v_t}/\sqrt{1 - \beta_2^t} + \epsilon}

One record (:class:`AdamHyper`), one state (:class:`AdamState`), one worker
(:func:`adam_apply_`): torch's fused kernel, the foreach path that is torch's
``_multi_tensor_adam`` operation for operation, or a ``torch.compile`` graph per (device, dtype)
group. AdamW is Adam with decoupled decay (``functools.partial``).

Example:
    >>> p = [torch.tensor([1.0])]
    >>> adamw_update(p, [torch.tensor([0.0])], adam_init(p), lr=0.1, weight_decay=0.5)[0]
    [tensor([0.9500])]
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from zero_functional.functional import compiled
from zero_functional.functional._common import (
    bias_corrections,
    check_lists,
    check_real_number,
    group_indices,
    pure_from_inplace,
    reject_tensor,
    to_dicts,
)

FUSED_DEVICE_TYPES: tuple[str, ...] = ("cpu", "cuda")
FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class AdamHyper(NamedTuple):
    """The keys of a ``torch.optim.Adam`` group that change the update, torch's defaults, in
    torch's order (:data:`ADAMW_DEFAULTS`: AdamW's); ``fused``: ``None`` torch's fused kernels where
    they apply, ``False`` foreach (torch's default numerics), ``True`` fused or an error."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0
    amsgrad: bool = False
    maximize: bool = False
    decoupled_weight_decay: bool = False
    fused: bool | None = None

    def validated(self) -> AdamHyper:
        """This record with ``betas`` as a tuple, after torch.optim.Adam's checks (its messages).

        Example:
            >>> AdamHyper(betas=[0.5, 0.5]).validated().betas
            (0.5, 0.5)
        """
        reject_tensor("lr", self.lr)
        if not 0.0 <= self.lr:
            raise ValueError(f"Invalid learning rate: {self.lr}")
        if not 0.0 <= self.eps:
            raise ValueError(f"Invalid epsilon value: {self.eps}")
        beta1, beta2 = self.betas
        reject_tensor("betas[0]", beta1)
        reject_tensor("betas[1]", beta2)
        if not 0.0 <= beta1 < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {beta1}")
        if not 0.0 <= beta2 < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {beta2}")
        if not 0.0 <= self.weight_decay:
            raise ValueError(f"Invalid weight_decay value: {self.weight_decay}")
        return self._replace(betas=(beta1, beta2))


ADAM_DEFAULTS = AdamHyper()
ADAMW_KEYWORDS: dict[str, Any] = {"weight_decay": 1e-2, "decoupled_weight_decay": True}
ADAMW_DEFAULTS = ADAM_DEFAULTS._replace(**ADAMW_KEYWORDS)  # torch.optim.AdamW's


class AdamState(NamedTuple):
    """Per param, torch.optim.Adam's state (``max_exp_avg_sq`` empty without amsgrad); ``step``
    a 0-d float32 on the param's device, where the fused kernels read it."""

    step: list[Tensor]
    exp_avg: list[Tensor]
    exp_avg_sq: list[Tensor]
    max_exp_avg_sq: list[Tensor]

    @classmethod
    def from_dicts(
        cls, dicts: Sequence[Mapping[str, Tensor]], params: Sequence[Tensor], h: AdamHyper
    ) -> AdamState:
        """The state of torch's per-param dicts (empty: fresh), not copied but for ``step``,
        moved to a float32 on its param's device (torch keeps it on the CPU).

        Example:
            >>> AdamState.from_dicts([{}], [torch.zeros(2)], ADAM_DEFAULTS).exp_avg
            [tensor([0., 0.])]
        """
        # Allocate fresh state only where a dict is empty: this runs on every step of the shell.
        empty = [i for i, d in enumerate(dicts) if not d]
        born = dict(zip(empty, to_dicts(adam_init([params[i] for i in empty], amsgrad=h.amsgrad))))
        out = cls(step=[], exp_avg=[], exp_avg_sq=[], max_exp_avg_sq=[])
        for i, (d, p) in enumerate(zip(dicts, params)):
            d = d or born[i]
            out.step.append(torch.as_tensor(d["step"], dtype=torch.float32, device=p.device))
            out.exp_avg.append(d["exp_avg"])
            out.exp_avg_sq.append(d["exp_avg_sq"])
            if h.amsgrad:
                if "max_exp_avg_sq" not in d:
                    raise ValueError(
                        f"state_from_dicts: amsgrad=True but the state of param {i} has no "
                        "'max_exp_avg_sq' (it was stepped with amsgrad=False); torch.optim "
                        "would fail here too: keep amsgrad as it was when the state was made"
                    )
                out.max_exp_avg_sq.append(d["max_exp_avg_sq"])
        return out


def adam_init(params: Sequence[Tensor], *, amsgrad: bool = ADAM_DEFAULTS.amsgrad) -> AdamState:
    """Fresh Adam state for ``params``: step 0, zero moments (and maxima with ``amsgrad``).

    Example:
        >>> adam_init([torch.ones(2)]).step
        [tensor(0.)]
    """

    def zeros() -> list[Tensor]:
        return [torch.zeros_like(p, memory_format=torch.preserve_format) for p in params]

    steps = [torch.zeros((), dtype=torch.float32, device=p.device) for p in params]
    return AdamState(steps, zeros(), zeros(), zeros() if amsgrad else [])


def _foreach(ps: list[Tensor], gs: list[Tensor], s: AdamState, h: AdamHyper) -> None:
    # Same operations in the same order as torch's _multi_tensor_adam (capturable=False).
    ms, vs, vmaxs, steps = s.exp_avg, s.exp_avg_sq, s.max_exp_avg_sq, s.step
    beta1, beta2 = h.betas
    if torch.is_complex(ps[0]):
        ps, gs, ms, vs = ([torch.view_as_real(t) for t in ts] for ts in (ps, gs, ms, vs))
        vmaxs = [torch.view_as_real(t) for t in vmaxs]
    owned = h.maximize  # whether gs are our temporaries or the caller's grads
    if owned:
        gs = list(torch._foreach_neg(gs))
    torch._foreach_add_(steps, 1)
    if h.weight_decay != 0:
        if h.decoupled_weight_decay:
            torch._foreach_mul_(ps, 1 - h.lr * h.weight_decay)
        elif owned:
            torch._foreach_add_(gs, ps, alpha=h.weight_decay)
        else:
            gs = list(torch._foreach_add(gs, ps, alpha=h.weight_decay))
    torch._foreach_lerp_(ms, gs, 1 - beta1)
    torch._foreach_mul_(vs, beta2)
    torch._foreach_addcmul_(vs, gs, gs, 1 - beta2)
    del gs
    # One host sync per group (torch syncs once per param via .item()).
    step_size, bias_correction2_sqrt = bias_corrections(h.lr, h.betas, torch.stack(steps).tolist())
    if h.amsgrad:
        torch._foreach_maximum_(vmaxs, vs)
        denom = torch._foreach_sqrt(vmaxs)
    else:
        denom = torch._foreach_sqrt(vs)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, h.eps)
    torch._foreach_addcdiv_(ps, ms, denom, step_size)


def _fused(ps: list[Tensor], gs: list[Tensor], s: AdamState, h: AdamHyper) -> None:
    for i, (p, t) in enumerate(zip(ps, s.step)):
        if t.device != p.device:
            raise RuntimeError(
                f"fused Adam needs each step tensor on its param's device, but a step is on "
                f"{t.device} and its param on {p.device} (group entry {i}); build the state "
                "with adam_init or state_from_dicts, which place it there"
            )
    torch._foreach_add_(s.step, 1)
    kernel = torch._fused_adamw_ if h.decoupled_weight_decay else torch._fused_adam_
    beta1, beta2 = h.betas
    kernel(
        ps,
        gs,
        s.exp_avg,
        s.exp_avg_sq,
        s.max_exp_avg_sq if h.amsgrad else [],
        s.step,
        amsgrad=h.amsgrad,
        lr=h.lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=h.weight_decay,
        eps=h.eps,
        maximize=h.maximize,
        grad_scale=None,
        found_inf=None,
    )


@torch.no_grad()
def adam_update_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    state: AdamState,
    *,
    lr: float = ADAM_DEFAULTS.lr,
    betas: tuple[float, float] = ADAM_DEFAULTS.betas,
    eps: float = ADAM_DEFAULTS.eps,
    weight_decay: float = ADAM_DEFAULTS.weight_decay,
    amsgrad: bool = ADAM_DEFAULTS.amsgrad,
    maximize: bool = ADAM_DEFAULTS.maximize,
    decoupled_weight_decay: bool = ADAM_DEFAULTS.decoupled_weight_decay,
    fused: bool | None = ADAM_DEFAULTS.fused,
    compile: bool | None = False,
) -> None:
    """One Adam step in place (``grads`` only read), the lists checked first; ``fused=True`` wins
    over ``compile`` (as :func:`~zero_functional.functional.sgd_update_`'s).

    Example:
        >>> p = [torch.tensor([1.0, -1.0])]
        >>> adam_update_(p, [torch.tensor([0.5, -0.5])], adam_init(p), lr=0.1, fused=False)
        >>> p[0]
        tensor([ 0.9000, -0.9000])
    """
    h = AdamHyper._make(map(locals().__getitem__, AdamHyper._fields))  # spelled once: above
    n_lists = 4 if amsgrad and state.max_exp_avg_sq else 3  # none at all: adam_apply_ says why
    check_lists("adam_update_", params, grads, dict(zip(state._fields[:n_lists], state)))
    adam_apply_(params, grads, state, h, compile=compile)


@torch.no_grad()
def adam_apply_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    state: AdamState,
    h: AdamHyper,
    *,
    compile: bool | None = False,
) -> None:
    """The worker: :func:`adam_update_` from a record, the lists trusted (the shell builds them);
    the hyperparameters are still checked (a scheduler may have written a Tensor).

    Example:
        >>> p = [torch.tensor([1.0])]
        >>> adam_apply_(p, [torch.tensor([3.0])], adam_init(p), AdamHyper(lr=0.1))
        >>> p[0]
        tensor([0.9000])
    """
    if h.amsgrad and params and not state.max_exp_avg_sq:
        raise ValueError(
            "adam_update_: amsgrad=True but state.max_exp_avg_sq is empty; create the state "
            "with adam_init(params, amsgrad=True)"
        )
    beta1, beta2 = h.betas
    for name, value in (("lr", h.lr), ("betas[0]", beta1), ("betas[1]", beta2)):
        check_real_number("adam_update_", name, value)
    for (device, dtype), idx in group_indices(params).items():
        ps, gs = [params[i] for i in idx], [grads[i] for i in idx]
        step, exp_avg, exp_avg_sq, vmax = ([ts[i] for i in idx] if ts else [] for ts in state)
        s = AdamState(step, exp_avg, exp_avg_sq, vmax if h.amsgrad else [])
        # an explicit fused=True wins; a graph that cannot compile falls back to eager
        if h.fused is not True and compiled.chosen("adam", compile, ps):
            if compiled.adam_group(ps, gs, s, h):
                continue
        use_fused = (
            h.fused is not False and device.type in FUSED_DEVICE_TYPES and dtype in FUSED_DTYPES
        )
        if h.fused and not use_fused:
            raise RuntimeError(
                f"adam_update_(fused=True): params[{idx[0]}] is {dtype} on {device.type}, but "
                f"torch's fused Adam kernels take device types {list(FUSED_DEVICE_TYPES)} "
                f"and dtypes {[str(d) for d in FUSED_DTYPES]}; pass fused=None to use "
                "foreach kernels where fused ones do not apply"
            )
        (_fused if use_fused else _foreach)(ps, gs, s, h)


adam_update = pure_from_inplace(adam_update_)

adamw_update_ = functools.partial(adam_update_, **ADAMW_KEYWORDS)
adamw_update_.__doc__ = ":func:`adam_update_` with torch.optim.AdamW's decoupled weight decay."
adamw_update = functools.partial(adam_update, **ADAMW_KEYWORDS)
adamw_update.__doc__ = ":func:`adam_update` with torch.optim.AdamW's decoupled weight decay."
