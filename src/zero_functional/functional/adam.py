r"""Adam and AdamW, as ``torch.optim.Adam`` / ``torch.optim.AdamW`` compute them.

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

Two kernel paths: torch's fused ``_fused_adam_``/``_fused_adamw_`` and the foreach path that is
operation for operation torch's ``_multi_tensor_adam`` (which on CPU gives the same bits as
torch's default single-tensor path).

Example:
    The pure update is the in-place one on copies; AdamW is Adam with decoupled decay:

    >>> import torch
    >>> p = [torch.tensor([1.0])]
    >>> new_p, new_s = adam_update(p, [torch.tensor([3.0])], adam_init(p), lr=0.1)
    >>> new_p[0], p[0], new_s.step[0]
    (tensor([0.9000]), tensor([1.]), tensor(1.))
    >>> new_p, _ = adamw_update(p, [torch.tensor([0.0])], adam_init(p), lr=0.1, weight_decay=0.5)
    >>> new_p[0]
    tensor([0.9500])
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from zero_functional.functional._common import (
    FUSED_ADAM_DEVICE_TYPES,
    FUSED_ADAM_DTYPES,
    check_lists,
    check_real_number,
    fused_adam_supports,
    group_indices,
    pure_from_inplace,
)

__all__ = [
    "AdamState",
    "adam_init",
    "adam_update",
    "adam_update_",
    "adamw_update",
    "adamw_update_",
]


class AdamState(NamedTuple):
    """Per-parameter Adam state, keyed as torch.optim.Adam's state dict.

    Attributes:
        step: 0-dim float32 step counts, each on its param's device (the fused kernels read it
            there; torch's non-fused Adam keeps it on the CPU instead).
        exp_avg: first-moment running averages.
        exp_avg_sq: second-moment running averages.
        max_exp_avg_sq: running maxima of ``exp_avg_sq`` when amsgrad, else ``[]``.
    """

    step: list[Tensor]
    exp_avg: list[Tensor]
    exp_avg_sq: list[Tensor]
    max_exp_avg_sq: list[Tensor]


def adam_init(params: Sequence[Tensor], *, amsgrad: bool = False) -> AdamState:
    """Create zero Adam state for ``params``.

    Args:
        params: the parameters the state belongs to.
        amsgrad: also allocate ``max_exp_avg_sq``.

    Returns:
        An ``AdamState`` with step 0 and zero moments shaped like each param.

    Example:
        >>> import torch
        >>> s = adam_init([torch.ones(2)], amsgrad=True)
        >>> s.step[0], s.exp_avg[0], len(s.max_exp_avg_sq)
        (tensor(0.), tensor([0., 0.]), 1)
    """
    return AdamState(
        step=[torch.zeros((), dtype=torch.float32, device=p.device) for p in params],
        exp_avg=[torch.zeros_like(p, memory_format=torch.preserve_format) for p in params],
        exp_avg_sq=[torch.zeros_like(p, memory_format=torch.preserve_format) for p in params],
        max_exp_avg_sq=(
            [torch.zeros_like(p, memory_format=torch.preserve_format) for p in params]
            if amsgrad
            else []
        ),
    )


def _check_state(
    fn: str, params: Sequence[Tensor], grads: Sequence[Tensor], state: AdamState, amsgrad: bool
) -> None:
    lists: dict[str, Sequence[Tensor | None]] = {
        "step": state.step,
        "exp_avg": state.exp_avg,
        "exp_avg_sq": state.exp_avg_sq,
    }
    if amsgrad:
        if not state.max_exp_avg_sq and params:
            raise ValueError(
                f"{fn}: amsgrad=True but state.max_exp_avg_sq is empty; create the state with "
                "adam_init(params, amsgrad=True)"
            )
        lists["max_exp_avg_sq"] = state.max_exp_avg_sq
    check_lists(fn, params, grads, lists)


def _foreach_group(
    ps: list[Tensor],
    gs: list[Tensor],
    ms: list[Tensor],
    vs: list[Tensor],
    vmaxs: list[Tensor],
    steps: list[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
    decoupled_weight_decay: bool,
) -> None:
    # Same operations in the same order as torch's _multi_tensor_adam (capturable=False).
    if torch.is_complex(ps[0]):
        ps, gs, ms, vs = ([torch.view_as_real(t) for t in ts] for ts in (ps, gs, ms, vs))
        vmaxs = [torch.view_as_real(t) for t in vmaxs]
    owned = False
    if maximize:
        gs = list(torch._foreach_neg(gs))
        owned = True
    torch._foreach_add_(steps, 1)
    if weight_decay != 0:
        if decoupled_weight_decay:
            torch._foreach_mul_(ps, 1 - lr * weight_decay)
        elif owned:
            torch._foreach_add_(gs, ps, alpha=weight_decay)
        else:
            gs = list(torch._foreach_add(gs, ps, alpha=weight_decay))
    torch._foreach_lerp_(ms, gs, 1 - beta1)
    torch._foreach_mul_(vs, beta2)
    torch._foreach_addcmul_(vs, gs, gs, 1 - beta2)
    del gs
    # One host sync per group (torch syncs once per param via .item()).
    step_values: list[float] = torch.stack(steps).tolist()
    bias_correction1 = [1 - beta1**s for s in step_values]
    bias_correction2 = [1 - beta2**s for s in step_values]
    step_size = [(lr / bc) * -1 for bc in bias_correction1]
    bias_correction2_sqrt = [bc**0.5 for bc in bias_correction2]
    if amsgrad:
        torch._foreach_maximum_(vmaxs, vs)
        denom = torch._foreach_sqrt(vmaxs)
    else:
        denom = torch._foreach_sqrt(vs)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(ps, ms, denom, step_size)


def _fused_group(
    ps: list[Tensor],
    gs: list[Tensor],
    ms: list[Tensor],
    vs: list[Tensor],
    vmaxs: list[Tensor],
    steps: list[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
    decoupled_weight_decay: bool,
) -> None:
    for i, (p, s) in enumerate(zip(ps, steps)):
        if s.device != p.device:
            raise RuntimeError(
                f"fused Adam needs each step tensor on its param's device, but a step is on "
                f"{s.device} and its param on {p.device} (group entry {i}); build the state "
                "with adam_init or state_from_dicts, which place it there"
            )
    torch._foreach_add_(steps, 1)
    kernel = torch._fused_adamw_ if decoupled_weight_decay else torch._fused_adam_
    kernel(
        ps,
        gs,
        ms,
        vs,
        vmaxs if amsgrad else [],
        steps,
        amsgrad=amsgrad,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        eps=eps,
        maximize=maximize,
        grad_scale=None,
        found_inf=None,
    )


@torch.no_grad()
def adam_update_(
    params: Sequence[Tensor],
    grads: Sequence[Tensor],
    state: AdamState,
    *,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    maximize: bool = False,
    decoupled_weight_decay: bool = False,
    fused: bool | None = None,
) -> None:
    """Apply one Adam step in place, grouped by (device, dtype).

    ``params`` and the state tensors are updated in place; ``grads`` are never modified.

    Args:
        params: parameters, updated in place.
        grads: one gradient per parameter, same shape, dtype and device.
        state: from :func:`adam_init` (or a previous step) for the same params.
        lr: learning rate.
        betas: running-average coefficients for the gradient and its square.
        eps: added to the denominator.
        weight_decay: L2 penalty, or decoupled decay when ``decoupled_weight_decay``.
        amsgrad: use the AMSGrad maximum of the second moment.
        maximize: maximize the objective instead of minimizing it.
        decoupled_weight_decay: AdamW's decay ``param *= 1 - lr * weight_decay``.
        fused: ``None`` uses torch's fused kernels for the groups they support
            (CPU/CUDA, float16/bfloat16/float32/float64) and foreach kernels for the rest;
            ``False`` always uses foreach kernels (torch.optim.Adam's default numerics);
            ``True`` requires the fused kernels.

    Raises:
        RuntimeError: ``fused=True`` with a param the fused kernels do not support.
        ValueError: when the lists have different lengths or a grad does not match its param.

    Example:
        >>> import torch
        >>> p = [torch.tensor([1.0, -1.0])]
        >>> s = adam_init(p)
        >>> adam_update_(p, [torch.tensor([0.5, -0.5])], s, lr=0.1, fused=False)
        >>> p[0], s.step[0]
        (tensor([ 0.9000, -0.9000]), tensor(1.))
    """
    _check_state("adam_update_", params, grads, state, amsgrad)
    check_real_number("adam_update_", "lr", lr)
    beta1, beta2 = betas
    check_real_number("adam_update_", "betas[0]", beta1)
    check_real_number("adam_update_", "betas[1]", beta2)
    for (device, dtype), indices in group_indices(params).items():
        use_fused = fused is not False and fused_adam_supports(params[indices[0]])
        if fused and not use_fused:
            raise RuntimeError(
                f"adam_update_(fused=True): params[{indices[0]}] is {dtype} on {device.type}, but "
                f"torch's fused Adam kernels take device types {list(FUSED_ADAM_DEVICE_TYPES)} "
                f"and dtypes {[str(d) for d in FUSED_ADAM_DTYPES]}; pass fused=None to use "
                "foreach kernels where fused ones do not apply"
            )
        group = _fused_group if use_fused else _foreach_group
        group(
            [params[i] for i in indices],
            [grads[i] for i in indices],
            [state.exp_avg[i] for i in indices],
            [state.exp_avg_sq[i] for i in indices],
            [state.max_exp_avg_sq[i] for i in indices] if amsgrad else [],
            [state.step[i] for i in indices],
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            decoupled_weight_decay=decoupled_weight_decay,
        )


adam_update = pure_from_inplace(adam_update_)

# AdamW is Adam with decoupled weight decay and torch.optim.AdamW's default weight_decay
adamw_update_ = functools.partial(adam_update_, weight_decay=1e-2, decoupled_weight_decay=True)
adamw_update = functools.partial(adam_update, weight_decay=1e-2, decoupled_weight_decay=True)
adamw_update_.__doc__ = ":func:`adam_update_` with AdamW's decoupled weight decay (default 1e-2)."
adamw_update.__doc__ = ":func:`adam_update` with AdamW's decoupled weight decay (default 1e-2)."
