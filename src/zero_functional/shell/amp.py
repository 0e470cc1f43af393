"""AMP: GradScaler verdicts every rank shares, from the gradients each rank owns (after a reduce
onto owners no rank sees every gradient, yet all must skip, or step, together)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.amp import GradScaler

from zero_functional import comm
from zero_functional.core.ownership import Run
from zero_functional.functional import group_indices


def unscale_and_check_(grads: list[Tensor], inv_scale: float, device: torch.device) -> Tensor:
    """Multiply ``grads`` by ``inv_scale`` in place; 1.0 if any was non-finite, else 0.0.

    Example:
        >>> g = torch.tensor([2.0, float("inf")])
        >>> unscale_and_check_([g], 0.5, g.device), g
        (tensor(1.), tensor([1., inf]))
    """
    found = torch.zeros(1, dtype=torch.float32, device=device)
    live = [g for g in grads if g.numel()]
    for (dev, _), idx in group_indices(live).items():
        local = torch.zeros(1, dtype=torch.float32, device=dev)
        inv = torch.full((), inv_scale, dtype=torch.float32, device=dev)
        torch._amp_foreach_non_finite_check_and_unscale_([live[i] for i in idx], local, inv)
        found = torch.maximum(found, local.to(device))
    return found.reshape(())


class ScalerFacade:
    """What ``GradScaler.unscale_`` reads from an optimizer: overlap mode has no ``scaler.step``,
    so ``scaler.update()`` learns of a skip from this object's one "gradient", inf exactly then."""

    def __init__(self) -> None:
        self.param_groups: list[dict[str, Any]] = [{"params": []}]

    def record(self, scaler: GradScaler, found: Tensor) -> None:
        verdict = torch.where(found > 0, float("inf"), 0.0).reshape(1)
        holder = verdict.detach().clone()
        holder.grad = verdict
        self.param_groups = [{"params": [holder]}]
        scaler.unscale_(self)  # type: ignore[arg-type]
        self.param_groups = [{"params": []}]


def common_verdict(
    buckets: list[tuple[Tensor, tuple[Run, ...], comm.Pending]], rank: int, group: comm.ProcessGroup
) -> None:
    """Make every rank's GradScaler see the same thing after a reduce onto owners: owned pieces
    as reduced, the others zero, a NaN everywhere if any rank's owned pieces were not finite."""
    owned: list[Tensor] = []
    with torch.no_grad():
        for flat, runs, pending in buckets:
            pending.wait()
            for a, b, owner in runs:
                if owner == rank:
                    owned.append(flat[a:b])
                else:
                    flat[a:b].zero_()
        # GradScaler's own check (scale 1: the values stay as they are for scaler.step)
        found = unscale_and_check_(owned, 1.0, buckets[-1][0].device)
        found = comm.all_reduce_scalar(found, group, op="max")
        last = buckets[-1][0]
        if last.numel():
            last[:1] = torch.where(found > 0, float("nan"), last[:1])


def refuse_scaler_step(optimizer: object, kwargs: Mapping[str, Any]) -> None:
    """Refuse ``scaler.step(zero)`` in overlap mode (the step ran in backward), naming the recipe.

    Example:
        >>> refuse_scaler_step(object(), {})  # a plain step()
    """
    if "grad_scaler" in kwargs or getattr(optimizer, "found_inf", None) is not None:
        raise RuntimeError(
            "scaler.step(zero) cannot work with overlap_with_ddp=True: the step already ran "
            "inside backward, on the scaled gradients. Pass the scaler to the hook instead, "
            "hook_with_zero_step(allreduce_hook, ddp, zero, grad_scaler=scaler), and call "
            "only scaler.scale(loss).backward() and scaler.update()"
        )


def unscaled(
    grads: Mapping[int, Tensor], dtypes: Mapping[int, torch.dtype | None], grad_scale: Tensor
) -> dict[int, Tensor]:
    """``grads`` divided by ``grad_scale``, each first cast to its main copy's dtype (``dtypes``).

    Example:
        >>> g = {0: torch.tensor([1024.0], dtype=torch.float16)}
        >>> unscaled(g, {0: torch.float32}, torch.tensor(1024.0))
        {0: tensor([1.])}
    """
    inv = grad_scale.double().reciprocal().float()
    return {k: g.to(dtypes.get(k) or g.dtype) * inv.to(g.device) for k, g in grads.items()}


def overlap_verdict(
    scaler: GradScaler,
    facade: ScalerFacade,
    owned: list[Tensor],
    fallback: torch.device,
    group: comm.ProcessGroup,
) -> bool:
    """Overlap mode's GradScaler step: unscale ``owned``, agree, tell ``scaler``; whether to skip.

    Example:
        >>> scaler, g = GradScaler("cpu", init_scale=4.0), torch.full((2,), 8.0)
        >>> _ = scaler.scale(torch.ones(()))  # as the loss is scaled before backward
        >>> overlap_verdict(scaler, ScalerFacade(), [g], g.device, group), g
        (False, tensor([2., 2.]))
    """
    device = owned[0].device if owned else fallback
    found = unscale_and_check_(owned, 1.0 / scaler.get_scale(), device)
    found = comm.all_reduce_scalar(found, group, op="max")
    facade.record(scaler, found)
    return bool(found.item())
