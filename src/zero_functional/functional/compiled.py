"""The compiled kernel: Adam/AdamW and SGD groups as ``torch.compile(fullgraph=True)`` graphs.

One fused loop per tensor for float32/float64 groups on CPU or CUDA. Values a scheduler may change
reach the graph as per-param coefficient tensors computed in Python floats as the eager path does
(no recompiles); what changes its structure keys one graph each. A configuration that fails to
compile warns once and runs eagerly from then on.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from zero_functional.functional._common import bias_corrections

if TYPE_CHECKING:  # annotations only: adam.py and sgd.py import this module
    from zero_functional.functional.adam import AdamHyper, AdamState
    from zero_functional.functional.sgd import SGDHyper

COMPILED_DEVICE_TYPES: tuple[str, ...] = ("cpu", "cuda")
COMPILED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64)

_log = logging.getLogger(__name__)

# cache key -> compiled graph; cache key -> why its compilation failed (never retried)
_GRAPHS: dict[tuple[object, ...], Callable[..., list[Tensor]]] = {}
_FAILED: dict[tuple[object, ...], str] = {}


COMPILE_FASTER_FROM: dict[tuple[str, str, torch.dtype], int] = {}
"""``(name, device type, dtype) -> numel``: from how many elements in a group the compiled
update measured faster than the eager default (empty: nowhere yet; benchmarks/README.md)."""


def compile_policy(name: str, device_type: str, dtype: torch.dtype, numel: int) -> bool:
    """Whether a group runs compiled by default: where :data:`COMPILE_FASTER_FROM` says so.

    Example:
        >>> compile_policy("adam", "cpu", torch.float32, 8 << 20)
        False
    """
    least = COMPILE_FASTER_FROM.get((name, device_type, dtype))
    return least is not None and numel >= least


# torch.compile takes isolate_recompiles from torch 2.13 on (2.11 refuses it: seen on an H200)
_ISOLATE = "isolate_recompiles" in inspect.signature(torch.compile).parameters


def _compile(fn: Callable[..., list[Tensor]]) -> Callable[..., list[Tensor]]:
    """One compiled region per cache key, recompiling apart from the others' where torch can."""
    if not _ISOLATE:
        return torch.compile(fn, fullgraph=True)
    # torch 2.13's overloads of torch.compile do not list isolate_recompiles yet
    return torch.compile(fn, fullgraph=True, isolate_recompiles=True)  # type: ignore[call-overload, no-any-return]


def _coefficients(rows: list[list[float]], like: Tensor) -> list[Tensor]:
    """The graph's scalars for each param (``rows[i]``), in its dtype and on its device: a
    tensor per param (inductor would fuse loops reading one shared buffer into a slower one)."""
    return list(torch.tensor(rows, dtype=like.dtype, device=like.device).unbind(0))


def _fma(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """``a * b + c`` rounded once, as torch's CPU kernels round it (vectorized ``fmadd``)."""
    if c.dtype == torch.float32 and c.device.type == "cpu":
        # inductor's CPU backend has no FMA: the float64 product of two floats is exact
        return (a.double() * b.double() + c.double()).float()
    # CUDA: inductor lowers addcmul to an FMA as eager does; float64 on CPU: rounded twice
    return torch.addcmul(c, a, b)


def chosen(kind: str, compile: bool | None, ps: Sequence[Tensor]) -> bool:
    """Whether a group runs compiled: ``compile`` asks (``None``: :func:`compile_policy`), it has
    elements, and the graphs take it (a request they cannot meet warns once)."""
    if compile is False:
        return False
    device, dtype, numel = ps[0].device, ps[0].dtype, sum(p.numel() for p in ps)
    if numel == 0 or (compile is None and not compile_policy(kind, device.type, dtype, numel)):
        return False
    if device.type in COMPILED_DEVICE_TYPES and dtype in COMPILED_DTYPES:
        return True
    key = (kind, device, dtype)
    if key not in _FAILED:
        _FAILED[key] = "unsupported"
        _log.warning(
            "zero_functional: the compiled %s update takes %s params on %s, not %s on %s; "
            "running the eager update for these params",
            kind,
            "/".join(str(d).removeprefix("torch.") for d in COMPILED_DTYPES),
            "/".join(COMPILED_DEVICE_TYPES),
            str(dtype).removeprefix("torch."),
            device,
        )
    return False


def _run(
    kind: str,
    graph: Callable[..., list[Tensor]],
    args: tuple[object, ...],
    like: Tensor,
    flags: dict[str, bool],
) -> list[Tensor] | None:
    """Run ``graph`` compiled for ``like``'s device and dtype and ``flags``; ``None`` when it
    cannot be compiled (warned the first time, never retried)."""
    key = (kind, like.device, like.dtype, *flags.items())
    if key in _FAILED:
        return None
    try:
        compiled = _GRAPHS.get(key)
        if compiled is None:
            compiled = _GRAPHS[key] = _compile(graph)
        return compiled(*args, **flags)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # whatever dynamo, inductor or the C++ compiler raise
        lines = str(e).strip().splitlines()
        _FAILED[key] = reason = f"{type(e).__name__}: {lines[0] if lines else ''}"
        _GRAPHS.pop(key, None)
        _log.warning(
            "zero_functional: the compiled %s update could not be compiled for %s on %s with "
            "%s (%s); running the eager update for this configuration from now on",
            kind,
            str(like.dtype).removeprefix("torch."),
            like.device,
            ", ".join(f"{k}={v}" for k, v in flags.items()),
            reason,
        )
        return None


def _adam_graph(
    ps: list[Tensor],
    gs: list[Tensor],
    ms: list[Tensor],
    vs: list[Tensor],
    vmaxs: list[Tensor],
    coefs: list[Tensor],
    *,
    amsgrad: bool,
    maximize: bool,
    with_weight_decay: bool,
    decoupled_weight_decay: bool,
    lerp_small_weight: bool,
) -> list[Tensor]:
    for i in range(len(ps)):
        p, g, m, v = ps[i], gs[i], ms[i], vs[i]
        w1, b2, w2, eps, wd, keep, step_size, bc2_sqrt = (coefs[i][j] for j in range(8))
        if maximize:
            g = -g
        p_new = p
        if with_weight_decay:
            if decoupled_weight_decay:
                p_new = p * keep
            else:
                g = _fma(p, wd, g)
        # compat: torch's lerp is fma(w, end - start, start) for |w| < 0.5, else
        # fma(w - 1, end - start, end); the formula is part of the cache key
        diff = g - m
        m_new = _fma(w1, diff, m) if lerp_small_weight else _fma(w1 - 1, diff, g)
        v_new = _fma(w2 * g, g, v * b2)
        m.copy_(m_new)
        v.copy_(v_new)
        if amsgrad:
            vmax_new = torch.maximum(vmaxs[i], v_new)
            vmaxs[i].copy_(vmax_new)
            denom = vmax_new.sqrt()
        else:
            denom = v_new.sqrt()
        denom = denom / bc2_sqrt + eps
        p.copy_(p_new + (step_size * m_new) / denom)
    return []


def adam_group(ps: list[Tensor], gs: list[Tensor], state: AdamState, h: AdamHyper) -> bool:
    """One (device, dtype) group through the compiled graph; ``False`` if it cannot compile."""
    p0 = ps[0]
    beta1, beta2 = h.betas
    # the step counts after this update, as the eager path reads them: float32 + 1, then floats
    step_size, bc2_sqrt = bias_corrections(h.lr, h.betas, (torch.stack(state.step) + 1).tolist())
    shared = [1 - beta1, beta2, 1 - beta2, h.eps, h.weight_decay, 1 - h.lr * h.weight_decay]
    coefs = _coefficients([[*shared, a, b] for a, b in zip(step_size, bc2_sqrt)], p0)
    # torch's lerp tests the weight as the kernel holds it (a CPU tensor: no device sync)
    lerp_small_weight = abs(float(torch.tensor(1 - beta1, dtype=p0.dtype))) < 0.5
    flags = {
        "amsgrad": h.amsgrad,
        "maximize": h.maximize,
        "with_weight_decay": h.weight_decay != 0,
        "decoupled_weight_decay": h.decoupled_weight_decay,
        "lerp_small_weight": lerp_small_weight,
    }
    args = (ps, gs, state.exp_avg, state.exp_avg_sq, state.max_exp_avg_sq, coefs)
    if _run("adam", _adam_graph, args, p0, flags) is None:
        return False
    torch._foreach_add_(state.step, 1)
    return True


def _sgd_graph(
    ps: list[Tensor],
    gs: list[Tensor],
    bufs: list[Tensor],
    coefs: list[Tensor],
    *,
    maximize: bool,
    with_weight_decay: bool,
    with_momentum: bool,
    nesterov: bool,
    first_step: bool,
) -> list[Tensor]:
    born: list[Tensor] = []
    for i in range(len(ps)):
        p, g = ps[i], gs[i]
        wd, mu, keep, neg_lr = (coefs[i][j] for j in range(4))
        if maximize:
            g = -g
        if with_weight_decay:
            g = _fma(p, wd, g)
        if with_momentum:
            if first_step:
                buf = g.clone()  # a new tensor, never the caller's grad
                born.append(buf)
            else:
                buf = _fma(g, keep, bufs[i] * mu)
                bufs[i].copy_(buf)
            g = _fma(buf, mu, g) if nesterov else buf
        p.copy_(_fma(g, neg_lr, p))
    return born


def sgd_group(ps: list[Tensor], gs: list[Tensor], bufs: list[Tensor | None], h: SGDHyper) -> bool:
    """One group (all buffers present, or none: new ones go in ``bufs``) through the graph."""
    p0 = ps[0]
    first_step = h.momentum != 0 and bufs[0] is None
    coefs = _coefficients([[h.weight_decay, h.momentum, 1 - h.dampening, -h.lr]] * len(ps), p0)
    flags = {
        "maximize": h.maximize,
        "with_weight_decay": h.weight_decay != 0,
        "with_momentum": h.momentum != 0,
        "nesterov": h.nesterov,
        "first_step": first_step,
    }
    present = [] if first_step or h.momentum == 0 else [b for b in bufs if b is not None]
    born = _run("sgd", _sgd_graph, (ps, gs, present, coefs), p0, flags)
    if born is None:
        return False
    if first_step:
        bufs[:] = born
    return True
